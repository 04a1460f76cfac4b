"""What every fleet-wide operation shares: one at a time (`OperationRunner`, with the records of
`GET /weight_updates`), the servers it held out (`HeldOut`), what the fleet is now (paused, memory released, an
update session open: shared with the other router replicas), the servers a fleet-wide call goes to, and the
steps the operations have in common:

    hold      new requests wait in the router's bounded queue (503 + Retry-After when it is full); role
              conversions running are waited for first (admission closed keeps new ones from starting)
    quiesce   drain: wait until the router has nothing in flight and every server reports nothing running
              or waiting; abort (`abort_all_requests`): mark the router's requests as aborted, send
              `abort_all` to every server, and wait for the same (again and again: SGLang's abort is
              asynchronous); every replica marks its own requests the same way (the coordinator)

Each operation is its own module: a weight update (`weight_updates.py`), pause/continue (`pauses.py`), memory
release/resume (`memory.py`), `/abort_request` (`request_aborts.py`).
"""

from __future__ import annotations

import asyncio
import collections
import time
from contextlib import asynccontextmanager
from typing import Awaitable, Callable

from aiohttp import web

from router.control.upstream import Upstream, fan_out
from router.core.config import RouterConfig
from router.core.coordination import FleetOperations, StopAction
from router.core.errors import Conflict
from router.core.registry import Registry, Worker, WorkerState
from router.core.routability import Hold, HoldKind
from router.core.traffic import RequestPathControl
from router.flows.fleet import FleetVersion, WorkerResult, http_status, read_fleet_weight_version, summary, wait_quiet
from router.flows.held_out import HeldOut
from router.flows.operations import Operation, OperationRunner


class FleetControl:
    def __init__(self, config: RouterConfig, registry: Registry, upstream: Upstream, traffic: RequestPathControl,
                 spawn: Callable[[Awaitable], asyncio.Task], coordinator: FleetOperations, *,
                 refusing: Callable[[], str | None] = lambda: None,
                 conversions_running: Callable[[], list] = lambda: [],
                 observers: list[Callable[[Operation], None]] | None = None) -> None:
        """`refusing`: why no new operation may start now (the router shuts down), or None.
        `conversions_running`: the role conversions running now; an operation waits for them after closing
        admission (which keeps new ones from starting), so no server switches role under a fleet-wide one.
        `observers`: told of every finished operation (metrics)."""
        self.config = config
        self.registry = registry
        self.upstream = upstream
        self.traffic = traffic  # the request path: admission's gate and the router's live requests
        # The other router replicas of the fleet (a lone router's does nothing): operations run once across
        # them, and every replica holds, marks and empties before a server changes.
        self.coordinator = coordinator
        self.spawn = spawn
        self.operations = OperationRunner(config.weight_update_timeout_secs, spawn, self.coordinator,
                                          refusing=refusing, observers=observers)
        self.held_out = HeldOut(registry, upstream, self.operations.lock, config.health.interval_secs, spawn,
                                self.coordinator)
        self.conversions_running = conversions_running
        # What the fleet is now, shared with the other replicas (`shared_state`):
        self.paused: str | None = None  # the pause mode while the router holds the fleet paused
        self.released_tags: set[str] = set()  # memory released (`release_memory_occupation`)
        self.session_open = False  # a begin_weight_update session opened through the router

    # ---- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        self.held_out.start()

    async def close(self) -> None:
        await self.held_out.close()

    # ---- state -------------------------------------------------------------------------------------
    @property
    def fleet_version(self) -> str | None:
        return self.held_out.fleet_version

    @property
    def left_out(self) -> dict[str, Hold]:
        return self.held_out.left_out

    @property
    def current(self) -> Operation | None:
        return self.operations.current

    @property
    def history(self) -> collections.deque[Operation]:
        return self.operations.history

    def state(self) -> dict:
        last = self.history[-1] if self.history else None
        return {
            "fleet_weight_version": self.fleet_version,
            "paused": self.paused,
            "memory_released": sorted(self.released_tags),
            "session_open": self.session_open,
            "admission": self.traffic.admission_state(),
            "left_out": self.held_out.rows(),
            "current": self.current.to_dict() if self.current else None,
            "last": last.to_dict() if last else None,
            "history": [op.to_dict() for op in reversed(self.history)],
        }

    def find(self, op_id: str) -> Operation | None:
        return self.operations.find(op_id)

    async def reconcile(self) -> dict:
        return await self.held_out.reconcile()

    async def fleet_version_now(self) -> FleetVersion:
        return await read_fleet_weight_version(self.registry, self.upstream, self.targets())

    def targets(self) -> list[Worker]:
        """Servers a fleet-wide call goes to: every known server but pending ones (not reachable yet) and
        failed ones that another flow left unsafe (ours come back through these calls)."""
        return [w for w in self.registry.workers()
                if w.state is not WorkerState.PENDING and not w.unsafe]

    # ---- the steps operations share ----------------------------------------------------------------------
    @asynccontextmanager
    async def gate_closed(self, op: Operation, reason: str, *, keep: bool = False):
        """Close admission's gate to new requests for the operation (its step `hold`); record how long and how
        many waited. `keep`: the gate stays closed after the operation (a memory release: the resume opens it)."""
        held_before = self.traffic.held_total
        step = op.step("hold")
        self.traffic.close_gate(reason)
        step.end("ok", f"admission closed ({reason})")
        started = time.monotonic()
        try:
            await self._wait_for_conversions(op)
            yield
        finally:
            # An operation this replica lost once it had changed the servers keeps the fleet's hold: they may
            # still be loading, and the replica taking it over releases the hold when they are done.
            if not keep and not (op.lost and op.changed_servers):
                self.traffic.open_gate(reason)
            op.hold_s = time.monotonic() - started
            op.held_requests = self.traffic.held_total - held_before

    async def _wait_for_conversions(self, op: Operation) -> None:
        timeout = max(op.started + self.config.weight_update_timeout_secs - time.monotonic(), 0.0)
        await self._wait_for_local_conversions(op, timeout)
        elsewhere = await self.coordinator.wait_worker_operations_elsewhere(0.0)
        if not elsewhere:
            return
        step = op.step("conversions elsewhere", timeout)
        if still := await self.coordinator.wait_worker_operations_elsewhere(timeout):
            step.end("timeout", f"still running: {', '.join(still)}")
            raise Conflict(f"a role conversion is still running on another router replica ({', '.join(still)}); "
                           f"nothing was changed")
        step.end("ok", f"waited for {', '.join(elsewhere)}")

    async def _wait_for_local_conversions(self, op: Operation, timeout: float) -> None:
        running = self.conversions_running()
        if not running:
            return
        step = op.step("conversions", timeout)
        names = ", ".join(c.worker_url for c in running)
        done, pending = await asyncio.wait([asyncio.ensure_future(c.wait()) for c in running], timeout=timeout)
        for task in pending:
            task.cancel()
        if pending:
            step.end("timeout", f"role conversion of {names} still running")
            raise Conflict(f"a role conversion is still running ({names}); nothing was changed")
        step.end("ok", f"waited for the role conversion of {names}")

    async def sent(self, calls: Awaitable[list[WorkerResult]]) -> list[WorkerResult]:
        """Calls that change the servers (an update, a pause): once sent they run to their own deadlines, even
        if the operation is cut short (this replica lost it): the servers end them either way, and a replica
        taking the operation over reads where they ended."""
        return await asyncio.shield(self.spawn(calls))

    async def quiesce(self, op: Operation, workers: list[Worker], *, abort: bool, retry: bool) -> bool:
        """Step `quiesce`: True once the fleet is quiet (or the step does not apply)."""
        if not abort and self.paused is not None:
            op.step("quiesce").end("skipped", f"the fleet is paused ({self.paused}): servers update "
                                              "without waiting for their requests")
            return True
        timeout = self.config.abort_timeout_secs if abort else self.config.drain_timeout_secs
        step = op.step("quiesce", timeout)
        # every replica, this one first, holds and marks its own requests (re-sent or answered with their abort,
        # before the servers abort them), and tells what it still has on the servers
        action = StopAction.ROUTING if not abort else StopAction.RETRY if retry else StopAction.ANSWER
        stopped = await op.owned.stop_routing(workers, action)
        quiet = await wait_quiet(self.registry, self.upstream, workers, time.monotonic() + timeout, abort=abort,
                                 elsewhere=op.owned.inflight_elsewhere)
        op.quiesce_s = time.monotonic() - op.started
        if abort:
            await stopped.wait_all_ended(op.started + timeout - time.monotonic())
            op.aborted_requests, op.finished_requests = stopped.ended()
        how = f"abort_all sent {quiet.aborts_sent} times; " if abort else ""
        if quiet.ok:
            silent = f"; no load reported by {', '.join(quiet.silent)}" if quiet.silent else ""
            step.end("ok", f"{how}quiet after {quiet.duration_s:.3f} s{silent}")
            return True
        step.end("timeout", f"{how}still busy after {timeout:g} s: {quiet.busy}")
        op.workers = quiet.busy
        return False

    @staticmethod
    def quiesce_timeout_answer(op: Operation, what: str) -> tuple[int, dict]:
        message = (f"{what} not done: the fleet did not become quiet within the deadline "
                   f"(nothing was changed); busy: {op.workers}")
        return 504, {"success": False, "message": message, "num_paused_requests": 0, "workers": op.workers}

    async def restore(self, op: Operation, step_name: str, call: str, body: dict, timeout: float,
                      kind: HoldKind) -> list[WorkerResult]:
        """Fan out a call that gives a server back its ability to serve (continue, memory resume): those
        that took it rejoin routing (at the fleet's weight version), the others are left out as `kind`."""
        step = op.step(step_name, timeout)
        results = await self.sent(fan_out(self.targets(), lambda w: self.call(w, "/" + call, body, timeout)))
        step.end("ok" if all(o.success for o in results) else "failed", summary(results, call))
        for result in results:
            if result.success:
                await self.held_out.rejoin_if_current(result.worker, f"{call} succeeded", kind)
            else:  # it cannot serve (still paused, memory not back, or unreachable)
                self.held_out.leave_out(result.worker, kind, f"{call} failed: {result.message}")
        return results

    async def call(self, worker: Worker, path: str, body: dict | None, timeout: float) -> WorkerResult:
        return WorkerResult.of(worker, await self.upstream.post(worker.url, path, body or {}, timeout=timeout))

    @staticmethod
    def aggregate(op: Operation | None, results: list[WorkerResult], what: str, **extra) -> tuple[int, dict]:
        workers = [o.to_dict() for o in results]
        if op is not None:
            op.workers = workers
        status = http_status(results) if results else 503
        message = summary(results, what) if results else "there is no server"
        return status, {"success": status == 200, "message": message, "num_paused_requests": 0,
                        "workers": workers, **extra}

    # ---- shutdown ------------------------------------------------------------------------------------
    async def wait_current(self) -> None:
        await self.operations.wait_current()

    def roll_back_current(self) -> Operation | None:
        """Cancel the running operation if it has not changed any server yet (a weight update before its
        `update` step: it only held and emptied the fleet; its hold is released and nothing changed on any
        server); return it. One past that point is left to finish within its own deadlines, never cut
        half-way."""
        op = self.current
        if op is None or op.changes_at is None or op.changed_servers:
            return None
        return self.operations.roll_back()

    # ---- what the router replicas of a fleet share beside the registry and the holds ---------------------
    def shared_state(self) -> dict:
        return {"paused": self.paused, "memory_released": sorted(self.released_tags)}

    def adopt_shared_state(self, state: dict) -> None:
        paused, released = state.get("paused"), state.get("memory_released")
        self.paused = paused if isinstance(paused, str) else None
        self.released_tags = {str(t) for t in released} if isinstance(released, list) else set()


# the fleet-wide operations' shared state (GET /weight_updates)
FLEET_CONTROL = web.AppKey("fleet_control", FleetControl)
