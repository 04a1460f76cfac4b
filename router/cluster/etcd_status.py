"""Whether etcd answers, as this replica sees it: a status call every interval (its revision, version and
leader), and each endpoint's health on demand for the cluster view."""

from __future__ import annotations

import asyncio
import logging
import time

from router.cluster.etcd import EtcdClient
from router.cluster.etcd_types import EtcdError

logger = logging.getLogger(__name__)


class EtcdStatus:
    def __init__(self, client: EtcdClient, interval_s: float) -> None:
        self.client = client
        self.interval_s = interval_s
        self.reachable: bool | None = None  # None: not asked yet
        self.last_error = ""
        self.revision = 0  # etcd's revision at the last answer
        self.version: str | None = None
        self.checked_at: float | None = None  # monotonic
        self.unreachable_since: float | None = None  # monotonic

    def saw(self, ok: bool, error: str = "") -> None:
        """What a call just found (any call: status, a write, a lock): keeps `reachable` current between polls."""
        if ok:
            if self.reachable is False:
                logger.info("cluster: etcd answers again")
            self.reachable, self.unreachable_since = True, None
        else:
            if self.reachable is not False:
                logger.warning("cluster: etcd does not answer (%s): routing on the last state; control calls "
                               "answer 503 until it does", error)
                self.unreachable_since = time.monotonic()
            self.reachable, self.last_error = False, error

    async def check(self) -> bool:
        try:
            status = await self.client.status(timeout=max(self.interval_s, 1.0))
        except EtcdError as exc:
            self.saw(False, str(exc))
        else:
            self.revision = status["revision"]
            self.version = status.get("version")
            self.saw(True)
        self.checked_at = time.monotonic()
        return bool(self.reachable)

    async def run(self) -> None:
        while True:
            await self.check()
            # a polling cadence, not a wait for a condition
            await asyncio.sleep(self.interval_s)

    async def endpoints(self, timeout: float = 1.0) -> list[dict]:
        healthy = await asyncio.gather(*(self.client.healthy(e, timeout=timeout) for e in self.client.endpoints))
        return [{"url": endpoint, "healthy": ok} for endpoint, ok in zip(self.client.endpoints, healthy)]

    def to_dict(self) -> dict:
        now = time.monotonic()
        return {"reachable": self.reachable, "last_error": self.last_error or None, "revision": self.revision,
                "version": self.version,
                "checked_age_s": None if self.checked_at is None else round(now - self.checked_at, 3),
                "unreachable_for_s": None if self.unreachable_since is None
                else round(now - self.unreachable_since, 3)}
