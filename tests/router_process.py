"""pd-router as a real process (`python -m router`) in front of a simulated fleet: for tests of what only a
process has (signals, its exit status, its logs, its listening socket)."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import orjson

from harness import processes
from harness.processes import REPO, ports_below_ephemeral
from simulator.fleet import Fleet

from .helpers import free_port
START_TIMEOUT_S = 60.0  # a deadline, not a measure: a loaded machine (2 shared cores) took over 30 s to import it


class RouterProcess:
    def __init__(self, fleet: Fleet, *flags: str, log_path: Path, nofile: tuple[int, int] | None = None) -> None:
        """`nofile`: the (soft, hard) open-files limit the process starts with (util-linux's prlimit)."""
        # restarted on the same port after a kill: kept out of the range client connections take theirs from
        self.port = (ports_below_ephemeral(1) or [free_port()])[0]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        limit = ["prlimit", f"--nofile={nofile[0]}:{nofile[1]}", "--"] if nofile is not None else []
        self.argv = [*limit, sys.executable, "-m", "router", "--pd-disaggregation", "--host", "127.0.0.1",
                     "--port", str(self.port), "--log-level", "debug"]
        for handle in fleet.prefill:
            self.argv += ["--prefill", handle.url, str(handle.bootstrap_port)]
        for handle in fleet.decode:
            self.argv += ["--decode", handle.url]
        self.argv += list(flags)
        self.proc: subprocess.Popen | None = None
        self.child: processes.Child | None = None
        self.session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> "RouterProcess":
        return await self.start()

    async def start(self, *, serving: bool = True) -> "RouterProcess":
        """Start the process (again, after `kill`: same flags, same port); wait until it serves (`/health`
        200), or with `serving=False` only until its port answers."""
        first = self.proc is None
        # its own process group; faulthandler: a router that does not serve in time dumps its threads' stacks
        # into its log (SIGABRT)
        self.child = processes.start("the router", self.argv, self.log_path, append=not first)
        self.proc = self.child.popen
        if self.session is None:
            self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60))

        async def ready() -> bool:
            try:
                async with self.session.get(self.url + "/health") as resp:
                    return resp.status == 200 or not serving
            except aiohttp.ClientError:
                return False

        started = time.monotonic()
        try:
            await self.child.await_until(ready, timeout=START_TIMEOUT_S, interval=0.02 if not serving else 0.1,
                                         what="the router to serve" if serving else "the router's port to answer")
        except processes.ChildExited:
            await self.__aexit__(None, None, None)
            raise AssertionError(f"the router exited with {self.proc.returncode}:\n{self.log()}") from None
        except TimeoutError as exc:
            # why: starved of CPU (few CPU seconds used), or stuck (its stacks, dumped into its log)
            used = self.cpu_seconds()
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGABRT)
                await self.exited(5)
            await self.__aexit__(None, None, None)
            raise AssertionError(f"{str(exc).split(';')[0]} (started {time.monotonic() - started:.1f} s ago, {used} "
                                 f"CPU s used); its log:\n{self.log()[-6000:]}") from None
        except BaseException:  # `async with` runs no __aexit__ when entering fails: leave no process behind
            await self.__aexit__(None, None, None)
            raise
        return self

    def cpu_seconds(self) -> float | None:
        """The CPU time (user and system) the process has used so far."""
        return self.child.cpu_seconds()

    async def kill(self) -> None:
        """SIGKILL: the router dies at once, as in a crash or an OOM kill."""
        self.proc.kill()
        await self.exited(15)

    async def __aexit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            await self.exited(15)
        await self.session.close()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def why_unreachable(self, exc: BaseException) -> str:
        """What a failed connection to the router means: it exited (how, and its log's end) or it runs and
        refused (its log's end either way: a crash prints its traceback there)."""
        code = self.proc.poll()
        state = "runs" if code is None else (f"was killed by signal {-code}" if code < 0 else f"exited with {code}")
        return f"{self.url} unreachable ({exc}); the router {state}; its log ends:\n{self.log()[-4000:]}"

    def send(self, sig: signal.Signals = signal.SIGTERM) -> float:
        """Signal the router; the monotonic time it was sent."""
        self.proc.send_signal(sig)
        return time.monotonic()

    async def exited(self, timeout: float) -> int:
        """Its exit status, once it exited (TimeoutError after `timeout` seconds)."""
        await processes.await_until(lambda: self.proc.poll() is not None, timeout=timeout,
                                    what="the router to exit", interval=0.01)
        return self.proc.returncode

    async def call(self, path: str, body: dict | None = None) -> tuple[int, object]:
        async with self.session.post(self.url + path, json=body or {}) as resp:
            raw = await resp.read()
            return resp.status, orjson.loads(raw) if raw else None


async def generate(session: aiohttp.ClientSession, url: str, rid: str, max_new_tokens: int, *,
                   stream: bool) -> dict:
    """One /generate; what the client saw: status, the finish reason (`length`, `abort`, ...) or an error,
    the number of tokens and, for a stream, whether it ended with [DONE]."""
    body = {"text": "the quick brown fox", "rid": rid, "stream": stream,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}}
    try:
        async with session.post(url + "/generate", json=body) as resp:
            raw = await resp.read()
            status = resp.status
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return {"rid": rid, "status": 0, "error": f"{type(exc).__name__}: {exc}"}
    seen: dict = {"rid": rid, "status": status}
    if status != 200:
        seen["error"] = raw[:300].decode(errors="replace")
        return seen
    if stream:
        events = [block[6:] for block in raw.split(b"\n\n") if block.startswith(b"data: ")]
        seen["done"] = bool(events) and events[-1] == b"[DONE]"
        chunks = [orjson.loads(e) for e in events if e != b"[DONE]"]
        errors = [c["error"] for c in chunks if "error" in c]
        if errors or not chunks:
            seen["error"] = errors or "no event"
            return seen
        last = chunks[-1]
    else:
        last = orjson.loads(raw)
    seen["finish"] = last["meta_info"]["finish_reason"]["type"]
    seen["tokens"] = last["meta_info"]["completion_tokens"]
    return seen


async def live_rids(fleet: Fleet) -> dict[str, list[str]]:
    """Every rid each simulated server still knows (running, waiting, parked), by server URL."""
    found = {}
    for handle in fleet.workers:
        state = await fleet.state(handle)
        found[handle.url] = (state["running_rids"] + state["waiting_rids"] + state["undispatched_rids"]
                             + [rid for rids in state["rids_by_phase"].values() for rid in rids])
    return found
