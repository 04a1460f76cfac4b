"""Router processes (`python -m router ... --etcd-endpoints`) sharing one simulated fleet through a real etcd,
with a load that spreads requests over them: what the process-level cluster tests share."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from types import SimpleNamespace

import aiohttp
import orjson

from simulator.fleet import Fleet

from ..router_process import RouterProcess

TTL = 2
BODY = {"text": "the quick brown fox", "sampling_params": {"max_new_tokens": 16, "temperature": 0}}


@dataclass
class Answer:
    replica: int
    stream: bool
    status: int
    finish: str
    weight_version: str | None
    sent: float
    ended: float


class Load:
    """`per_replica` clients on each replica sending requests back to back (every other one streaming)."""

    def __init__(self, urls: list[str], per_replica: int = 2) -> None:
        self.urls = urls
        self.per_replica = per_replica
        self.answers: list[Answer] = []
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60))

    async def _one(self, replica: int, stream: bool) -> Answer:
        sent = time.monotonic()
        try:
            async with self._session.post(self.urls[replica] + "/generate", json={**BODY, "stream": stream}) as r:
                raw, status = await r.read(), r.status
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            return Answer(replica, stream, 0, f"{type(exc).__name__}: {exc}", None, sent, time.monotonic())
        ended = time.monotonic()
        if status != 200:
            return Answer(replica, stream, status, raw[:200].decode(errors="replace"), None, sent, ended)
        if stream:
            events = [b[6:] for b in raw.split(b"\n\n") if b.startswith(b"data: ")]
            if not events or events[-1] != b"[DONE]" or b'"error"' in events[-2]:
                return Answer(replica, stream, status, f"broken stream {events[-2:]}", None, sent, ended)
            last = orjson.loads(events[-2])
        else:
            last = orjson.loads(raw)
        meta = last["meta_info"]
        return Answer(replica, stream, status, meta["finish_reason"]["type"], meta.get("weight_version"), sent, ended)

    async def _user(self, replica: int, index: int) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            self.answers.append(await self._one(replica, stream=(index + n) % 2 == 0))

    def start(self) -> "Load":
        self._tasks = [asyncio.ensure_future(self._user(r, i)) for r in range(len(self.urls))
                       for i in range(self.per_replica)]
        return self

    def failed(self) -> list[Answer]:
        """Errors, and aborts a client could have been spared: the router re-sends what it aborted
        (retry_aborted) unless the client already saw tokens of it (a stream); such a stream ends with
        SGLang's clean abort answer (finish_reason abort, then [DONE])."""
        return [a for a in self.answers if a.status != 200
                or a.finish not in ("length", "stop", *(("abort",) if a.stream else ()))]

    async def finish(self) -> list[Answer]:
        self._stop.set()
        await asyncio.gather(*self._tasks)
        await self._session.close()
        return self.answers

    async def close(self) -> None:
        """At the end of a test that failed before finish()."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._session.close()


class Cluster:
    """etcd, a fleet, and router processes that name the fleet's first two prefill and decode servers."""

    def __init__(self, etcd, fleet: Fleet, tmp_path) -> None:
        self.etcd, self.fleet, self.tmp_path = etcd, fleet, tmp_path
        self.command_line = SimpleNamespace(prefill=fleet.prefill[:2], decode=fleet.decode[:2])
        self.routers: list[RouterProcess] = []
        self.loads: list[Load] = []
        self.started = 0

    def load(self, routers: list[RouterProcess], per_replica: int = 2) -> Load:
        load = Load([r.url for r in routers], per_replica).start()
        self.loads.append(load)
        return load

    def flags(self) -> list[str]:
        return ["--log-level", "info", "--etcd-endpoints", *self.etcd.endpoints, "--cluster-name", "e2e",
                "--etcd-lease-ttl-secs", str(TTL), "--health-check-interval-secs", "1"]

    async def start(self, count: int) -> list[RouterProcess]:
        new = []
        for _ in range(count):
            self.started += 1
            router = RouterProcess(self.command_line, *self.flags(), log_path=self.tmp_path / f"r{self.started}.log")
            new.append(router)
        self.routers += new
        await asyncio.gather(*(r.__aenter__() for r in new))
        return new

    async def close(self) -> None:
        for load in self.loads:
            await load.close()
        await asyncio.gather(*(r.__aexit__(None, None, None) for r in self.routers), return_exceptions=True)


async def get(router: RouterProcess, path: str) -> dict:
    try:
        async with router.session.get(router.url + path) as resp:
            assert resp.status == 200, (path, resp.status, await resp.text())
            return await resp.json()
    except aiohttp.ClientConnectionError as exc:
        raise AssertionError(router.why_unreachable(exc)) from exc


async def worker_view(router: RouterProcess, url: str) -> dict | None:
    async with router.session.get(f"{router.url}/workers/{url}") as resp:
        return await resp.json() if resp.status == 200 else None


async def fleet_view(router: RouterProcess) -> list[tuple]:
    workers = (await get(router, "/workers"))["workers"]
    return sorted((w["url"], w["role"], w["bootstrap_port"], w["state"], w["weight_version"]) for w in workers)


async def all_agree(routers: list[RouterProcess], url: str, condition) -> bool:
    views = await asyncio.gather(*(worker_view(r, url) for r in routers))
    return all(view is not None and condition(view) for view in views)
