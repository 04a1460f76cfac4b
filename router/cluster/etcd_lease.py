"""Keep one etcd lease alive in the background, and say when it can no longer be trusted.

A lease is what makes a replica's keys (its membership, the operations it owns) disappear when it dies.
The keeper renews it every ttl/3 and keeps a local deadline: the send time of the last renewal that was
answered, plus the TTL. It calls the lease lost when etcd says it ended, or when that deadline passes with no
renewal answered (etcd unreachable): from then on another replica may own what this lease held, so the
owner must stop acting on it and, once etcd answers, start again with a new lease.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from router.cluster.etcd_types import EtcdError, EtcdLeaseNotFound, EtcdUnavailable

logger = logging.getLogger(__name__)


class LeaseCalls(Protocol):
    """What a keeper asks of its client (`EtcdClient`, which builds keepers: a protocol, not an import)."""

    async def revoke_lease(self, lease_id: int, *, timeout: float | None = None) -> None: ...
    async def keep_alive_once(self, lease_id: int, *, timeout: float | None = None) -> int: ...
    def forget(self, owned: object) -> None: ...


class LeaseKeeper:
    def __init__(self, client: LeaseCalls, lease_id: int, ttl: int, *, interval: float | None = None,
                 since: float | None = None):
        self.client = client
        self.id = lease_id
        self.ttl = ttl
        self.interval = interval if interval is not None else max(ttl / 3, 0.05)
        loop = asyncio.get_running_loop()
        self.deadline = (loop.time() if since is None else since) + ttl  # in loop.time()
        self.renewals = 0
        self.lost_reason: str | None = None
        self._lost = asyncio.Event()
        self._task: asyncio.Task | None = loop.create_task(self._keep(), name=f"etcd-lease-{lease_id:x}")

    @property
    def alive(self) -> bool:
        return not self._lost.is_set()

    def time_left(self) -> float:
        """Seconds until the local deadline (the lease is called lost then unless a renewal is answered)."""
        return self.deadline - asyncio.get_running_loop().time() if self.alive else 0.0

    async def wait_lost(self) -> str:
        """Wait until the lease is lost; why."""
        await self._lost.wait()
        return self.lost_reason or "lost"

    async def __aenter__(self) -> LeaseKeeper:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.revoke()

    async def revoke(self, *, timeout: float | None = None) -> None:
        """Stop renewing and end the lease now (its keys go); etcd being unreachable leaves it to expire."""
        await self._stop()
        if self.lost_reason not in ("expired", "revoked"):
            try:
                await self.client.revoke_lease(self.id, timeout=timeout)
            except EtcdLeaseNotFound:
                pass
            except EtcdError as exc:
                logger.warning("lease %x not revoked (%s): it will expire in at most %s s", self.id, exc, self.ttl)
        self.lost_reason = "revoked"
        self._lost.set()

    async def close(self) -> None:
        """Stop renewing without revoking: the lease expires after its TTL, as if this process had died."""
        await self._stop()
        self._lose("closed")

    async def _stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        self.client.forget(self)

    def _lose(self, reason: str) -> None:
        if not self._lost.is_set():
            self.lost_reason = reason
            self._lost.set()

    async def _keep(self) -> None:
        loop = asyncio.get_running_loop()
        retry = min(self.interval, 0.25)
        wait = self.interval
        while True:
            # the retry cadence, not a wait for a condition: the next renewal is due
            await asyncio.sleep(max(0.0, min(wait, self.deadline - loop.time())))
            left = self.deadline - loop.time()
            if left <= 0:
                self._lose("no renewal answered before the lease's deadline")
                logger.warning("lease %x lost: etcd did not answer a renewal within its %s s TTL", self.id, self.ttl)
                return
            sent_at = loop.time()
            try:
                ttl = await self.client.keep_alive_once(self.id, timeout=left)
            except EtcdLeaseNotFound:
                self._lose("expired")
                logger.warning("lease %x lost: etcd says it expired", self.id)
                return
            except EtcdUnavailable as exc:
                logger.debug("lease %x renewal failed (%s), retrying", self.id, exc)
                wait = retry
                continue
            except EtcdError as exc:
                logger.warning("lease %x renewal refused (%s), retrying", self.id, exc)
                wait = retry
                continue
            self.deadline = sent_at + ttl
            self.renewals += 1
            wait = self.interval
