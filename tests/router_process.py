"""pd-router as a real process (`python -m router`) in front of a simulated fleet: for tests of what only a
process has (signals, its exit status, its logs, its listening socket)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import aiohttp
import orjson

from simulator.fleet import Fleet

from .helpers import free_port, wait_for

REPO = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 60.0  # a deadline, not a measure: a loaded machine (2 shared cores) took over 30 s to import it


class RouterProcess:
    def __init__(self, fleet: Fleet, *flags: str, log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.argv = [sys.executable, "-m", "router", "--pd-disaggregation", "--host", "127.0.0.1",
                     "--port", str(self.port), "--log-level", "debug"]
        for handle in fleet.prefill:
            self.argv += ["--prefill", handle.url, str(handle.bootstrap_port)]
        for handle in fleet.decode:
            self.argv += ["--decode", handle.url]
        self.argv += list(flags)
        self.proc: asyncio.subprocess.Process | None = None
        self.session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> "RouterProcess":
        return await self.start()

    async def start(self, *, serving: bool = True) -> "RouterProcess":
        """Start the process (again, after `kill`: same flags, same port); wait until it serves (`/health`
        200), or with `serving=False` only until its port answers."""
        first = self.proc is None
        if not first and not self._log.closed:  # it exited on its own (SIGTERM): its log is still open
            self._log.close()
        self._log = open(self.log_path, "wb" if first else "ab")
        # faulthandler: a router that does not serve in time dumps its threads' stacks into its log (SIGABRT)
        env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONFAULTHANDLER": "1"}
        self.proc = await asyncio.create_subprocess_exec(*self.argv, cwd=REPO, env=env, stdout=self._log,
                                                         stderr=asyncio.subprocess.STDOUT)
        if self.session is None:
            self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60))

        async def ready() -> bool:
            if self.proc.returncode is not None:
                raise AssertionError(f"the router exited with {self.proc.returncode}:\n{self.log()}")
            try:
                async with self.session.get(self.url + "/health") as resp:
                    return resp.status == 200 or not serving
            except aiohttp.ClientError:
                return False

        started = time.monotonic()
        try:
            await wait_for(ready, timeout=START_TIMEOUT_S, interval=0.02 if not serving else 0.1,
                           message="the router to serve" if serving else "the router's port to answer")
        except AssertionError as exc:
            # why: starved of CPU (few CPU seconds used), or stuck (its stacks, dumped into its log)
            used = self.cpu_seconds()
            if self.proc.returncode is None:
                self.proc.send_signal(signal.SIGABRT)
                await asyncio.wait_for(self.proc.wait(), 5)
            await self.__aexit__(None, None, None)
            raise AssertionError(f"{exc} (started {time.monotonic() - started:.1f} s ago, {used} CPU s used); "
                                 f"its log:\n{self.log()[-6000:]}") from None
        except BaseException:  # `async with` runs no __aexit__ when entering fails: leave no process behind
            await self.__aexit__(None, None, None)
            raise
        return self

    def cpu_seconds(self) -> float | None:
        """The CPU time (user and system) the process has used so far."""
        try:
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            return None
        return round((int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), 2)

    async def kill(self) -> None:
        """SIGKILL: the router dies at once, as in a crash or an OOM kill."""
        self.proc.kill()
        await self.proc.wait()
        self._log.close()

    async def __aexit__(self, *exc) -> None:
        if self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()
        await self.session.close()
        self._log.close()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def send(self, sig: signal.Signals = signal.SIGTERM) -> float:
        """Signal the router; the monotonic time it was sent."""
        self.proc.send_signal(sig)
        return time.monotonic()

    async def exited(self, timeout: float) -> int:
        return await asyncio.wait_for(self.proc.wait(), timeout)

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
