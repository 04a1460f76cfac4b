"""Every key of the cluster's prefix as this replica last saw it, kept current by one watch.

`load()` reads the prefix at one revision R; `run()` watches from R+1 and, for each answer of etcd (a
transaction's keys arrive together), updates the keys and tells the listeners what changed, synchronously, in
one call: whatever they apply (the registry's pools, admission's holds) changes between two steps of the event
loop, so the request path never sees half a transaction. When the watch's resume point was compacted away, the
prefix is read again and the difference is told as changes. Nothing here writes to etcd.

While etcd is unreachable the keys stay as they were (the replica routes on its last state); the watch
resumes from the revision after the last one applied when an endpoint answers again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Callable

from router.cluster.etcd import EtcdClient
from router.cluster.etcd_types import EtcdCompacted, EtcdError, KeyValue, WatchEvent

logger = logging.getLogger(__name__)

RELOAD_BACKOFF_S = (0.1, 2.0)


@dataclass(frozen=True, slots=True)
class Change:
    key: str
    old: KeyValue | None  # None: the key is new
    new: KeyValue | None  # None: the key was deleted
    revision: int  # when etcd held this: the put's or the delete's revision (a reload's, for a key gone)


Listener = Callable[[list[Change]], None]


class Mirror:
    def __init__(self, client: EtcdClient, prefix: str) -> None:
        self.client = client
        self.prefix = prefix
        self.kvs: dict[str, KeyValue] = {}
        self.revision = 0  # the etcd revision everything here is current to
        self.loaded = False
        self.reloads = 0  # full reads after the first (compaction)
        self.last_event_at: float | None = None  # monotonic
        self.listeners: list[Listener] = []
        self._changed = asyncio.Event()
        self._watch = None

    # ---- reads -------------------------------------------------------------------------------------
    def get(self, key: str) -> KeyValue | None:
        return self.kvs.get(key)

    def under(self, prefix: str) -> list[KeyValue]:
        """The keys under prefix, in key order."""
        return [kv for key, kv in sorted(self.kvs.items()) if key.startswith(prefix)]

    @property
    def watching(self) -> bool:
        return self._watch is not None and self._watch.connected

    @property
    def watch_reconnects(self) -> int:
        return self._watch.reconnects if self._watch is not None else 0

    async def wait_for(self, condition: Callable[[], bool], timeout: float) -> bool:
        """Wait until condition() holds after some change (checked at once first); False at the deadline."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not condition():
            left = deadline - loop.time()
            if left <= 0:
                return False
            changed = self._changed
            try:
                async with asyncio.timeout(left):
                    await changed.wait()
            except TimeoutError:
                return condition()
        return True

    # ---- keeping current ---------------------------------------------------------------------------
    async def load(self) -> None:
        """Read the whole prefix at one revision; tell the differences with what was kept as changes."""
        snapshot = await self.client.get_prefix(self.prefix)
        fresh = {kv.key: kv for kv in snapshot.kvs}
        changes = [Change(key, self.kvs.get(key), kv, kv.mod_revision) for key, kv in fresh.items()
                   if self.kvs.get(key) != kv]
        changes += [Change(key, kv, None, snapshot.revision) for key, kv in self.kvs.items() if key not in fresh]
        if self.loaded:
            self.reloads += 1
        self.kvs = fresh
        self.revision = snapshot.revision
        self.loaded = True
        self._tell(changes)

    async def run(self) -> None:
        """Watch from the revision after the last one applied, for ever (cancel to stop); the keys are read
        first if they never were (etcd did not answer at start-up)."""
        if not self.loaded:
            await self._load_until_read()
        while True:
            watch = self.client.watch_prefix(self.prefix, start_revision=self.revision + 1)
            self._watch = watch
            try:
                async for event in watch:
                    self._apply([event, *watch.ready()])
            except EtcdCompacted as exc:
                logger.warning("cluster watch: %s; reading the cluster's keys again", exc)
            finally:
                await watch.close()
            await self._load_until_read()  # compacted (or the watch ended): read everything again

    async def _load_until_read(self) -> None:
        delay = RELOAD_BACKOFF_S[0]
        while True:
            try:
                await self.load()
                return
            except EtcdError as exc:
                logger.warning("cluster: reading the cluster's keys failed (%s); retrying", exc)
                # a retry cadence, not a wait for a condition: etcd is not answering
                await asyncio.sleep(delay)
                delay = min(delay * 2, RELOAD_BACKOFF_S[1])

    async def close(self) -> None:
        if self._watch is not None:
            await self._watch.close()

    def _apply(self, events: list[WatchEvent]) -> None:
        changes = []
        for event in events:
            old = self.kvs.get(event.key)
            if event.type == "delete":
                if old is None:
                    continue
                del self.kvs[event.key]
                changes.append(Change(event.key, old, None, event.mod_revision))
            else:
                new = KeyValue(event.key, event.value, event.create_revision, event.mod_revision, event.version,
                               event.lease)
                self.kvs[event.key] = new
                changes.append(Change(event.key, old, new, event.mod_revision))
            self.revision = max(self.revision, event.mod_revision)
        self.last_event_at = time.monotonic()
        self._tell(changes)

    def _tell(self, changes: list[Change]) -> None:
        if changes:
            for listener in self.listeners:
                try:
                    listener(changes)
                except Exception:  # one broken listener must not stop the others or the watch
                    logger.exception("cluster: a listener failed on %d change(s)", len(changes))
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()
