"""Workers announced in etcd: one key per worker, written under a lease by the worker or its sidecar
(`python -m router.cluster.announce`), so a dead worker's key disappears when its lease ends.

    /pd-router/<cluster-name>/v1/discovery/<url, percent-encoded whole>  →  {"url", "worker_type", "bootstrap_port"}

The value is an entry of `--discovery-file` (the body of `POST /workers`; `role` for `worker_type`, absent
fields read from the server). The router reads the prefix before it serves (its workers are read with the
command line's), then watches it from the revision after: a key put is a worker registered (or re-registered
when its role or port changed), a key deleted (its lease revoked or expired, or deleted by hand) is a worker
removed, both through the worker API's own calls (`SourceReconciler`). A key whose value is not a valid
entry changes nothing (the worker of its last good value stays) and is shown in `GET /admin/discovery`
(`bad_keys`). While etcd cannot be reached the workers stay as they are; the watch resumes from where it was
(or the prefix is read again when that history was compacted).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable
from urllib.parse import quote, unquote

import orjson

from router.cluster.etcd import EtcdClient
from router.cluster.etcd_types import EtcdCompacted, EtcdError, KeyValue, WatchEvent
from router.control.worker_sources import Listing, ListingError, SourceReconciler, parse_listing
from router.core.worker_url import identity

logger = logging.getLogger(__name__)

LAYOUT_VERSION = "v1"
RELOAD_BACKOFF = (0.2, 5.0)  # between readings of the prefix while etcd does not answer


def discovery_prefix(cluster_name: str) -> str:
    return f"/pd-router/{cluster_name}/{LAYOUT_VERSION}/discovery/"


def discovery_key(cluster_name: str, url: str) -> str:
    return discovery_prefix(cluster_name) + quote(url.rstrip("/"), safe="")


def listing_of_key(key: str, value: bytes, prefix: str) -> Listing:
    """A key's entry; its URL is the key's (a value may leave `url` out, but not name another one)."""
    url = unquote(key[len(prefix):])
    try:
        entry = orjson.loads(value)
    except orjson.JSONDecodeError as exc:
        raise ListingError([f"not valid JSON: {exc}"]) from None
    if isinstance(entry, dict) and "url" not in entry:
        entry = {**entry, "url": url}
    listing = parse_listing(entry, "value")
    if listing.url != identity(url):  # one server, written two ways, is the same
        raise ListingError([f"the value's url {listing.url} is not the key's {identity(url)}"])
    return listing


class EtcdWorkerSource:
    kind = "etcd"

    def __init__(self, client: EtcdClient, cluster_name: str, reconciler: SourceReconciler, *,
                 retry_secs: float, startup_timeout: float = 5.0) -> None:
        self.client = client
        self.prefix = discovery_prefix(cluster_name)
        self.reconciler = reconciler
        self.retry_secs = retry_secs
        self.startup_timeout = startup_timeout
        self._good: dict[str, Listing] = {}  # key -> its last good entry
        self.bad_keys: dict[str, str] = {}  # key -> why its value is refused
        self._revision: int | None = None  # the revision the listing was read at; None: read it (again)
        self._watch = None
        self._tasks: list[asyncio.Task] = []

    # ---- reading -------------------------------------------------------------------------------------
    def _take(self, key: str, value: bytes | None) -> None:
        if value is None:
            self._good.pop(key, None)
            self.bad_keys.pop(key, None)
            return
        try:
            self._good[key] = listing_of_key(key, value, self.prefix)
            self.bad_keys.pop(key, None)
        except ListingError as exc:
            problem = "; ".join(exc.problems)
            if self.bad_keys.get(key) != problem:
                logger.warning("%s: key %s refused (%s); %s", self.reconciler.name, key, problem,
                               "its last good value stands" if key in self._good else "no worker for it")
            self.bad_keys[key] = problem

    def _listing(self) -> dict[str, Listing]:
        return {item.url: item for item in self._good.values()}

    async def _read(self, *, read: bool, timeout: float | None = None) -> None:
        """Read the whole prefix and apply it (raises EtcdError when etcd cannot be read)."""
        snapshot = await self.client.get_prefix(self.prefix, timeout=timeout)
        keys: list[KeyValue] = snapshot.kvs
        self._good.clear()
        self.bad_keys.clear()
        for kv in keys:
            self._take(kv.key, kv.value)
        self._revision = snapshot.revision
        await self.reconciler.apply(self._listing(), read=read)

    async def load(self) -> None:
        """The first reading, before the router serves: its workers are read with the command line's."""
        try:
            await self._read(read=False, timeout=max(0.5, min(self.client.timeout, self.startup_timeout)))
        except EtcdError as exc:
            self.reconciler.refuse(f"cannot read {self.prefix} from etcd ({exc}): read again when it answers")

    def start(self, spawn: Callable[[Awaitable], asyncio.Task]) -> None:
        self._tasks = [spawn(self._follow()), spawn(self._retry())]

    async def _follow(self) -> None:
        backoff = RELOAD_BACKOFF[0]
        while True:
            try:
                if self._revision is None:
                    await self._read(read=True)
                backoff = RELOAD_BACKOFF[0]
                self._watch = self.client.watch_prefix(self.prefix, start_revision=self._revision + 1)
                async for event in self._watch:
                    self._on_event(event)
                    await self.reconciler.apply(self._listing())
            except EtcdCompacted:
                logger.info("%s: the watch fell behind a compaction: reading the prefix again", self.reconciler.name)
                self._revision = None
            except EtcdError as exc:
                self.reconciler.refuse(f"cannot read {self.prefix} from etcd ({exc}): read again when it answers")
                # the retry cadence while etcd does not answer, not a wait for a condition
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, RELOAD_BACKOFF[1])
            except Exception:  # keep following: a bug here must not leave the fleet unwatched
                logger.exception("%s: following etcd failed; reading the prefix again", self.reconciler.name)
                self._revision = None
                await asyncio.sleep(RELOAD_BACKOFF[1])
            finally:
                if self._watch is not None:
                    await self._watch.close()
                    self._watch = None

    def _on_event(self, event: WatchEvent) -> None:
        self._take(event.key, event.value if event.type == "put" else None)
        self._revision = event.mod_revision

    async def _retry(self) -> None:
        while True:
            await asyncio.sleep(self.retry_secs)
            try:
                await self.reconciler.retry()
            except Exception:
                logger.exception("%s: applying the listing again failed", self.reconciler.name)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.client.close()

    def to_dict(self) -> dict:
        watch = self._watch
        return {"kind": self.kind, "prefix": self.prefix, "endpoints": self.client.endpoints,
                "watching": bool(watch is not None and watch.connected), "revision": self._revision,
                "bad_keys": dict(self.bad_keys), **self.reconciler.to_dict()}
