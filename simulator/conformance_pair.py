"""The conformance scenarios' client: one prefill + one decode server driven by hand, every answer recorded
(`Pair.call` and its helpers). The scenarios are conformance_scenarios.py's; comparing two recordings is
conformance.py's."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

LONG_TOKENS = 1500  # long enough to still be running while a scenario acts on it
PROMPT = "Hello world, this is"


@dataclass
class Pair:
    prefill: str
    decode: str
    prefill_bootstrap_port: int
    decode_bootstrap_port: int
    host: str = "127.0.0.1"
    session: aiohttp.ClientSession | None = None
    steps: list[dict] = field(default_factory=list)
    # how long to let a server act before checking that something did NOT happen
    settle_s: float = 1.0
    # for calls expected to hang (a client gives up): None keeps each call's own timeout
    hang_s: float | None = None
    # act on long requests only once they decode (not while their KV is in transfer): a run that must
    # not depend on where an abort lands (the real fixtures were recorded without it)
    strict_running: bool = False

    def hang(self, timeout: float) -> float:
        return self.hang_s if self.hang_s is not None else timeout

    def url(self, role: str) -> str:
        return self.prefill if role == "prefill" else self.decode

    def pd_body(self, body: dict, *, port: int | None | str = "prefill", room: Any = None) -> dict:
        """``body`` with the bootstrap fields a router injects."""
        out = dict(body)
        out["bootstrap_host"] = self.host
        out["bootstrap_port"] = self.prefill_bootstrap_port if port == "prefill" else port
        out["bootstrap_room"] = random.getrandbits(62) if room is None else room
        return out

    async def call(
        self,
        role: str,
        method: str,
        path: str,
        body: Any = None,
        *,
        raw: bytes | None = None,
        headers: dict | None = None,
        label: str = "",
        timeout: float = 120.0,
    ) -> dict:
        """One HTTP exchange, recorded (status, content type, JSON or text or SSE events)."""
        assert self.session is not None
        started = time.monotonic()
        kwargs: dict[str, Any] = {"timeout": aiohttp.ClientTimeout(total=timeout)}
        if raw is not None:
            kwargs["data"] = raw
            kwargs["headers"] = headers or {"Content-Type": "application/json"}
        elif body is not None:
            kwargs["json"] = body
        step: dict[str, Any] = {"label": label, "server": role, "method": method, "path": path}
        if body is not None:
            step["request"] = body
        if raw is not None:
            step["request_raw"] = raw.decode(errors="replace")
        try:
            async with self.session.request(method, self.url(role) + path, **kwargs) as resp:
                step["status"] = resp.status
                step["content_type"] = resp.content_type
                if resp.content_type == "text/event-stream":
                    step["events"] = await _read_sse(resp)
                else:
                    data = await resp.read()
                    try:
                        step["json"] = orjson.loads(data)
                    except orjson.JSONDecodeError:
                        step["text"] = data.decode(errors="replace")
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            step["exception"] = type(exc).__name__
        step["elapsed_s"] = round(time.monotonic() - started, 3)
        self.steps.append(step)
        return step

    async def loads(self, role: str) -> dict:
        async with self.session.get(self.url(role) + "/v1/loads") as resp:  # type: ignore[union-attr]
            return (await resp.json())["loads"][0]

    async def wait_running(self, role: str, n: int = 1, timeout: float = 60.0) -> None:
        """Wait until ``role`` reports at least ``n`` running (or queued in PD) requests."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            load = await self.loads(role)
            queued = load["num_running_reqs"] + load["num_waiting_reqs"]
            disagg = load.get("disaggregation") or {}
            queued += sum(v for k, v in disagg.items() if k.endswith("_reqs"))
            if queued >= n:
                return
            await asyncio.sleep(0.05)
        raise TimeoutError(f"{role} never reached {n} requests")

    async def wait_idle(self, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            busy = 0
            for role in ("prefill", "decode"):
                load = await self.loads(role)
                disagg = load.get("disaggregation") or {}
                busy += load["num_running_reqs"] + load["num_waiting_reqs"]
                busy += sum(v for k, v in disagg.items() if k.endswith("_reqs"))
            if busy == 0:
                return
            await asyncio.sleep(0.1)
        raise TimeoutError("servers never became idle")


async def _read_sse(resp: aiohttp.ClientResponse) -> list:
    events: list = []
    async for line in resp.content:
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        events.append("[DONE]" if payload == b"[DONE]" else orjson.loads(payload))
    return events


def _gen(max_new_tokens: int = 8, **extra: Any) -> dict:
    body = {
        "text": PROMPT,
        "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True},
    }
    body.update(extra)
    return body


async def pd(pair: Pair, path: str, body: dict, label: str, **kw: Any) -> tuple[dict, dict]:
    """Send the same PD body to both servers concurrently, as a router does."""
    return await asyncio.gather(  # type: ignore[return-value]
        pair.call("prefill", "POST", path, body, label=label + ":prefill", **kw),
        pair.call("decode", "POST", path, body, label=label + ":decode", **kw),
    )
