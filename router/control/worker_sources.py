"""Workers listed outside the router (a watched file, etcd keys): each source's listing kept in the registry.

A source reads its listing (url → `Listing`) and hands every new version to its `SourceReconciler`, which
registers what was added, removes what is gone and re-registers an entry whose role or port changed, through
the same calls as the worker API (`POST /workers`: the live role is read, `--worker-allow` and the weight
version are checked; `DELETE /workers/{id}`: the worker stops being routed, requests already sent to it
finish). What the reconciler cannot apply now is kept as a problem and tried again every `retry_secs`.

Precedence: a worker belongs to whoever registered it first (the command line, the API, a source). A source
never takes over, changes or removes a worker it did not register; its entry waits (a problem) until the URL
is free. A worker of a source that an operator removes through the API stays out until its entry changes.
One the health checker removes (--remove-unhealthy-workers) waits instead: it is registered again, as a
registration on purpose, once its server answers (tried every `retry_secs`).
Router replicas (docs/CLUSTER.md): the first listing a source reads seeds the cluster as a command line does,
so an entry of it that the cluster removed stays out until its entry changes; an entry listed later (new, or
changed) is a registration on purpose, which brings a removed worker back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Mapping, Protocol

from aiohttp import web

from router.core.config import DISCOVER
from router.core.worker_entry import WorkerEntryError, parse_worker_entry
from router.core.errors import RouterError, WorkerRemoved
from router.core.registry import Registry, Role, Worker

logger = logging.getLogger(__name__)

class ListingError(ValueError):
    """A listing the source cannot use; every problem found."""

    def __init__(self, problems: list[str]):
        super().__init__("; ".join(problems))
        self.problems = problems


@dataclass(frozen=True, slots=True)
class Listing:
    """One worker as a source lists it."""

    url: str  # canonical, without credentials (core/worker_url.py): the entry's identity, and what is shown
    role: Role | None = None  # None: the server's live role
    bootstrap_port: int | None | str = DISCOVER  # absent: the server's own; None: decode's default (mini_lb)
    userinfo: str | None = field(default=None, repr=False)  # `user:pass` of the URL as listed: never shown
    # the peers' fields the worker keeps (labels, priority, cost, api_key: core/worker_entry.SETTINGS), as a
    # tuple of pairs so that a listing stays comparable; the key never shown
    settings: tuple = field(default=(), repr=False)

    @property
    def address(self) -> str:
        """The URL to register (its credentials with it)."""
        if self.userinfo is None:
            return self.url
        scheme, rest = self.url.split("://", 1)
        return f"{scheme}://{self.userinfo}@{rest}"

    def settings_dict(self) -> dict:
        return {k: dict(v) if k == "labels" else v for k, v in self.settings}

    def describe(self) -> str:
        role = f"role {self.role}" if self.role else "the server's role"
        port = self.bootstrap_port
        return f"{role}, " + ("the server's bootstrap port" if port is DISCOVER else f"bootstrap_port {port}")

    def to_dict(self) -> dict:
        port = None if self.bootstrap_port is DISCOVER else self.bootstrap_port
        return {"url": self.url, "role": self.role.value if self.role else None, "bootstrap_port": port,
                "bootstrap_port_from_server": self.bootstrap_port is DISCOVER}


def parse_listing(entry: object, where: str) -> Listing:
    """An entry: a URL, or an object with `url`, `worker_type` (or `role`) and `bootstrap_port`, the body of
    `POST /workers` (core/worker_entry.py: the same model and rules). Raises ListingError naming `where`."""
    if isinstance(entry, str):
        entry = {"url": entry}
    if not isinstance(entry, dict):
        raise ListingError([f"{where}: expected a URL or an object with url, worker_type, bootstrap_port; "
                            f"got {type(entry).__name__}"])
    try:
        parsed = parse_worker_entry(entry, where=where)
    except WorkerEntryError as exc:
        raise ListingError(exc.problems) from None
    address = parsed.parsed_url
    settings = tuple(sorted((k, tuple(sorted(v.items())) if isinstance(v, dict) else v)
                            for k, v in parsed.settings.items()))
    return Listing(address.url, parsed.given_role, parsed.bootstrap_port_of(null_means=None), address.userinfo,
                   settings)


def listing_of(entries: list, where: str) -> dict[str, Listing]:
    """A whole listing, all or nothing: one bad entry (or a URL listed twice) refuses it, every problem said."""
    listing: dict[str, Listing] = {}
    problems: list[str] = []
    for index, entry in enumerate(entries):
        try:
            item = parse_listing(entry, f"{where}[{index}]")
        except ListingError as exc:
            problems.extend(exc.problems)
            continue
        if item.url in listing:
            problems.append(f"{where}[{index}]: {item.url} is listed twice")
        listing[item.url] = item
    if problems:
        raise ListingError(problems)
    return listing


# register(listing, source, read, seed) -> the new worker (raises RouterError; WorkerRemoved for a seed the
# cluster removed); unregister(worker) (raises Conflict while an operation owns it).
Register = Callable[[Listing, str, bool, bool], Awaitable[Worker]]
Unregister = Callable[[Worker], Awaitable[None]]
# answers(listing) -> None when its server answers a health probe, else why not (a worker removed as unhealthy is
# registered again only then: registered at once, it would be back, pending, before its server is)
Answers = Callable[[Listing], Awaitable["str | None"]]


class SourceReconciler:
    def __init__(self, name: str, registry: Registry, register: Register, unregister: Unregister,
                 answers: Answers | None = None) -> None:
        self.name = name  # e.g. "file /etc/pd-router/workers.yaml": each worker's `source`
        self.registry = registry
        self._register = register
        self._unregister = unregister
        self._answers = answers
        self.listed: dict[str, Listing] = {}  # the source's last good listing
        self._owned: dict[str, tuple[Listing, Worker]] = {}  # what this source registered, as it was listed
        self._dismissed: dict[str, Listing] = {}  # removed by an operator: left out until the entry changes
        self._removed_elsewhere: set[str] = set()  # of those, removed from the replicas' cluster (not here)
        self._seeds: dict[str, Listing] | None = None  # entries of the first listing, as long as they stay so
        self.problems: dict[str, str] = {}  # url -> why its entry is not applied as listed (tried again)
        self.error: str | None = None  # why the source's last reading was refused (the listing stands)
        self.error_since: float | None = None
        self.applied_at: float | None = None
        self._removing: Worker | None = None
        self.removing_unhealthy: Worker | None = None  # the health checker removes it now (WorkerSources)
        self._recovering: set[str] = set()  # removed as unhealthy: registered again once its server answers
        self._lock = asyncio.Lock()
        registry.subscribe(self._on_registry_event)

    def _on_registry_event(self, event: str, worker: Worker | None, details: dict) -> None:
        if event != "removed" or worker is None or worker is self._removing:
            return
        owned = self._owned.get(worker.url)
        if worker is self.removing_unhealthy and owned is not None and owned[1] is worker:
            del self._owned[worker.url]
            self._recovering.add(worker.url)
            self.problems[worker.url] = "removed as unhealthy: registered again once its server answers"
            logger.warning("%s: %s was removed as unhealthy; registered again once its server answers", self.name,
                           worker.url)
            return
        if owned is not None and owned[1] is worker:
            del self._owned[worker.url]
            self._dismissed[worker.url] = owned[0]
            logger.info("%s: %s was removed through the API; left out until its entry changes", self.name,
                        worker.url)

    def owns(self, worker: Worker) -> bool:
        owned = self._owned.get(worker.url)
        return owned is not None and owned[1] is worker

    # ---- the source's reports ------------------------------------------------------------------------
    def refuse(self, message: str) -> None:
        """The source could not be read or parsed: keep the workers of its last good listing, say why."""
        if message != self.error:
            logger.error("%s: %s; keeping the %d workers it listed before", self.name, message, len(self.listed))
            self.error_since = time.time()
        self.error = message

    async def apply(self, listing: Mapping[str, Listing], *, read: bool = True) -> None:
        """Make the registry hold what `listing` lists (as far as this source may). `read=False` leaves new
        workers pending for `Discovery.start_up` (the first listing, before the router serves)."""
        async with self._lock:
            if self.error is not None:
                logger.info("%s: read again (%d entries)", self.name, len(listing))
            self.error = self.error_since = None
            self.listed = dict(listing)
            if self._seeds is None:
                self._seeds = dict(listing)
            else:  # an entry added or changed since is a registration on purpose
                self._seeds = {url: item for url, item in self._seeds.items() if listing.get(url) == item}
            await self._reconcile(read)

    async def retry(self) -> None:
        """Apply the last good listing again (entries that waited: a busy worker, a refused registration)."""
        if self.problems:
            async with self._lock:
                await self._reconcile(True)

    async def _reconcile(self, read: bool) -> None:
        for url, (old, worker) in list(self._owned.items()):
            new = self.listed.get(url)
            if new == old:
                self.problems.pop(url, None)  # listed as it was again (a removal that waited is off)
            else:
                why = "no longer listed" if new is None else f"its entry changed to {new.describe()}"
                await self._remove(url, worker, why)
        for url, dismissed in list(self._dismissed.items()):
            if self.listed.get(url) != dismissed:
                del self._dismissed[url]
                self._removed_elsewhere.discard(url)
        for url in [url for url in self.problems if url not in self.listed and url not in self._owned]:
            del self.problems[url]
        self._recovering &= set(self.listed)
        new = [item for url, item in self.listed.items() if url not in self._owned and url not in self._dismissed]
        await asyncio.gather(*(self._add(item, read) for item in new))
        self.applied_at = time.time()

    # ---- one entry -----------------------------------------------------------------------------------
    async def _remove(self, url: str, worker: Worker, why: str) -> None:
        if self.registry.find(worker.id) is worker:
            self._removing = worker
            try:
                await self._unregister(worker)
            except RouterError as exc:
                self._problem(url, f"not removed yet ({why}): {exc.message}")
                return
            finally:
                self._removing = None
            logger.info("%s: removed %s %s (%s)", self.name, worker.role, url, why)
        del self._owned[url]
        self.problems.pop(url, None)

    async def _add(self, item: Listing, read: bool) -> None:
        existing = self.registry.find(item.url)
        if existing is not None:
            self._problem(item.url, f"already registered ({existing.source or 'through the API'}): "
                                    f"left as it is while it stays registered")
            return
        if item.url in self._recovering and self._answers is not None:
            silent = await self._answers(item)
            if silent is not None:
                self.problems[item.url] = (f"removed as unhealthy: registered again once its server answers "
                                           f"(not yet: {silent[:200]})")
                return
        # a worker removed as unhealthy comes back on purpose (its removal is on the cluster's record too)
        seed = self._seeds is not None and self._seeds.get(item.url) == item and item.url not in self._recovering
        try:
            worker = await self._register(item, self.name, read, seed)
        except WorkerRemoved as exc:  # the cluster removed it: left out until its entry changes
            self._dismissed[item.url] = item
            self._removed_elsewhere.add(item.url)
            self.problems.pop(item.url, None)
            logger.warning("%s: %s", self.name, exc.message)
            return
        except RouterError as exc:
            self._problem(item.url, f"not registered: {exc.message}")
            return
        self.problems.pop(item.url, None)
        if item.url in self._recovering:
            self._recovering.discard(item.url)
            logger.info("%s: %s answers again: registered again", self.name, item.url)
        if self.registry.find(worker.id) is not worker:
            self._dismissed[item.url] = item  # removed by an operator while it was being read
            return
        self._owned[item.url] = (item, worker)
        logger.info("%s: registered %s as %s", self.name, item.url, worker.role)

    def _problem(self, url: str, message: str) -> None:
        if self.problems.get(url) != message:
            logger.warning("%s: %s %s", self.name, url, message)
        self.problems[url] = message

    # ---- state -----------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        entries = []
        for url, item in self.listed.items():
            owned = self._owned.get(url)
            if owned is not None and owned[0] == item:
                status = "registered"
            elif url in self._recovering:
                status = "removed as unhealthy"
            elif url in self._removed_elsewhere:
                status = "removed from the cluster"
            elif url in self._dismissed:
                status = "removed through the API"
            else:
                status = "waiting"
            entries.append({**item.to_dict(), "status": status, "problem": self.problems.get(url),
                            "worker_id": owned[1].id if owned is not None else None})
        for url, (item, worker) in self._owned.items():
            if url not in self.listed:  # no longer listed, its removal waits
                entries.append({**item.to_dict(), "status": "removing", "problem": self.problems.get(url),
                                "worker_id": worker.id})
        return {"source": self.name, "listed": len(self.listed), "registered": len(self._owned),
                "error": self.error, "error_since": self.error_since, "applied_at": self.applied_at,
                "workers": entries}


class WorkerSource(Protocol):
    """One listing of workers kept outside the router (`--discovery-file`, `--discovery-etcd-endpoints`,
    `--service-discovery`)."""

    reconciler: SourceReconciler

    async def load(self) -> None: ...
    def start(self, spawn: Callable[[Awaitable], asyncio.Task]) -> None: ...
    async def close(self) -> None: ...
    def to_dict(self) -> dict: ...


class WorkerSources:
    """The sources the command line names, as one: loaded before the servers are first read, watched after."""

    def __init__(self, sources: list[WorkerSource]) -> None:
        self.sources = sources

    async def load(self) -> None:
        """Every source's first listing, registered pending: read with the command line's workers."""
        await asyncio.gather(*(source.load() for source in self.sources))

    def start(self, spawn: Callable[[Awaitable], asyncio.Task]) -> None:
        for source in self.sources:
            source.start(spawn)

    async def close(self) -> None:
        await asyncio.gather(*(source.close() for source in self.sources))

    @contextlib.contextmanager
    def unhealthy_removal(self, worker: Worker):
        """Around the health checker's removal of `worker`: the source that registered it keeps its entry, to
        register it again once its server answers (yields whether one did)."""
        owners = [source.reconciler for source in self.sources if source.reconciler.owns(worker)]
        for reconciler in owners:
            reconciler.removing_unhealthy = worker
        try:
            yield bool(owners)
        finally:
            for reconciler in owners:
                reconciler.removing_unhealthy = None

    def to_dict(self) -> dict:
        return {"sources": [source.to_dict() for source in self.sources]}


WORKER_SOURCES = web.AppKey("worker_sources", WorkerSources)  # GET /admin/discovery
