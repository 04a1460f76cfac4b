"""The servers a fleet operation held out of routing, and their way back. The fleet serves one weight
version: which one, which servers are left out and why, and what brings each back (a later update that
reaches it, the call that left it out succeeding, or the reconciler finding it fixed). New servers that
report another version are kept out the same way.

Both live in the registry, the one source of truth for routability: the fleet's version
(`Registry.fleet_version`: the registry routes no server on another one) and the servers held out
(`Registry.hold_out`, kind `weights`, `paused`, `memory` or `cache`: what brings them back). This module decides
when to hold a server out and when to let it back; it keeps no list of its own.

A server that took an update but kept its old cache (0.5.23 refuses the flush while requests are on it, as
when it is paused in place) is held out as `cache` until the router's `/flush_cache` succeeds: the reconciler
tries it every FLUSH_CADENCE_S while such a server exists, and `continue_generation` waits for it where a pool
would otherwise be empty (`flush_until`). A server held out for its weights is flushed too before it rejoins
(it may have been fixed behind the router's back, its cache from other weights). Only a successful flush ends
a `cache` hold (or a memory hold replacing it: a memory release drops the cache)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

from router.control.live_state import read_weight_version
from router.control.upstream import INFO_TIMEOUT, Upstream
from router.core.coordination import SingletonTurn
from router.core.registry import Registry, Worker, WorkerState
from router.core.routability import Hold, HoldKind
from router.flows.fleet import read_fleet_weight_version

logger = logging.getLogger(__name__)

FLUSH_CADENCE_S = 1.0  # a polling cadence: a server says nothing when its last request ends and a flush could run
FLUSH_TIMEOUT_S = 5.0  # one /flush_cache call (0.5.23 answers at once when it is not idle)


class HeldOut:
    def __init__(self, registry: Registry, upstream: Upstream, lock: asyncio.Lock, interval_s: float,
                 spawn: Callable[[Awaitable], asyncio.Task], coordinator: SingletonTurn) -> None:
        self.registry = registry
        # Router replicas of one fleet: the reconciler runs on the one that leads, never under another
        # replica's fleet-wide operation (what it changes is shared with the others).
        self.coordinator = coordinator
        self.upstream = upstream
        self.lock = lock  # the operations' lock: the reconciler never runs under a fleet operation
        self.interval_s = interval_s  # how often the reconciler looks without being woken
        self.spawn = spawn
        self._wake = asyncio.Event()
        self._reconciler: asyncio.Task | None = None
        registry.subscribe(self._on_registry_event)

    def start(self) -> None:
        self._reconciler = self.spawn(self._reconcile_loop())

    async def close(self) -> None:
        if self._reconciler is not None:
            self._reconciler.cancel()
            await asyncio.gather(self._reconciler, return_exceptions=True)

    @property
    def fleet_version(self) -> str | None:
        """The registry's: read from the servers at start-up, set by every update that reached a server."""
        return self.registry.fleet_version

    @property
    def left_out(self) -> dict[str, Hold]:
        """Servers held out of routing, by worker id (a view of the registry's holds)."""
        return {w.id: w.hold for w in self.registry.held()}

    def rows(self) -> list[dict]:
        return [{"id": w.id, "url": w.url, "kind": w.hold.kind.value, "reason": w.hold.reason,
                 "since": w.hold.since} for w in self.registry.held()]

    # ---- leaving routing and coming back ------------------------------------------------------------
    def leave_out(self, worker: Worker, kind: HoldKind, reason: str) -> None:
        """Hold the server out of routing (state `failed`) until the call of `kind` brings it back."""
        if self.registry.find(worker.id) is not worker:
            return
        held = worker.hold
        if held is not None and held.kind is HoldKind.CACHE and kind is not HoldKind.MEMORY:
            return  # only a flush ends it; the server is judged again then (weights, readiness)
        if held is not None and held.kind is not kind and kind is HoldKind.WEIGHTS:
            kind = held.kind  # still paused / without its memory: only that call can bring it back
        self.registry.hold_out(worker, kind, reason)

    # ---- a cache the old weights left ---------------------------------------------------------------
    async def flush(self, worker: Worker) -> bool:
        """The server's cache flushed now (True), or refused: requests still on it, or no answer. A server
        without the route (a stand-in, an old version) has nothing the router could flush."""
        reply = await self.upstream.post(worker.url, "/flush_cache", timeout=FLUSH_TIMEOUT_S)
        return reply.ok or reply.status in (404, 405)

    async def flush_and_rejoin(self, worker: Worker) -> bool:
        """A server held out as `cache` or `weights`: flushed, then back in routing if it serves the fleet's
        version and is ready; judged again otherwise (its weights, or paused). False while the flush is refused."""
        if worker.hold is None or worker.hold.kind not in (HoldKind.CACHE, HoldKind.WEIGHTS):
            return worker.hold is None
        if not await self.flush(worker):
            return False
        fleet = self.fleet_version
        return await self._judge(worker, (HoldKind.CACHE, HoldKind.WEIGHTS),
                                 f"cache flushed; serves the fleet's version {fleet!r}", HoldKind.PAUSED)

    async def flush_until(self, workers: list[Worker], deadline: float) -> list[Worker]:
        """Flush each of `workers` held out as `cache` until it rejoins or `deadline` passes; the ones still
        out are returned (the reconciler keeps trying)."""
        waiting = [w for w in workers if w.hold is not None and w.hold.kind is HoldKind.CACHE]
        while waiting:
            done = await asyncio.gather(*(self.flush_and_rejoin(w) for w in waiting))
            waiting = [w for w, ok in zip(waiting, done) if not ok and w.hold is not None
                       and w.hold.kind is HoldKind.CACHE and self.registry.find(w.id) is w]
            if not waiting or time.monotonic() + FLUSH_CADENCE_S > deadline:
                break
            await asyncio.sleep(FLUSH_CADENCE_S)
        return waiting

    def rejoin(self, worker: Worker, reason: str, kinds: tuple[HoldKind, ...]) -> bool:
        """Back into routing, if it was held out by one of `kinds`."""
        return self.registry.find(worker.id) is worker and self.registry.end_hold(worker, kinds, reason)

    async def rejoin_if_current(self, worker: Worker, reason: str, kind: HoldKind) -> None:
        """A server held out by `kind` that is fixed now: back in routing if it serves the fleet's version
        (and, after a pause, says it is ready), else still out: for its weights, or as paused."""
        if worker.hold is None or worker.hold.kind is not kind:
            return
        await self._judge(worker, (kind,), reason, HoldKind.PAUSED if kind is HoldKind.PAUSED else None)

    async def _judge(self, worker: Worker, kinds: tuple[HoldKind, ...], reason: str,
                     not_ready: HoldKind | None) -> bool:
        """Back in routing if it serves the fleet's version (and, `not_ready` given, /ready answers 200); else
        held out again: for its weights, or as `not_ready`. True once it rejoined."""
        version, ready = await asyncio.gather(read_weight_version(self.upstream, worker.url),
                                              self.upstream.ready(worker.url, timeout=INFO_TIMEOUT))
        held = worker.hold
        if held is None or held.kind not in kinds or self.registry.find(worker.id) is not worker:
            return held is None
        fleet = self.fleet_version
        if version is not None and version != worker.weight_version:
            self.registry.update_info(worker, weight_version=version)
        if fleet is not None and version != fleet:
            self.registry.hold_out(worker, HoldKind.WEIGHTS, f"serves weight_version {version!r}, the fleet "
                                                             f"serves {fleet!r}")
            return False
        if not_ready is not None and ready is False:
            self.registry.hold_out(worker, not_ready, f"{reason}, but /ready answers 503")
            return False
        return self.rejoin(worker, reason, kinds=kinds)

    def _on_registry_event(self, event: str, worker: Worker | None, details: dict) -> None:
        if event in ("added", "hold_ended", "fleet_version") \
                or (event == "held" and details.get("kind") == HoldKind.CACHE.value) \
                or (event == "state" and details.get("new") == WorkerState.ACTIVE.value) \
                or (event == "info" and "weight_version" in details):
            self._wake.set()

    async def _reconcile_loop(self) -> None:
        while True:
            # while a server waits for its cache flush, look often: nothing tells when it becomes idle
            interval = FLUSH_CADENCE_S if self.registry.held(HoldKind.CACHE) else max(self.interval_s, 0.5)
            try:  # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancel racing a wake-up
                async with asyncio.timeout(interval):
                    await self._wake.wait()
            except TimeoutError:
                pass
            self._wake.clear()
            if self.lock.locked() or not self.coordinator.leading or self.coordinator.fleet_operation_elsewhere():
                continue
            try:
                async with self.lock:
                    await self._reconcile()
            except Exception:  # keep reconciling; the next round may succeed
                logger.exception("weight version reconciliation failed")

    async def reconcile(self) -> dict:
        """Check now (`POST /weight_updates/rejoin`), once no operation runs."""
        async with self.lock:
            return await self._reconcile()

    async def _reconcile(self) -> dict:
        """Bring back servers left out for their weights once they serve the fleet's version; keep out
        active servers (new ones, typically) that serve another one."""
        if self.fleet_version is None:
            adopted = await read_fleet_weight_version(self.registry, self.upstream,
                                                      [w for w in self.registry.workers() if w.routable])
            if adopted.consistent and adopted.version is not None and self.fleet_version is None:
                self.registry.set_fleet_version(adopted.version, "the routable servers agree on it")
            return {"fleet_weight_version": self.fleet_version, "rejoined": [], "left_out": []}
        fleet = self.fleet_version
        out = self.registry.held(HoldKind.WEIGHTS) + self.registry.held(HoldKind.CACHE)
        suspects = [w for w in self.registry.workers()
                    if w.state is WorkerState.ACTIVE and w.hold is None and w.weight_version != fleet]
        checked = out + suspects
        versions = await asyncio.gather(*(read_weight_version(self.upstream, w.url) for w in checked))
        # and a server held for its cache that now serves another version: it restarted (its cache is new), so
        # the flush succeeds and it is judged for its weights; its `cache` hold would be the wrong reason
        current = [w for w, version in zip(checked, versions) if w in out and (
            version == fleet or (version is not None and w.hold is not None and w.hold.kind is HoldKind.CACHE))]
        flushed = await asyncio.gather(*(self.flush_and_rejoin(w) for w in current))
        rejoined = [w.url for w, ok in zip(current, flushed) if ok]
        kept_out = []
        for worker, version in zip(checked, versions):
            if self.registry.find(worker.id) is not worker or self.fleet_version != fleet:
                continue
            if version is not None and version != worker.weight_version:
                self.registry.update_info(worker, weight_version=version)
            if worker in suspects and version is not None and version != fleet \
                    and worker.state is WorkerState.ACTIVE:
                self.leave_out(worker, HoldKind.WEIGHTS,
                               f"serves weight_version {version!r}, the fleet serves {fleet!r}")
                kept_out.append(worker.url)
        if rejoined or kept_out:
            logger.info("weight reconciliation: rejoined %s, left out %s", rejoined, kept_out)
        return {"fleet_weight_version": fleet, "rejoined": rejoined, "left_out": kept_out,
                "cache_not_flushed": [w.url for w in self.registry.held(HoldKind.CACHE)]}
