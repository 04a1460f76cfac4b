"""The demo's Python part (scripts/demo.sh starts the fleet and the router, then runs this): what only
pd-router does, shown on a running router. Clients send requests the whole time; under that load one decode
server is converted to prefill and the fleet's weights are updated, both with `pd-router ctl`; then what
happened is printed (requests ok and failed, roles before and after, weight versions) and one more request
goes through. Exit 0 only if every request succeeded and every operation did what it said.

    python scripts/demo.py --router http://127.0.0.1:30000 [--clients 8] [--phase-secs 2] [--weights-path P]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import orjson

NEW_VERSION = "step-2"
SIM_WEIGHTS = "sim/step-2"  # the simulator loads any sim/... path
PROMPTS = ["The capital of France is", "Prefill and decode on different servers", "Once upon a time",
           "The quick brown fox"]


@dataclass
class Answer:
    started: float
    ended: float
    ok: bool
    version: str | None = None
    error: str = ""


@dataclass
class Load:
    """Clients sending /generate in a loop (every other one streaming) until stopped."""

    session: aiohttp.ClientSession
    url: str
    answers: list[Answer] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def client(self, n: int) -> None:
        i = 0
        while not self.stop.is_set():
            answer = await self.one(PROMPTS[(n + i) % len(PROMPTS)], stream=bool((n + i) % 2),
                                    max_new_tokens=16 + 8 * (i % 3))
            self.answers.append(answer)
            i += 1
            if not answer.ok:
                await asyncio.sleep(0.1)  # a client backs off after a failure instead of spinning

    async def one(self, prompt: str, *, stream: bool, max_new_tokens: int) -> Answer:
        body = {"text": prompt, "stream": stream, "sampling_params": {"max_new_tokens": max_new_tokens,
                                                                       "temperature": 0}}
        started = time.monotonic()
        try:
            async with self.session.post(self.url + "/generate", json=body) as resp:
                raw = await resp.read()
                status = resp.status
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            return Answer(started, time.monotonic(), False, error=f"{type(exc).__name__}: {exc}")
        ended = time.monotonic()
        if status != 200:
            return Answer(started, ended, False, error=f"HTTP {status}: {raw[:200].decode(errors='replace')}")
        if stream:
            events = [block[6:] for block in raw.split(b"\n\n") if block.startswith(b"data: ")]
            chunks = [orjson.loads(e) for e in events if e != b"[DONE]"]
            if not events or events[-1] != b"[DONE]" or not chunks or any("error" in c for c in chunks):
                return Answer(started, ended, False, error=f"stream: {raw[-200:].decode(errors='replace')}")
            last = chunks[-1]
        else:
            last = orjson.loads(raw)
        finish = last["meta_info"]["finish_reason"]["type"]
        if finish == "abort":
            return Answer(started, ended, False, error=f"aborted: {last['meta_info']['finish_reason']}")
        return Answer(started, ended, True, last["meta_info"].get("weight_version"))

    def counts(self, since: float = 0.0, until: float = float("inf")) -> tuple[int, int]:
        picked = [a for a in self.answers if since <= a.ended <= until]
        return sum(a.ok for a in picked), sum(not a.ok for a in picked)


class Demo:
    def __init__(self, session: aiohttp.ClientSession, router: str, clients: int, phase_secs: float,
                 weights_path: str) -> None:
        self.session = session
        self.weights_path = weights_path
        self.router = router
        self.clients = clients
        self.phase_secs = phase_secs
        self.load = Load(session, router)
        self.failures: list[str] = []
        self._ticking = True

    def say(self, text: str = "") -> None:
        print(text, flush=True)

    async def workers(self) -> dict[str, dict]:
        async with self.session.get(self.router + "/workers") as resp:
            return {w["url"]: w for w in (await resp.json())["workers"]}

    async def ctl(self, *args: str) -> int:
        """Run `pd-router ctl ARGS` (the console script beside this Python, else `python -m router ctl`)."""
        script = Path(sys.executable).with_name("pd-router")
        argv = [str(script), "ctl", *args] if script.exists() else [sys.executable, "-m", "router", "ctl", *args]
        self.say(f"$ pd-router ctl {' '.join(args)}")
        process = await asyncio.create_subprocess_exec(*argv, env={**os.environ, "PD_ROUTER_URL": self.router})
        code = await process.wait()
        if code != 0:
            self.failures.append(f"pd-router ctl {args[0]} exited with {code}")
        return code

    async def ticker(self) -> None:
        """A line a second about the load, while no operation prints its steps."""
        started = time.monotonic()
        while True:
            await asyncio.sleep(1.0)
            if self._ticking:
                ok, failed = self.load.counts()
                self.say(f"  [load {time.monotonic() - started:4.1f} s] {ok} requests ok, {failed} failed")

    async def under_load(self, what: str, *args: str) -> tuple[float, float]:
        await asyncio.sleep(self.phase_secs)
        self._ticking = False
        self.say(f"\n== under load: {what}")
        started = time.monotonic()
        await self.ctl(*args)
        ended = time.monotonic()
        self.say()
        self._ticking = True
        return started, ended

    async def run(self) -> int:
        self.say(f"pd-router at {self.router} (PD_ROUTER_URL for pd-router ctl)\n")
        self.say("== the fleet before")
        await self.ctl("workers")
        before = await self.workers()
        decodes = [url for url, w in before.items() if w["role"] == "decode"]
        if len(decodes) < 2:
            self.say(f"demo: FAILED: the fleet needs two decode servers, it has {len(decodes)}")
            return 1
        converted = decodes[-1]
        self.say(f"\n== load: {self.clients} clients sending /generate without pause (every other one streaming)")
        loops = [asyncio.ensure_future(self.load.client(n)) for n in range(self.clients)]
        ticker = asyncio.ensure_future(self.ticker())
        try:
            conversion = await self.under_load(f"convert decode server {converted} to prefill",
                                               "convert", converted, "--to", "prefill")
            update = await self.under_load(f"update every server's weights to {NEW_VERSION}", "update-weights",
                                           "--path", self.weights_path, "--version", NEW_VERSION)
            await asyncio.sleep(self.phase_secs)
        finally:
            self.load.stop.set()
            await asyncio.gather(*loops)
            ticker.cancel()
        self.say("\n== the fleet after")
        await self.ctl("workers")
        after = await self.workers()
        self.summary(before, after, converted, conversion, update)
        await self.last_request()
        if self.failures:
            self.say("\ndemo: FAILED: " + "; ".join(self.failures))
            return 1
        self.say("\ndemo: ok")
        return 0

    def summary(self, before: dict, after: dict, converted: str, conversion: tuple, update: tuple) -> None:
        load = self.load
        ok, failed = load.counts()
        self.say("\n== what happened")
        self.say(f"requests: {ok} ok, {failed} failed "
                 f"({sum(load.counts(*conversion))} ended during the conversion, "
                 f"{sum(load.counts(*update))} during the weight update)")
        for answer in [a for a in load.answers if not a.ok][:5]:
            self.say(f"  failed: {answer.error}")
        if failed:
            self.failures.append(f"{failed} requests failed")
        self.say("roles:")
        for url, worker in before.items():
            now = after.get(url, {}).get("role", "gone")
            self.say(f"  {url}  {worker['role']:>7} -> {now}{'   (converted under load)' if url == converted else ''}")
        if after.get(converted, {}).get("role") != "prefill":
            self.failures.append(f"{converted} is not prefill after its conversion")
        old = sorted({str(w.get("weight_version")) for w in before.values()})
        new = sorted({str(w.get("weight_version")) for w in after.values()})
        self.say(f"weight version: {', '.join(old)} -> {', '.join(new)}"
                 + (" on every server" if len(new) == 1 else " (the servers disagree)"))
        if new != [NEW_VERSION] or not all(w.get("routable") for w in after.values()):
            self.failures.append(f"after the update the servers serve {new} (routable: "
                                 f"{[w.get('routable') for w in after.values()]})")
        later = [a for a in load.answers if a.ok and a.started > update[1]]
        stale = [a for a in later if a.version != NEW_VERSION]
        versions: dict[str, int] = {}
        for answer in load.answers:
            if answer.ok:
                versions[str(answer.version)] = versions.get(str(answer.version), 0) + 1
        self.say("answers by weight version: " + ", ".join(f"{n} on {v}" for v, n in sorted(versions.items()))
                 + f"; after the update: {len(later) - len(stale)} of {len(later)} on {NEW_VERSION}")
        if not later:
            self.failures.append("no request was answered after the update")
        elif stale:
            self.failures.append(f"{len(stale)} of {len(later)} answers after the update not on {NEW_VERSION}")

    async def last_request(self) -> None:
        self.say("\n== one more request through the router")
        self.say('$ curl -s ROUTER/generate -d \'{"text": "The capital of France is", '
                 '"sampling_params": {"max_new_tokens": 8}}\'')
        body = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
        async with self.session.post(self.router + "/generate", json=body) as resp:
            raw = await resp.read()
            self.say(raw.decode(errors="replace"))
            if resp.status != 200:
                self.failures.append(f"the last request answered HTTP {resp.status}")
                return
        version = orjson.loads(raw)["meta_info"].get("weight_version")
        self.say(f"(answered by the fleet on weight version {version})")
        if version != NEW_VERSION:
            self.failures.append(f"the last request was answered on {version}")


async def main_async(args: argparse.Namespace) -> int:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        return await Demo(session, args.router.rstrip("/"), args.clients, args.phase_secs, args.weights_path).run()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--router", required=True, help="the router's URL")
    parser.add_argument("--clients", type=int, default=8, help="concurrent clients (default: 8)")
    parser.add_argument("--weights-path", default=SIM_WEIGHTS,
                        help=f"the weights the servers load (update_weights_from_disk; default: {SIM_WEIGHTS}, "
                             f"which the simulator takes)")
    parser.add_argument("--phase-secs", type=float, default=2.0,
                        help="load before the conversion, between the operations and after them (default: 2)")
    return asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
