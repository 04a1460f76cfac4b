"""The servers a fleet operation held out of routing, and their way back. The fleet serves one weight
version: which one, which servers are left out and why, and what brings each back (a later update that
reaches it, the call that left it out succeeding, or the reconciler finding it fixed). New servers that
report another version are kept out the same way.

Both live in the registry, the one source of truth for routability: the fleet's version
(`Registry.fleet_version`: the registry routes no server on another one) and the servers held out
(`Registry.hold_out`, kind `weights`, `paused` or `memory`: what brings them back). This module decides when
to hold a server out and when to let it back; it keeps no list of its own."""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

from router.control.live_state import read_weight_version
from router.control.upstream import INFO_TIMEOUT, Upstream
from router.core.coordination import Coordinator
from router.core.registry import Registry, Worker, WorkerState
from router.core.routability import Hold, HoldKind
from router.flows.fleet import read_fleet_weight_version

logger = logging.getLogger(__name__)


class HeldOut:
    def __init__(self, registry: Registry, upstream: Upstream, lock: asyncio.Lock, interval_s: float,
                 spawn: Callable[[Awaitable], asyncio.Task], coordinator: Coordinator) -> None:
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
        if held is not None and held.kind is not kind and kind is HoldKind.WEIGHTS:
            kind = held.kind  # still paused / without its memory: only that call can bring it back
        self.registry.hold_out(worker, kind, reason)

    def rejoin(self, worker: Worker, reason: str, kinds: tuple[HoldKind, ...]) -> bool:
        """Back into routing, if it was held out by one of `kinds`."""
        return self.registry.find(worker.id) is worker and self.registry.end_hold(worker, kinds, reason)

    async def rejoin_if_current(self, worker: Worker, reason: str, kind: HoldKind) -> None:
        """A server held out by `kind` that is fixed now: back in routing if it serves the fleet's version
        (and, after a pause, says it is ready), else still out: for its weights, or as paused."""
        if worker.hold is None or worker.hold.kind is not kind:
            return
        version, ready = await asyncio.gather(read_weight_version(self.upstream, worker.url),
                                              self.upstream.ready(worker.url, timeout=INFO_TIMEOUT))
        if worker.hold is None or worker.hold.kind is not kind or self.registry.find(worker.id) is not worker:
            return
        if self.fleet_version is not None and version != self.fleet_version:
            self.registry.hold_out(worker, HoldKind.WEIGHTS,
                                   f"serves weight_version {version!r}, the fleet serves {self.fleet_version!r}")
            return
        if kind is HoldKind.PAUSED and ready is False:
            self.registry.hold_out(worker, kind, f"{reason}, but /ready still answers 503")
            return
        self.rejoin(worker, reason, kinds=(kind,))

    def _on_registry_event(self, event: str, worker: Worker | None, details: dict) -> None:
        if event in ("added", "hold_ended", "fleet_version") \
                or (event == "state" and details.get("new") == WorkerState.ACTIVE.value) \
                or (event == "info" and "weight_version" in details):
            self._wake.set()

    async def _reconcile_loop(self) -> None:
        interval = max(self.interval_s, 0.5)
        while True:
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
        out = self.registry.held(HoldKind.WEIGHTS)
        suspects = [w for w in self.registry.workers()
                    if w.state is WorkerState.ACTIVE and w.hold is None and w.weight_version != fleet]
        checked = out + suspects
        versions = await asyncio.gather(*(read_weight_version(self.upstream, w.url) for w in checked))
        rejoined, kept_out = [], []
        for worker, version in zip(checked, versions):
            if self.registry.find(worker.id) is not worker or self.fleet_version != fleet:
                continue
            if version is not None and version != worker.weight_version:
                self.registry.update_info(worker, weight_version=version)
            if worker in out and version == fleet:
                self.rejoin(worker, f"weights: serves the fleet's version {fleet!r}", kinds=(HoldKind.WEIGHTS,))
                rejoined.append(worker.url)
            elif worker in suspects and version is not None and version != fleet \
                    and worker.state is WorkerState.ACTIVE:
                self.leave_out(worker, HoldKind.WEIGHTS,
                               f"serves weight_version {version!r}, the fleet serves {fleet!r}")
                kept_out.append(worker.url)
        if rejoined or kept_out:
            logger.info("weight reconciliation: rejoined %s, left out %s", rejoined, kept_out)
        return {"fleet_weight_version": fleet, "rejoined": rejoined, "left_out": kept_out}
