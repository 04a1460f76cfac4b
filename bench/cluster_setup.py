"""Router replicas sharing a simulated fleet through a real etcd, for the cluster benchmarks.

Each replica is a `python -m router` process on a port of its own (so a benchmark can ask each one what it
sees), with `--etcd-endpoints` of a one-member etcd started for the run (router/cluster/etcd_process.py). The
fleet is the simulator's, in the benchmark's process (it only answers control calls and a few requests).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path
from urllib.parse import quote

import aiohttp
import orjson

from bench import procs
from harness import processes
from bench.contenders import REPO_ROOT

START_TIMEOUT_S = 60.0


class RouterReplica:
    """One router process; `start()` waits until it serves /health, `kill()` SIGKILLs it."""

    def __init__(self, name: str, flags: list[str], workdir: Path, checkout: Path = REPO_ROOT) -> None:
        self.name = name
        self.port = procs.free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = [sys.executable, "-m", "router", "--host", "127.0.0.1", "--port", str(self.port), *flags]
        self.log_path = workdir / f"{name}.log"
        self.checkout = checkout
        self.child: procs.Child | None = None

    @property
    def pid(self) -> int:
        return self.child.pid

    async def start(self, session: aiohttp.ClientSession) -> "RouterReplica":
        self.child = processes.start(self.name, self.argv, self.log_path, cwd=self.checkout, append=True,
                                     env={**os.environ, "PYTHONPATH": str(self.checkout)})

        async def serves() -> bool:
            try:
                async with session.get(self.url + "/health") as resp:
                    return resp.status == 200
            except aiohttp.ClientError:
                return False

        await self.child.await_until(serves, timeout=START_TIMEOUT_S, what=f"{self.name} serving")
        return self

    def kill(self) -> float:
        """SIGKILL; the monotonic time it was sent."""
        self.child.popen.send_signal(signal.SIGKILL)
        return time.monotonic()

    async def exited(self) -> int:
        await processes.await_until(lambda: not self.child.alive(), timeout=30, what=f"{self.name} to exit",
                                    interval=0.01)
        return self.child.returncode

    async def stop(self) -> None:
        if self.child is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.child.stop, 30)

    def log_tail(self, chars: int = 3000) -> str:
        return self.child.log_tail(chars) if self.child is not None else ""


async def worker_view(session: aiohttp.ClientSession, replica: RouterReplica, url: str) -> dict | None:
    """The worker as this replica has it (role, bootstrap port, state, routable), or None when it has none."""
    async with session.get(f"{replica.url}/workers/{quote(url, safe='')}") as resp:
        if resp.status == 404:
            return None
        raw = await resp.read()
        if resp.status != 200:
            raise RuntimeError(f"{replica.name}: GET /workers/{url}: {resp.status} {raw[:200]!r}")
        return orjson.loads(raw)


async def call(session: aiohttp.ClientSession, method: str, url: str, body: dict | None = None) -> tuple[int, dict]:
    async with session.request(method, url, json=body) as resp:
        raw = await resp.read()
        return resp.status, (orjson.loads(raw) if raw else {})


async def seen_by_all(session: aiohttp.ClientSession, replicas: list[RouterReplica], url: str, predicate,
                      *, poll_s: float, timeout: float) -> dict[str, float]:
    """Poll every replica's view of `url` until `predicate(view)` holds there; the monotonic time each first
    saw it, by replica name."""
    seen: dict[str, float] = {}

    async def one(replica: RouterReplica) -> None:
        deadline = time.monotonic() + timeout
        while True:
            view = await worker_view(session, replica, url)
            if predicate(view):
                seen[replica.name] = time.monotonic()
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{replica.name} did not see the change to {url} within {timeout} s: {view}")
            await asyncio.sleep(poll_s)  # the poll interval of a wait with a deadline

    await asyncio.gather(*(one(r) for r in replicas))
    return seen


def cluster_flags(etcd_url: str, name: str, ttl: int) -> list[str]:
    return ["--etcd-endpoints", etcd_url, "--cluster-name", name, "--etcd-lease-ttl-secs", str(ttl),
            "--log-level", "info", "--disable-health-check"]


def fleet_flags(prefill: list, decode: list) -> list[str]:
    """mini_lb's flags for these simulator handles."""
    flags: list[str] = []
    for handle in prefill:
        flags += ["--prefill", handle.url, str(handle.bootstrap_port)]
    for handle in decode:
        flags += ["--decode", handle.url]
    return flags


def report(summary: dict, out: Path | None) -> None:
    """The summary on stdout, and in `out` (JSON) when given."""
    text = orjson.dumps(summary, option=orjson.OPT_INDENT_2).decode()
    print(text)
    if out:
        out.write_text(text)
