"""Eviction: giving up on a worker for the requests that can still go elsewhere.

The health monitor calls `evict` when its probes declare a worker down. It needs only the live attempts and
the abort sender, not the proxy: so it is built before the health monitor, and the proxy's leg verdicts can go
to health from construction on.
"""

from __future__ import annotations

import logging

from router.core.registry import Registry, Worker
from router.dataplane.leg_aborts import LegAborts
from router.dataplane.live import LiveRequests

logger = logging.getLogger(__name__)


class Eviction:
    __slots__ = ("_registry", "_live", "_aborts")

    def __init__(self, registry: Registry, live: LiveRequests, aborts: LegAborts) -> None:
        self._registry = registry
        self._live = live
        self._aborts = aborts

    def evict(self, worker: Worker, reason: str) -> int:
        """Stop waiting on `worker` for every request that has not sent a byte to its client: its leg is
        cancelled and aborted on the server, and the request is retried on another pair like any failure before
        the first byte. Requests already streaming are left alone. Returns how many requests were re-routed.
        Nothing happens while the worker is the last of its pool: with nowhere else to go, waiting on a slow
        server beats failing its requests."""
        if not self._registry.routable(worker.role):
            logger.warning("%s is down but the last of its pool: its requests keep waiting", worker.url)
            return 0
        count = 0
        for attempt in self._live.on((worker,)):
            if attempt.give_up_on(worker, reason):
                self._aborts.abort_on(worker, attempt.rids)
                count += 1
        if count:
            logger.warning("re-routing %d request(s) waiting on %s: %s", count, worker.url, reason)
        return count
