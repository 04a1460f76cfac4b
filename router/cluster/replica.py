"""Who this replica is, and its membership: one key under `replicas/` on a lease it keeps alive.

A replica's id is unique per process (host, pid and a random part), so several processes on one host (one
port shared with SO_REUSEPORT) are several replicas, and a restarted one is a new replica: the old id's key
goes with its lease. Everything a replica owns in etcd (its membership, its acks, the locks of the operations
it runs, the leadership) is bound to its lease, so it all disappears at once when the replica dies, after at
most the lease's TTL, or at once when it leaves (its lease revoked at shutdown).

When the lease is lost (etcd said it expired, or no renewal was answered before its deadline: etcd was
unreachable for longer than the TTL), whatever it held may already belong to another replica. The replica
keeps routing, and joins again with a new lease as soon as etcd answers (revoking the old one, which etcd may
have kept: a restarted etcd renews every lease).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from router.cluster.etcd import EtcdClient
from router.cluster.etcd_lease import LeaseKeeper
from router.cluster.etcd_types import EtcdError
from router.cluster.etcd_keys import ClusterKeys, encode

logger = logging.getLogger(__name__)

REJOIN_BACKOFF_S = (0.2, 2.0)


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("pd-router")
    except Exception:  # not installed (a checkout on PYTHONPATH)
        return "unknown"


@dataclass(frozen=True, slots=True)
class ReplicaIdentity:
    id: str
    host: str
    pid: int
    port: int  # the port it serves clients on (shared by replicas of one host with SO_REUSEPORT)
    started_at: float = field(default_factory=time.time)
    version: str = field(default_factory=_version)

    @classmethod
    def of_this_process(cls, port: int, replica_id: str) -> "ReplicaIdentity":
        """`replica_id`: the one the server calls itself (GET /admin/replica, `server/replica_info.py`: the
        one place a replica's id is made)."""
        return cls(id=replica_id, host=socket.gethostname(), pid=os.getpid(), port=port)

    def record(self) -> dict:
        return {"id": self.id, "host": self.host, "pid": self.pid, "port": self.port,
                "started_at": self.started_at, "version": self.version}


class Membership:
    def __init__(self, client: EtcdClient, keys: ClusterKeys, identity: ReplicaIdentity, ttl: int) -> None:
        self.client = client
        self.keys = keys
        self.identity = identity
        self.ttl = ttl
        self.lease: LeaseKeeper | None = None
        self._lost = 0  # a lease given up (no renewal answered in time) that etcd may still hold
        self.joins = 0
        self.rejoined: list[Callable[[], Awaitable[None]]] = []  # told after each join but the first
        # told at once (synchronously) when a lease is lost: what it held may belong to another replica now
        self.on_lost: list[Callable[[LeaseKeeper], None]] = []
        self.joined_at: float | None = None  # monotonic, the last join

    @property
    def lease_id(self) -> int:
        """The live lease's id; 0 when there is none (not joined, or lost)."""
        lease = self.lease
        return lease.id if lease is not None and lease.alive else 0

    @property
    def alive(self) -> bool:
        return self.lease_id != 0

    def trusted(self) -> LeaseKeeper | None:
        """The live lease, if it can be trusted to outlast a short operation step: renewed recently enough
        that a quarter of its TTL is left (renewals come every third of it; one overdue that long means etcd
        is not answering, and the lease may be called lost any moment: nothing new is started on it). None
        otherwise."""
        lease = self.lease
        if lease is None or not lease.alive or lease.time_left() < self.ttl / 4:
            return None
        return lease

    async def join(self, *, timeout: float | None = None) -> None:
        """Take a lease and put this replica's key on it (raises EtcdError when etcd does not answer)."""
        lease = await self.client.lease(self.ttl, timeout=timeout)
        try:
            await self.client.put(self.keys.replica(self.identity.id), encode(self.identity.record()),
                                  lease=lease.id, timeout=timeout)
        except BaseException:
            await lease.close()
            raise
        self.lease = lease
        self.joins += 1
        self.joined_at = time.monotonic()
        logger.info("cluster %s: replica %s joined (lease %x, ttl %d s)", self.keys.name, self.identity.id,
                    lease.id, self.ttl)

    async def run(self) -> None:
        """Join again each time the lease is lost (cancel to stop)."""
        delay = REJOIN_BACKOFF_S[0]
        while True:
            if self.lease is not None:
                reason = await self.lease.wait_lost()
                if reason in ("revoked", "closed"):
                    return
                logger.warning("cluster %s: replica %s lost its lease (%s): what it held may belong to another "
                               "replica now; joining again", self.keys.name, self.identity.id, reason)
                self._lost = self.lease.id
                lost, self.lease = self.lease, None
                for listener in self.on_lost:
                    listener(lost)
            try:
                await self.join()
                delay = REJOIN_BACKOFF_S[0]
                if self._lost:  # etcd may have kept it (a restart renews every lease): its keys go now
                    lost, self._lost = self._lost, 0
                    try:
                        await self.client.revoke_lease(lost, timeout=2.0)
                    except EtcdError:
                        pass
                for listener in self.rejoined:
                    await listener()
            except EtcdError as exc:
                logger.debug("cluster: joining again failed (%s)", exc)
                # a retry cadence, not a wait for a condition: etcd is not answering
                await asyncio.sleep(delay)
                delay = min(delay * 2, REJOIN_BACKOFF_S[1])

    async def leave(self) -> None:
        """Revoke the lease: this replica's keys go now, not after the TTL (etcd down: they expire)."""
        if self.lease is not None:
            await self.lease.revoke(timeout=2.0)
