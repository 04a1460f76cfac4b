"""`--replicas N`: N router processes on one host serving one port, with this process as their supervisor.

Why processes: a router is one event loop on one core; N replicas use N cores. Each child is a whole router
(`python -m router` with the supervisor's command line) that binds the port with SO_REUSEPORT: the kernel
spreads new connections over the children's accept queues, and a connection stays with the child that
accepted it. The children are replicas of one cluster, sharing the fleet through etcd (docs/CLUSTER.md): the
one `--etcd-endpoints` names, else a private one the supervisor starts first and stops last
(router/server/private_etcd.py).

The supervisor serves nothing itself. It
- reserves the port (`reserve_port`: a port already taken fails once, here, rather than in every child over
  and over, and no other program can take it while the children start or restart), then starts the
  children, each in its own process group: a terminal's Ctrl-C reaches the supervisor only, which forwards it;
- forwards SIGTERM/SIGINT to every child: the first starts each child's graceful shutdown
  (`--shutdown-grace-secs`), a second makes them hurry, a third ends them at once;
- restarts a child that ends on its own (a crash, an OOM kill) after a back-off that doubles from
  `RESTART_BACKOFF_S[0]` to `[1]`, back to the shortest once a child has run `STABLE_AFTER_S`; a child that
  refuses its command line (exit status 2) would refuse it again: the supervisor stops them all, exit 2;
- exits once every child has ended after a signal: 0 when each of them exited 0.

A child learns its place from `REPLICA_ENV` ("index/count/supervisor-pid"); it asks the kernel to send it
SIGTERM when the supervisor dies (so a SIGKILLed supervisor leaves no replica behind, and each one still
shuts down gracefully).
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import logging
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Sequence

if TYPE_CHECKING:
    from router.server.private_etcd import PrivateEtcd

logger = logging.getLogger("router.supervisor")

REPLICA_ENV = "PD_ROUTER_REPLICA"
RESTART_BACKOFF_S = (0.5, 30.0)
STABLE_AFTER_S = 60.0
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
USAGE_ERROR = 2  # a router's exit status when its command line is refused (argparse's too)

_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True, slots=True)
class ReplicaPlace:
    """What a supervised child knows of its place: replica `index` (0-based) of `count`."""

    index: int
    count: int
    supervisor_pid: int

    def env_value(self) -> str:
        return f"{self.index}/{self.count}/{self.supervisor_pid}"


def replica_place(env: Mapping[str, str] = os.environ) -> ReplicaPlace | None:
    """This process's place when a supervisor started it; None for a router started directly."""
    raw = env.get(REPLICA_ENV)
    if not raw:
        return None
    try:
        index, count, pid = (int(part) for part in raw.split("/"))
    except ValueError:
        raise ValueError(f"{REPLICA_ENV}={raw!r}: expected index/count/supervisor-pid") from None
    return ReplicaPlace(index, count, pid)


def die_with_supervisor(place: ReplicaPlace) -> bool:
    """In a child: SIGTERM when the supervisor ends (Linux). False when it has already ended (the child was
    started and orphaned before it could ask): the child should not serve."""
    if sys.platform == "linux":
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    return os.getppid() == place.supervisor_pid


def reserve_port(host: str, port: int) -> list[socket.socket]:
    """Bind (without listening) the port on every address of `host`, with SO_REUSEPORT only: the children
    bind beside these sockets, nothing else can meanwhile, and no connection is ever queued on them (only
    listening sockets receive connections). Raises OSError when something already listens on the port.

    Without SO_REUSEADDR a connection of an earlier server still in TIME_WAIT blocks the bind; then the port
    is reserved with SO_REUSEADDR as well, which still fails on a listener but lets another program bind
    beside it (so the children may then find it taken: they fail and are restarted, and the log says why)."""
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                                   flags=socket.AI_PASSIVE):
            try:
                sockets.append(_bound(family, kind, proto, address, reuse_addr=False))
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    raise
                sockets.append(_bound(family, kind, proto, address, reuse_addr=True))
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def _bound(family: int, kind: int, proto: int, address: tuple, *, reuse_addr: bool) -> socket.socket:
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if reuse_addr:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(address)
    except BaseException:
        sock.close()
        raise
    return sock


class Child:
    """One replica's slot: its current process, its restarts and its back-off."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.process: asyncio.subprocess.Process | None = None
        self.started = 0.0
        self.starts = 0
        self.backoff = RESTART_BACKOFF_S[0]
        self.exit_code: int | None = None  # the exit after a stop signal

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def next_backoff(self, ran_s: float) -> float:
        """The wait before the next start; a child that ran long enough was not crash-looping."""
        if ran_s >= STABLE_AFTER_S:
            self.backoff = RESTART_BACKOFF_S[0]
        wait = self.backoff
        self.backoff = min(self.backoff * 2, RESTART_BACKOFF_S[1])
        return wait


class Supervisor:
    def __init__(self, argv: Sequence[str], count: int, *, child_args: Sequence[str] = (),
                 etcd: PrivateEtcd | None = None, python: str = sys.executable) -> None:
        """`argv`: the command line the children run (`python -m router ARGV CHILD_ARGS`); `etcd`: a private
        etcd to start first (the children are given its URL), keep running, and stop after them."""
        self.argv = list(argv)
        self.child_args = list(child_args)
        self.count = count
        self.etcd = etcd
        self.python = python
        self.children = [Child(i) for i in range(count)]
        self.signals: list[signal.Signals] = []
        self.stopping = asyncio.Event()
        self.refused: int | None = None  # a child that exited USAGE_ERROR: its command line is refused

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for signum in STOP_SIGNALS:
            loop.add_signal_handler(signum, self._on_signal, signum)
        keeper = None
        try:
            if self.etcd is not None:
                self.child_args += ["--etcd-endpoints", await self.etcd.start()]
                keeper = asyncio.ensure_future(self.etcd.keep(self.stopping))
            if not self.stopping.is_set():
                for child in self.children:
                    await self._start(child)
                await asyncio.gather(*(self._keep(child) for child in self.children if child.process is not None))
            return self._outcome()
        finally:
            self.stopping.set()  # the children have all ended: the etcd keeper ends too
            if keeper is not None:
                await keeper
            if self.etcd is not None:
                await self.etcd.close()
            for signum in STOP_SIGNALS:
                loop.remove_signal_handler(signum)

    def _outcome(self) -> int:
        if self.refused is not None:
            logger.error("supervisor: every replica stopped: replica %d refused its command line (exit status 2; "
                         "its log says why), so none is started again", self.refused)
            return 2
        # a child that died of the very signal forwarded to it was still starting (its handlers not installed
        # yet): it had nothing in flight, so that is a clean stop too
        clean = {0, *(-signum for signum in self.signals)}
        failed = [f"replica {c.index} exited {c.exit_code}" for c in self.children
                  if c.exit_code is not None and c.exit_code not in clean]
        if failed:
            logger.warning("supervisor: every replica stopped (%s)", ", ".join(failed))
            return 1
        logger.info("supervisor: every replica stopped")
        return 0

    def _on_signal(self, signum: signal.Signals) -> None:
        logger.info("supervisor: %s (#%d): forwarding it to %d replica(s)", signal.Signals(signum).name,
                    len(self.signals) + 1, sum(c.process is not None and c.process.returncode is None
                                               for c in self.children))
        self._stop_all(signum)

    def _stop_all(self, signum: signal.Signals) -> None:
        self.signals.append(signal.Signals(signum))
        self.stopping.set()
        for child in self.children:
            self._send(child, signum)

    def _send(self, child: Child, signum: int) -> None:
        if child.process is not None and child.process.returncode is None:
            try:
                child.process.send_signal(signum)
            except ProcessLookupError:
                pass

    async def _start(self, child: Child) -> None:
        place = ReplicaPlace(child.index, self.count, os.getpid())
        env = {**os.environ, REPLICA_ENV: place.env_value()}
        child.process = await asyncio.create_subprocess_exec(
            self.python, "-m", "router", *self.argv, *self.child_args, env=env,
            stdin=asyncio.subprocess.DEVNULL, process_group=0)  # its own group: Ctrl-C is forwarded once, by us
        child.started = time.monotonic()
        child.starts += 1
        logger.info("supervisor: replica %d/%d started (pid %d%s)", child.index, self.count, child.pid,
                    f", start {child.starts}" if child.starts > 1 else "")
        for signum in self.signals:  # a signal that came while it was being started
            self._send(child, signum)

    async def _keep(self, child: Child) -> None:
        """Wait for the child to end; restart it unless we are stopping."""
        while True:
            code = await child.process.wait()
            if self.stopping.is_set():
                child.exit_code = code
                logger.info("supervisor: replica %d (pid %d) exited %d", child.index, child.pid, code)
                return
            ran_s = time.monotonic() - child.started
            if code == USAGE_ERROR:  # the same command line would be refused again: stop them all
                self.refused = child.index
                child.exit_code = code
                self._stop_all(signal.SIGTERM)
                return
            wait = child.next_backoff(ran_s)
            logger.error("supervisor: replica %d (pid %d) ended on its own after %.1f s (%s); restarting it in "
                         "%.1f s", child.index, child.pid, ran_s, _describe_exit(code), wait)
            try:
                await asyncio.wait_for(self.stopping.wait(), wait)
                return  # stopping meanwhile: it is not started again
            except TimeoutError:
                pass
            await self._start(child)


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"
