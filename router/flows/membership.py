"""The fleet serves one weight version: which one, the servers left out of routing and why, and their way
back (a later update that reaches them, the call that left them out succeeding, or the reconciler finding
them fixed). New servers that report another version are kept out the same way."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from router.control.upstream import Upstream
from router.core.registry import Registry, Worker, WorkerState
from router.flows.fleet import live_weight_version, read_fleet_weight_version

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class LeftOut:
    kind: str  # weights | paused | memory: which call can bring the server back
    reason: str
    since: float = field(default_factory=time.time)


class FleetMembership:
    def __init__(self, registry: Registry, upstream: Upstream, lock: asyncio.Lock, interval_s: float,
                 spawn: Callable[[Awaitable], asyncio.Task]) -> None:
        self.registry = registry
        self.upstream = upstream
        self.lock = lock  # the operations' lock: the reconciler never runs under a fleet operation
        self.interval_s = interval_s  # how often the reconciler looks without being woken
        self.spawn = spawn
        self.fleet_version: str | None = None  # set by the first update (or adopted from an agreeing fleet)
        self.left_out: dict[str, LeftOut] = {}  # by worker id
        self._wake = asyncio.Event()
        self._reconciler: asyncio.Task | None = None
        registry.subscribe(self._on_registry_event)

    def start(self) -> None:
        self._reconciler = self.spawn(self._reconcile_loop())

    async def close(self) -> None:
        if self._reconciler is not None:
            self._reconciler.cancel()
            await asyncio.gather(self._reconciler, return_exceptions=True)

    def rows(self) -> list[dict]:
        return [{"id": wid, "url": w.url if (w := self.registry.find(wid)) else None, "kind": lo.kind,
                 "reason": lo.reason, "since": lo.since} for wid, lo in self.left_out.items()]

    # ---- leaving routing and coming back ------------------------------------------------------------
    def leave_out(self, worker: Worker, kind: str, reason: str) -> None:
        """Take the server out of routing (state `failed`) until the call of `kind` brings it back."""
        if self.registry.find(worker.id) is not worker:
            return
        held = self.left_out.get(worker.id)
        if held is not None and held.kind != kind and kind == "weights":
            kind = held.kind  # still paused / without its memory: only that call can bring it back
        self.left_out[worker.id] = LeftOut(kind, reason)
        self.registry.set_state(worker, WorkerState.FAILED, f"left out by {kind}: {reason}")

    def rejoin(self, worker: Worker, reason: str, kinds: tuple[str, ...]) -> bool:
        """Back into routing, if it was left out by one of `kinds`."""
        left = self.left_out.get(worker.id)
        if left is None or left.kind not in kinds:
            return False
        del self.left_out[worker.id]
        if self.registry.find(worker.id) is worker and worker.state is WorkerState.FAILED:
            self.registry.set_state(worker, WorkerState.ACTIVE, reason)
        return True

    async def rejoin_if_current(self, worker: Worker, reason: str, kind: str) -> None:
        """A server left out by `kind` that is fixed now: back in routing if it serves the fleet's version,
        else still out, for its weights."""
        left = self.left_out.get(worker.id)
        if left is None or left.kind != kind:
            return
        version = await live_weight_version(self.upstream, worker)
        if self.fleet_version is not None and version != self.fleet_version:
            left.kind = "weights"
            left.reason = f"serves weight_version {version!r}, the fleet serves {self.fleet_version!r}"
            return
        self.rejoin(worker, reason, kinds=(kind,))

    def _on_registry_event(self, event: str, worker: Worker, details: dict) -> None:
        if event == "removed":
            self.left_out.pop(worker.id, None)
        elif event == "state" and details.get("old") == WorkerState.FAILED.value \
                and details.get("new") != WorkerState.FAILED.value and worker.id in self.left_out:
            self.left_out.pop(worker.id)  # an operator put it back (reinstate): no longer ours to hold out
            self._wake.set()
        elif event == "added" or (event == "state" and details.get("new") == WorkerState.ACTIVE.value) \
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
            if self.lock.locked():
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
            if adopted.consistent and adopted.version is not None:
                self.fleet_version = adopted.version
            return {"fleet_weight_version": self.fleet_version, "rejoined": [], "left_out": []}
        fleet = self.fleet_version
        out = [w for w in self.registry.workers()
               if (lo := self.left_out.get(w.id)) is not None and lo.kind == "weights"]
        suspects = [w for w in self.registry.workers()
                    if w.state is WorkerState.ACTIVE and w.id not in self.left_out and w.weight_version != fleet]
        checked = out + suspects
        versions = await asyncio.gather(*(live_weight_version(self.upstream, w) for w in checked))
        rejoined, kept_out = [], []
        for worker, version in zip(checked, versions):
            if self.registry.find(worker.id) is not worker or self.fleet_version != fleet:
                continue
            if version is not None and version != worker.weight_version:
                self.registry.update_info(worker, weight_version=version)
            if worker in out and version == fleet:
                self.rejoin(worker, f"weights: serves the fleet's version {fleet!r}", kinds=("weights",))
                rejoined.append(worker.url)
            elif worker in suspects and version is not None and version != fleet \
                    and worker.state is WorkerState.ACTIVE:
                self.leave_out(worker, "weights",
                               f"serves weight_version {version!r}, the fleet serves {fleet!r}")
                kept_out.append(worker.url)
        if rejoined or kept_out:
            logger.info("weight reconciliation: rejoined %s, left out %s", rejoined, kept_out)
        return {"fleet_weight_version": fleet, "rejoined": rejoined, "left_out": kept_out}
