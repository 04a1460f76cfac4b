"""The system under load: a simulated fleet (one process per worker) and pd-router in front of it.

Everything runs as real processes on ephemeral ports, each in its own session with its output in a log
file under the run's directory; `Stack.stop()` ends them all (SIGTERM to each process group, then
SIGKILL), including workers restarted by a scenario.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import aiohttp

from harness import processes
from harness.processes import REPO as REPO_ROOT, Child, free_port, port_open

START_TIMEOUT_S = 60.0
# A short generation on a lightly loaded GPU server, roughly: 5 ms of prefill, then 10 ms per decode step.
DEFAULT_WORKER_ARGS = ("--prefill-overhead-s", "0.005", "--decode-step-s", "0.01")


Process = Child  # a started child (in its own session, so that stopping it reaches its children) and its log


def spawn(name: str, argv: list[str], workdir: Path, *, stdout_path: Path | None = None) -> Process:
    """Start argv from the repository root; stderr (and stdout unless given its own file) to NAME.log."""
    return processes.start(name, argv, workdir / f"{name}.log", append=True, stdout_path=stdout_path)


def stop_processes(procs: list[Process], grace: float = 10.0) -> None:
    """SIGTERM every process group at once, SIGKILL what is left after `grace` seconds."""
    processes.stop_all(procs, grace)


def stop_process(proc: Process, grace: float = 10.0) -> None:
    stop_processes([proc], grace)


async def wait_until(condition: Callable[[], Any], *, timeout: float, what: str, interval: float = 0.1,
                     process: Process | None = None) -> Any:
    """Await until condition() (sync or async) is truthy; TimeoutError naming `what` at the deadline, a
    RuntimeError (ChildExited) with its log's tail if `process` ends first."""
    return await processes.await_until(condition, timeout=timeout, what=what, child=process, interval=interval)


@dataclass
class SimWorker:
    """One worker of the fleet, as its JSON announcement describes it."""

    role: str
    url: str
    port: int
    bootstrap_port: int | None
    pid: int | None
    restarted: Process | None = None  # set when a scenario started it again

    @classmethod
    def from_doc(cls, doc: dict) -> "SimWorker":
        return cls(doc["role"], doc["url"], doc["port"], doc.get("bootstrap_port"), doc.get("pid"))


@dataclass
class Stack:
    """`prefill` + `decode` simulated workers (`python -m simulator.fleet --processes`) and pd-router."""

    workdir: Path
    prefill: int = 2
    decode: int = 2
    worker_args: tuple[str, ...] = DEFAULT_WORKER_ARGS
    router_args: tuple[str, ...] = ()
    python: str = sys.executable
    fleet: Process | None = None
    router: Process | None = None
    workers: list[SimWorker] = field(default_factory=list)
    router_url: str = ""
    session: aiohttp.ClientSession | None = None

    # ---- lifecycle
    async def start(self) -> "Stack":
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            await self._start_fleet()
            await self._start_router()
        except BaseException:
            await self.stop()
            raise
        return self

    async def _start_fleet(self) -> None:
        announce = self.workdir / "fleet.json"
        argv = [self.python, "-m", "simulator.fleet", "--prefill", str(self.prefill), "--decode", str(self.decode),
                "--processes", *self.worker_args]
        self.fleet = spawn("fleet", argv, self.workdir, stdout_path=announce)

        def announced() -> dict | None:
            with contextlib.suppress(OSError, ValueError):
                text = announce.read_text()
                if text.endswith("\n"):
                    return json.loads(text.splitlines()[0])
            return None

        doc = await wait_until(announced, timeout=START_TIMEOUT_S, what="the fleet's JSON line", process=self.fleet)
        self.workers = [SimWorker.from_doc(w) for w in doc["prefill"] + doc["decode"]]

    async def _start_router(self) -> None:
        port = free_port()
        argv = [self.python, "-m", "router", "--pd-disaggregation"]
        for w in self.workers:
            if w.role == "prefill":
                argv += ["--prefill", w.url, str(w.bootstrap_port) if w.bootstrap_port else "none"]
        for w in self.workers:
            if w.role == "decode":
                argv += ["--decode", w.url]
        argv += ["--host", "127.0.0.1", "--port", str(port), "--log-json", *self.router_args]
        self.router = spawn("router", argv, self.workdir)
        self.router_url = f"http://127.0.0.1:{port}"
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120))

        async def all_routable() -> bool:
            try:
                workers = await self.router_workers()
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
                return False
            return len(workers) == len(self.workers) and all(w["routable"] for w in workers)

        await wait_until(all_routable, timeout=START_TIMEOUT_S, what="every worker routable in pd-router",
                         interval=0.2, process=self.router)
        (self.workdir / "stack.json").write_text(json.dumps(self.describe(), indent=2))

    def describe(self) -> dict[str, Any]:
        return {"router": {"url": self.router_url, "pid": self.router and self.router.pid},
                "fleet_pid": self.fleet and self.fleet.pid,
                "workers": [{"role": w.role, "url": w.url, "pid": w.pid} for w in self.workers]}

    async def stop(self) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None
        procs = [p for p in (self.router, *(w.restarted for w in self.workers), self.fleet) if p is not None]
        await asyncio.get_running_loop().run_in_executor(None, stop_processes, procs)

    async def __aenter__(self) -> "Stack":
        return await self.start()

    async def __aexit__(self, *exc: Any) -> None:
        await self.stop()

    # ---- views
    def of_role(self, role: str) -> list[SimWorker]:
        return [w for w in self.workers if w.role == role]

    # ---- talking to the router and the workers
    async def request(self, method: str, url: str, body: Any = None, timeout: float = 120.0) -> tuple[int, Any]:
        assert self.session is not None
        kwargs: dict[str, Any] = {"timeout": aiohttp.ClientTimeout(total=timeout)}
        if body is not None:
            kwargs["json"] = body
        async with self.session.request(method, url, **kwargs) as resp:
            raw = await resp.read()
            try:
                return resp.status, json.loads(raw)
            except ValueError:
                return resp.status, raw.decode(errors="replace")

    async def router_call(self, method: str, path: str, body: Any = None, timeout: float = 120.0) -> tuple[int, Any]:
        return await self.request(method, self.router_url + path, body, timeout)

    async def router_workers(self) -> list[dict]:
        status, doc = await self.router_call("GET", "/workers", timeout=5)
        if status != 200:
            raise aiohttp.ClientError(f"GET /workers answered {status}: {doc}")
        return doc["workers"]

    async def router_worker(self, url: str) -> dict | None:
        return next((w for w in await self.router_workers() if w["url"] == url), None)

    async def sim_state(self, worker: SimWorker) -> dict:
        status, doc = await self.request("GET", worker.url + "/_sim/state", timeout=5)
        if status != 200:
            raise aiohttp.ClientError(f"{worker.url}/_sim/state answered {status}")
        return doc

    async def set_faults(self, worker: SimWorker, faults: dict) -> None:
        """Merge faults into a worker's (`POST /_sim/faults`: error_rate, hang, crash_after_tokens, ...)."""
        status, doc = await self.request("POST", worker.url + "/_sim/faults", faults, timeout=5)
        if status != 200:
            raise ValueError(f"{worker.url} refused faults {faults}: {doc}")

    # ---- crash and restart
    async def kill(self, worker: SimWorker) -> None:
        """SIGKILL the worker's process (a crash: no clean shutdown) and wait until its port is closed."""
        pid = worker.restarted.pid if worker.restarted is not None else worker.pid
        if pid is None:
            raise RuntimeError(f"{worker.url} has no process id to kill")
        os.kill(pid, signal.SIGKILL)
        await wait_until(lambda: not port_open(worker.port), timeout=10, what=f"{worker.url} gone after SIGKILL")

    async def restart(self, worker: SimWorker) -> None:
        """Start the worker again on the same HTTP and bootstrap ports, with the fleet's settings."""
        argv = [self.python, "-m", "simulator", "--role", worker.role, "--port", str(worker.port),
                "--bootstrap-port", str(worker.bootstrap_port) if worker.bootstrap_port else "none",
                "--enable-pd-role-switch", *self.worker_args]
        name = f"restarted-{worker.role}-{worker.port}"
        worker.restarted = proc = spawn(name, argv, self.workdir)

        async def healthy() -> bool:
            try:
                status, _ = await self.request("GET", worker.url + "/health", timeout=5)
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
                return False
            return status == 200

        await wait_until(healthy, timeout=START_TIMEOUT_S, what=f"{worker.url} healthy after restart",
                         interval=0.2, process=proc)
