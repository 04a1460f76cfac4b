"""Start a fleet of simulated workers: in this process (tests) or one process per worker.

Python (tests, benchmarks)::

    async with Fleet(prefill=2, decode=2) as fleet:          # ephemeral ports
        fleet.prefill[0].url, fleet.prefill[0].bootstrap_port, fleet.decode_urls
        await fleet.set_faults(fleet.decode[0], hang=True)
        state = await fleet.state(fleet.decode[0])

    async with Fleet(prefill=1, decode=1, processes=True) as fleet:
        fleet.kill(fleet.decode[0])                           # a real crash (SIGKILL)

Command line (prints the fleet as JSON, then serves until interrupted)::

    python -m simulator.fleet --prefill 2 --decode 2 [--base-port N] [--processes] [worker flags]
    python -m simulator.fleet --router-args < fleet.json   # mini_lb-style flags for that fleet
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field, fields
from typing import Any

import aiohttp
import orjson

from harness.processes import ports_below_ephemeral

from .config import WorkerConfig, add_worker_flags, config_from_args
from .faults import Faults
from .journal import Journal
from .worker import Worker

START_TIMEOUT_S = 30.0


class SimulatorStartError(RuntimeError):
    """A simulator process ended before it announced where it serves."""


@dataclass
class WorkerHandle:
    """One fleet member, in-process (``worker``) or a child process (``process``)."""

    role: str
    url: str
    port: int
    bootstrap_port: int | None
    worker: Worker | None = None
    process: subprocess.Popen | None = field(default=None, repr=False)
    config: WorkerConfig | None = field(default=None, repr=False)  # what it was started with

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    @property
    def host_port(self) -> str:
        return self.url.split("://", 1)[1]

    def as_dict(self) -> dict[str, Any]:
        return {"role": self.role, "url": self.url, "port": self.port, "bootstrap_port": self.bootstrap_port,
                "pid": self.pid}


class Fleet:
    """``prefill`` + ``decode`` simulated workers sharing one config (plus per-role overrides)."""

    def __init__(self, prefill: int = 1, decode: int = 1, *, base_port: int = 0, processes: bool = False,
                 config: WorkerConfig | None = None, prefill_overrides: dict | None = None,
                 decode_overrides: dict | None = None, faults: Faults | None = None, record_requests: bool = False,
                 **overrides: Any) -> None:
        if record_requests and processes:
            raise ValueError("record_requests keeps the record on the worker object: in-process fleets only")
        base = config or WorkerConfig(enable_pd_role_switch=True)
        self.config = base.with_(**overrides) if overrides else base
        self.n_prefill = prefill
        self.n_decode = decode
        self.base_port = base_port
        self.processes = processes
        self.prefill_overrides = prefill_overrides or {}
        self.decode_overrides = decode_overrides or {}
        self.faults = faults
        self.record_requests = record_requests  # each in-process worker keeps a Journal (simulator/journal.py)
        self.prefill: list[WorkerHandle] = []
        self.decode: list[WorkerHandle] = []
        self.started_in_s: float | None = None
        self._session: aiohttp.ClientSession | None = None

    # ------------------------------------------------------------ lifecycle

    def _plan(self) -> list[WorkerConfig]:
        """One config per worker: ports from ``base_port`` (HTTP first, then bootstrap); else, for processes, free
        ports below the ephemeral range (`ports_below_ephemeral`), or all 0 (the OS chooses)."""
        n = self.n_prefill + self.n_decode
        if self.base_port:
            ports = list(range(self.base_port, self.base_port + 2 * n))
        else:  # processes can be killed and restarted on their ports: those are kept out of the ephemeral range
            ports = (ports_below_ephemeral(2 * n, self.config.host) if self.processes else []) or [0] * (2 * n)
        plans = []
        for i in range(n):
            role = "prefill" if i < self.n_prefill else "decode"
            overrides = dict(self.prefill_overrides if role == "prefill" else self.decode_overrides)
            port, boot = ports[i], ports[n + i]
            decode_listens = self.config.enable_pd_role_switch and self.config.api in ("0.5.23", "patched")
            if role == "decode" and not decode_listens and "bootstrap_port" not in overrides:
                boot = None
            overrides.setdefault("bootstrap_port", boot)
            overrides.setdefault("role", role)
            overrides.setdefault("port", port)
            plans.append(self.config.with_(**overrides))
        return plans

    async def start(self) -> "Fleet":
        started = time.perf_counter()
        plans = self._plan()
        try:
            if self.processes:
                spawned = await asyncio.gather(*(self._spawn(cfg) for cfg in plans), return_exceptions=True)
                for handle in spawned:
                    if isinstance(handle, WorkerHandle):
                        (self.prefill if handle.role == "prefill" else self.decode).append(handle)
                for handle in spawned:
                    if isinstance(handle, BaseException):
                        raise handle
            else:
                for cfg in plans:
                    await self._start_local(cfg)
        except BaseException:
            await self.stop()
            raise
        self.started_in_s = time.perf_counter() - started
        return self

    async def _start_local(self, cfg: WorkerConfig) -> WorkerHandle:
        worker = Worker(cfg, faults=Faults(**self.faults.as_dict()) if self.faults else None,
                        journal=Journal() if self.record_requests else None)
        handle = WorkerHandle(cfg.role, "", 0, None, worker=worker)
        (self.prefill if cfg.role == "prefill" else self.decode).append(handle)  # so stop() finds it
        await worker.start()
        handle.url, handle.port, handle.bootstrap_port = worker.url, worker.port, worker.bootstrap_port  # type: ignore
        return handle

    async def _spawn(self, cfg: WorkerConfig) -> WorkerHandle:
        """Start `python -m simulator` for `cfg` and read the line it announces itself with (URL and ports)."""
        cmd = [sys.executable, "-m", "simulator", *config_to_argv(cfg), "--announce"]
        if self.faults is not None:
            cmd += ["--faults-json", json.dumps(self.faults.as_dict())]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [_repo_root(), env.get("PYTHONPATH")]))
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=None, env=env, cwd=_repo_root())
        try:
            line = await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(None, proc.stdout.readline),
                                          START_TIMEOUT_S)  # type: ignore[union-attr]
            ready = json.loads(line)
        except json.JSONDecodeError:
            proc.kill()
            code = proc.wait()
            proc.stdout.close()  # type: ignore[union-attr]
            # e.g. its port taken meanwhile (restart() reuses the killed worker's): its stderr, the test's, says
            raise SimulatorStartError(f"the simulated {cfg.role} on port {cfg.port or 'any'} ended (exit status "
                                      f"{code}) before announcing itself; it printed {line[:200]!r}; its error "
                                      f"is on stderr") from None
        except BaseException:
            proc.kill()
            proc.wait()
            proc.stdout.close()  # type: ignore[union-attr]
            raise
        return WorkerHandle(cfg.role, ready["url"], ready["port"], ready["bootstrap_port"], process=proc, config=cfg)

    async def stop(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
        for handle in self.prefill + self.decode:
            if handle.worker is not None:
                await handle.worker.stop()
            if handle.process is not None and handle.process.poll() is None:
                handle.process.terminate()
        for handle in self.prefill + self.decode:
            if handle.process is not None:
                try:
                    handle.process.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    handle.process.kill()
                    handle.process.wait()
                if handle.process.stdout is not None:
                    handle.process.stdout.close()

    async def __aenter__(self) -> "Fleet":
        return await self.start()

    async def __aexit__(self, *exc: Any) -> None:
        await self.stop()

    def kill(self, handle: WorkerHandle) -> None:
        """SIGKILL a worker process (only with ``processes=True``)."""
        if handle.process is None:
            raise RuntimeError("kill() needs a fleet started with processes=True")
        handle.process.kill()
        handle.process.wait()

    async def restart(self, handle: WorkerHandle) -> WorkerHandle:
        """Start a killed worker process again on its ports, as launched (a server restarted with its command
        line comes back in its launch role)."""
        if handle.config is None or handle.process is None or handle.process.poll() is None:
            raise RuntimeError("restart() needs a worker process of this fleet that has exited")
        if handle.process.stdout is not None:
            handle.process.stdout.close()
        again = await self._spawn(handle.config.with_(port=handle.port, bootstrap_port=handle.bootstrap_port))
        handle.process = again.process
        return handle

    # ------------------------------------------------------------ views and test helpers

    @property
    def workers(self) -> list[WorkerHandle]:
        return self.prefill + self.decode

    @property
    def prefill_urls(self) -> list[str]:
        return [h.url for h in self.prefill]

    @property
    def decode_urls(self) -> list[str]:
        return [h.url for h in self.decode]

    @property
    def bootstrap_ports(self) -> list[int | None]:
        return [h.bootstrap_port for h in self.prefill]

    def as_dict(self) -> dict[str, Any]:
        return {"prefill": [h.as_dict() for h in self.prefill], "decode": [h.as_dict() for h in self.decode],
                "started_in_s": self.started_in_s}

    def mini_lb_args(self) -> list[str]:
        """Arguments for ``launch_lb``-style routers: ``--prefill URL... --decode URL... --prefill-bootstrap-ports``."""
        return (["--prefill", *self.prefill_urls, "--decode", *self.decode_urls, "--prefill-bootstrap-ports",
                 *[str(p) for p in self.bootstrap_ports]])

    async def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        return self._session

    async def state(self, handle: WorkerHandle) -> dict[str, Any]:
        session = await self._client()
        async with session.get(handle.url + "/_sim/state") as resp:
            return await resp.json()

    async def set_faults(self, handle: WorkerHandle, **faults: Any) -> dict[str, Any]:
        session = await self._client()
        async with session.post(handle.url + "/_sim/faults", data=orjson.dumps(faults),
                                headers={"Content-Type": "application/json"}) as resp:
            body = await resp.json()
            if resp.status != 200:
                raise ValueError(body)
            return body

    async def wait_for(self, handle: WorkerHandle, predicate: Any, timeout: float = 10.0) -> dict[str, Any]:
        """Poll ``/_sim/state`` until ``predicate(state)``; the state, or TimeoutError."""
        deadline = time.monotonic() + timeout
        while True:
            state = await self.state(handle)
            if predicate(state):
                return state
            if time.monotonic() > deadline:
                raise TimeoutError(f"{handle.url}: condition not met within {timeout}s; last state {state}")
            await asyncio.sleep(0.01)


def _repo_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def config_to_argv(cfg: WorkerConfig) -> list[str]:
    """Command-line flags that rebuild ``cfg`` in a child process."""
    argv: list[str] = []
    defaults = WorkerConfig()
    for f in fields(WorkerConfig):
        value = getattr(cfg, f.name)
        if f.name == "timing":
            for tf in fields(value):
                v = getattr(value, tf.name)
                if v != getattr(defaults.timing, tf.name):
                    argv += ["--" + tf.name.replace("_", "-"), str(v)]
            continue
        if value == getattr(defaults, f.name) and f.name not in ("port", "bootstrap_port", "role"):
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + f.name.replace("_", "-"))
        elif value is None:
            argv += [flag, "none"]
        else:
            argv += [flag, str(value)]
    return argv


def router_args(doc: dict[str, Any]) -> list[str]:
    """``--pd-disaggregation --prefill URL PORT ... --decode URL ...`` for a fleet's JSON document."""
    args = ["--pd-disaggregation"]
    for p in doc["prefill"]:
        args += ["--prefill", p["url"]] + ([str(p["bootstrap_port"])] if p.get("bootstrap_port") else [])
    for d in doc["decode"]:
        args += ["--decode", d["url"]]
    return args


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m simulator.fleet", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--router-args", action="store_true",
                        help="read a fleet's JSON on stdin, print the router flags for it, and exit")
    parser.add_argument("--prefill", type=int, default=1)
    parser.add_argument("--decode", type=int, default=1)
    parser.add_argument("--base-port", type=int, default=0, help="first port (0: ephemeral ports)")
    parser.add_argument("--processes", action="store_true", help="one process per worker")
    add_worker_flags(parser, single=False)
    parser.set_defaults(enable_pd_role_switch=True)
    args = parser.parse_args(argv)
    if args.router_args:
        print(" ".join(router_args(json.loads(sys.stdin.read()))))
        return
    config = config_from_args(args)
    try:
        import uvloop  # noqa: PLC0415

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(_serve(args, config))


async def _serve(args: argparse.Namespace, config: WorkerConfig) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    async with Fleet(args.prefill, args.decode, base_port=args.base_port, processes=args.processes,
                     config=config) as fleet:
        print(json.dumps(fleet.as_dict()), flush=True)
        await stop.wait()


if __name__ == "__main__":
    main()
