"""Fleet-wide pause, abort, memory release and weight updates, each one synchronous call.

This module is what each operation does; `operations.py` runs them one at a time and keeps their records,
`membership.py` keeps the fleet on one weight version (who is left out, and their way back), and
`request_aborts.py` serves `/abort_request`.

A weight update, step by step (each step has a deadline and is recorded with its outcome):

    hold      new requests wait in the router's bounded queue (503 + Retry-After when it is full)
    quiesce   drain: wait until the router has nothing in flight and every server reports nothing running
              or waiting; abort (`abort_all_requests`): mark the router's requests as aborted, send
              `abort_all` to every server, and wait for the same (again and again: SGLang's abort is
              asynchronous) — skipped when the fleet is paused (servers then update without their lock)
    update    the update goes to every P and D server at once; tensor and distributed updates are wrapped
              in `begin/end_weight_update` on servers that have them (0.5.23), unless the client opened
              the session itself through the router
    verify    every server must have succeeded and report the same live weight version; a server that
              failed, or reports another version, leaves routing (state `failed`)
    release   the held requests go on, to servers that all serve the same weights

The fleet never serves a silent mix of versions: the fleet's version is the registry's, which routes no
server on another one; a server left out is held out in the registry and rejoins only when its live version
is the fleet's (after a later update reaches it, or when the reconciler sees it was fixed; new workers that
report another version are kept out the same way). When every server refused a disk update or a version
relabel and all still report the version they had, nothing changed: the fleet keeps serving.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from contextlib import asynccontextmanager
from typing import Awaitable, Callable

from aiohttp import web

from router.control.live_state import read_weight_version
from router.control.upstream import INFO_TIMEOUT, Upstream, fan_out
from router.core.config import RouterConfig
from router.core.coordination import Coordinator, LocalCoordinator, StopAction
from router.core.errors import Conflict, ServiceUnavailable
from router.core.registry import Registry, Worker, WorkerState
from router.core.traffic import AbortAction, RequestPathControl
from router.flows.fleet import (
    FleetVersion,
    WorkerResult,
    http_status,
    most_common,
    read_fleet_weight_version,
    summary,
    wait_quiet,
)
from router.core.routability import Hold, HoldKind
from router.flows.membership import FleetMembership
from router.flows.operations import Operation, OperationRunner
from router.flows.request_aborts import RequestAborts

logger = logging.getLogger(__name__)

DISK = "update_weights_from_disk"
DISTRIBUTED = "update_weights_from_distributed"
TENSOR = "update_weights_from_tensor"
VERSION = "update_weight_version"
UPDATE_KINDS = (DISK, DISTRIBUTED, TENSOR, VERSION)
SESSION_KINDS = frozenset({DISTRIBUTED, TENSOR})  # 0.5.23: only inside begin/end_weight_update
# A failed disk load is rolled back by SGLang and a version relabel is atomic: if every server refused
# and still reports its old version, nothing changed.
ATOMIC_KINDS = frozenset({DISK, VERSION})
ALL_MEMORY_TAGS = frozenset({"kv_cache", "weights", "cuda_graph"})  # SGLang's GPU_MEMORY_ALL_TYPES
PAUSE_HOLD = "pause_generation"
MEMORY_HOLD = "release_memory_occupation"
CACHE_NOT_FLUSHED = "cache was not flushed"
SESSION_ALREADY_OPEN = "already open"


class WeightFlow:
    def __init__(self, config: RouterConfig, registry: Registry, upstream: Upstream, traffic: RequestPathControl,
                 spawn: Callable[[Awaitable], asyncio.Task], coordinator: Coordinator | None = None, *,
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
        self.traffic = traffic  # the request path: admission's hold and the router's live requests
        # The other router replicas of the fleet (a lone router's does nothing): operations run once across
        # them, and every replica holds, marks and empties before a server changes.
        self.coordinator = coordinator or LocalCoordinator()
        self.spawn = spawn
        self.operations = OperationRunner(config.weight_update_timeout_secs, spawn, self.coordinator,
                                          refusing=refusing, observers=observers)
        self.membership = FleetMembership(registry, upstream, self.operations.lock, config.health.interval_secs,
                                          spawn, self.coordinator)
        self.aborts = RequestAborts(traffic, upstream, self.targets, config.abort_timeout_secs, self.coordinator)
        self.paused: str | None = None  # the pause mode while the router holds the fleet paused
        self.released_tags: set[str] = set()
        self.session_open = False  # a begin_weight_update session opened through the router
        self._no_session_api: set[str] = set()  # workers whose server has no begin/end_weight_update
        self.conversions_running = conversions_running
        registry.subscribe(self._on_registry_event)

    # ---- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        self.membership.start()

    async def close(self) -> None:
        await self.membership.close()

    def _on_registry_event(self, event: str, worker: Worker, details: dict) -> None:
        if event == "removed":
            self._no_session_api.discard(worker.id)

    # ---- state -------------------------------------------------------------------------------------
    @property
    def fleet_version(self) -> str | None:
        return self.membership.fleet_version

    @property
    def left_out(self) -> dict[str, Hold]:
        return self.membership.left_out

    @property
    def current(self) -> Operation | None:
        return self.operations.current

    @property
    def history(self) -> collections.deque[Operation]:
        return self.operations.history

    @property
    def observers(self) -> list[Callable[[Operation], None]]:
        return self.operations.observers

    def state(self) -> dict:
        last = self.history[-1] if self.history else None
        return {
            "fleet_weight_version": self.fleet_version,
            "paused": self.paused,
            "memory_released": sorted(self.released_tags),
            "session_open": self.session_open,
            "admission": self.traffic.admission_state(),
            "left_out": self.membership.rows(),
            "current": self.current.to_dict() if self.current else None,
            "last": last.to_dict() if last else None,
            "history": [op.to_dict() for op in reversed(self.history)],
        }

    def find(self, op_id: str) -> Operation | None:
        return self.operations.find(op_id)

    async def reconcile(self) -> dict:
        return await self.membership.reconcile()

    async def abort(self, *, rid: str | None, abort_all: bool) -> tuple[int, dict | None]:
        return await self.aborts.abort(rid=rid, abort_all=abort_all)

    def targets(self) -> list[Worker]:
        """Servers a fleet-wide call goes to: every known server but pending ones (not reachable yet) and
        failed ones that another flow left unsafe (ours come back through these calls)."""
        return [w for w in self.registry.workers()
                if w.state is not WorkerState.PENDING
                and (w.state is not WorkerState.FAILED or w.hold is not None)]

    @asynccontextmanager
    async def _holding(self, op: Operation, reason: str, *, keep: bool = False):
        """Hold new requests for the operation; record how long and how many waited."""
        held_before = self.traffic.held_total
        step = op.step("hold")
        self.traffic.hold(reason)
        step.end("ok", f"admission closed ({reason})")
        started = time.monotonic()
        try:
            await self._wait_for_conversions(op)
            yield
        finally:
            # An update this replica lost once it had sent the servers their update keeps the fleet's hold:
            # they may still be loading, and the replica taking it over releases the hold when they are done.
            if not keep and not (op.lost and op.reached("update")):
                self.traffic.release(reason)
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

    async def _sent(self, calls: Awaitable[list[WorkerResult]]) -> list[WorkerResult]:
        """Calls that change the servers (an update, a pause): once sent they run to their own deadlines, even
        if the operation is cut short (this replica lost it): the servers end them either way, and a replica
        taking the operation over reads where they ended."""
        return await asyncio.shield(self.spawn(calls))

    def _mark_aborted(self, workers: list[Worker], retry: bool) -> int:
        """Before the router aborts these servers: mark their requests so the request path re-sends them
        (retry) or answers with SGLang's abort answer, and bump the workers' abort epochs."""
        count = self.traffic.mark_on(workers, AbortAction.RETRY if retry else AbortAction.ANSWER)
        self.registry.mark_aborted(workers)
        return count

    async def _quiesce(self, op: Operation, workers: list[Worker], *, abort: bool, retry: bool) -> bool:
        """Step `quiesce`: True once the fleet is quiet (or the step does not apply)."""
        if not abort and self.paused is not None:
            op.step("quiesce").end("skipped", f"the fleet is paused ({self.paused}): servers update "
                                              "without waiting for their requests")
            return True
        timeout = self.config.abort_timeout_secs if abort else self.config.drain_timeout_secs
        step = op.step("quiesce", timeout)
        if abort:
            op.aborted_requests = self._mark_aborted(workers, retry)
        # every replica holds, marks its own requests the same way, and tells what it still has on the servers
        action = StopAction.ROUTING if not abort else StopAction.RETRY if retry else StopAction.ANSWER
        op.aborted_requests += (await self.coordinator.stop_routing(op.ticket, workers, action)).marked
        quiet = await wait_quiet(self.registry, self.upstream, workers, time.monotonic() + timeout, abort=abort,
                                 elsewhere=lambda w: self.coordinator.inflight_elsewhere(op.ticket, w))
        op.quiesce_s = time.monotonic() - op.started
        how = f"abort_all sent {quiet.aborts_sent} times; " if abort else ""
        if quiet.ok:
            silent = f"; no load reported by {', '.join(quiet.silent)}" if quiet.silent else ""
            step.end("ok", f"{how}quiet after {quiet.duration_s:.3f} s{silent}")
            return True
        step.end("timeout", f"{how}still busy after {timeout:g} s: {quiet.busy}")
        op.workers = quiet.busy
        return False

    def _quiesce_timeout_answer(self, op: Operation, what: str) -> tuple[int, dict]:
        message = (f"{what} not done: the fleet did not become quiet within the deadline "
                   f"(nothing was changed); busy: {op.workers}")
        return 504, {"success": False, "message": message, "num_paused_requests": 0, "workers": op.workers}

    # ---- weight updates ----------------------------------------------------------------------------
    async def update(self, kind: str, body: dict, *, abort: bool, retry: bool) -> tuple[int, dict]:
        target = body.get("new_version") if kind == VERSION else body.get("weight_version")
        options = {"abort_all_requests": abort, "retry_aborted": retry, "weight_version": target}
        return await self.operations.run(kind, options, lambda op: self._update(op, kind, body, target, abort, retry))

    async def _update(self, op: Operation, kind: str, body: dict, target: str | None, abort: bool,
                      retry: bool) -> tuple[int, dict]:
        deadline = op.started + self.config.weight_update_timeout_secs
        async with self._holding(op, f"{kind} {op.id}"):
            workers = self.targets()
            if not workers:
                raise ServiceUnavailable("there is no server to update")
            # What each server serves before (read while quiescing): tells a refused update, where nothing
            # changed, from a half-done one.
            snapshot, quiet = await asyncio.gather(
                asyncio.gather(*(read_weight_version(self.upstream, w.url) for w in workers)),
                self._quiesce(op, workers, abort=abort, retry=retry))
            if not quiet:
                return self._quiesce_timeout_answer(op, "update")
            before = dict(zip(workers, snapshot))

            await self.coordinator.progress(op.ticket, "update")  # a replica taking it over knows from here on
            step = op.step("update", self.config.weight_update_timeout_secs)
            results = await self._sent(fan_out(workers, lambda w: self._apply(kind, w, body, deadline)))
            step.end("ok" if all(o.success for o in results) else "failed", summary(results, kind))

            step = op.step("verify", INFO_TIMEOUT)
            versions = await asyncio.gather(*(read_weight_version(self.upstream, w.url) for w in workers))
            message = self._settle(kind, results, versions, before, target)
            step.end("ok" if all(o.success for o in results) else "failed", message)
            op.weight_version = self.fleet_version
            op.workers = [o.to_dict() for o in results]
            status = http_status(results)
            return status, {
                "success": status == 200,
                "message": message,
                "num_paused_requests": _paused_count(results),
                "num_aborted_requests": op.aborted_requests,
                "weight_version": self.fleet_version,
                "update_id": op.id,
                "workers": op.workers,
                "left_out": [w.url for w in workers if w.id in self.left_out],
            }

    async def _apply(self, kind: str, worker: Worker, body: dict, deadline: float) -> WorkerResult:
        """One server's update, wrapped in a begin/end_weight_update session where it needs one."""
        timeout = max(deadline - time.monotonic(), 1.0)
        wrap = kind in SESSION_KINDS and not self.session_open and worker.id not in self._no_session_api
        if wrap:
            begin = await self.upstream.post(worker.url, "/begin_weight_update", {}, timeout=timeout)
            if begin.status in (404, 405):  # a server from before sessions: nothing to wrap
                self._no_session_api.add(worker.id)
                wrap = False
            elif not begin.success() and SESSION_ALREADY_OPEN in begin.message():
                # A session left open (an earlier update that died half-way): close it, open ours.
                await self.upstream.post(worker.url, "/end_weight_update", {}, timeout=timeout)
                begin = await self.upstream.post(worker.url, "/begin_weight_update", {}, timeout=timeout)
            if wrap and not begin.success():
                result = WorkerResult.of(worker, begin)
                result.message = f"begin_weight_update failed: {result.message}"
                return result
        reply = await self.upstream.post(worker.url, "/" + kind, body, timeout=timeout)
        result = WorkerResult.of(worker, reply)
        if wrap:
            end = await self.upstream.post(worker.url, "/end_weight_update", {}, timeout=timeout)
            if result.success and not end.success():
                result = WorkerResult.of(worker, end)
                result.message = f"end_weight_update failed: {result.message}"
        if not result.success and reply.status == 400 and CACHE_NOT_FLUSHED in result.message:
            # 0.5.23 changed the weights but found requests still there when it flushed (a request got in
            # after the quiesce, or the server was paused in place). Flush once it is idle.
            flush = await self.upstream.post(worker.url, "/flush_cache?timeout=5", timeout=10)
            if flush.ok:
                result.success = True
                result.message += " The router flushed the cache once the server was idle."
        return result

    def _settle(self, kind: str, results: list[WorkerResult], versions: list[str | None],
                before: dict[Worker, str | None], target: str | None) -> str:
        """Decide who serves after an update; set states and the fleet's version; return the message."""
        for result, version in zip(results, versions):
            result.extra["weight_version"] = version
        if (kind in ATOMIC_KINDS and not any(o.success for o in results)
                and all(o.answered for o in results)
                and all(v is not None and v == before[o.worker] for o, v in zip(results, versions))
                and len(set(versions)) == 1):
            for result in results:
                result.extra["routable"] = result.worker.routable
            return (summary(results, kind) + f" Nothing changed: every server still serves version "
                    f"{versions[0]!r}, and stays in routing.")
        fleet = target if target is not None else most_common(v for o, v in zip(results, versions) if o.success)
        for result, version in zip(results, versions):
            if result.success and fleet is not None and version is not None and version != fleet:
                result.success = False
                result.message = (f"{result.message} But it reports weight_version {version!r}, not the "
                                   f"fleet's {fleet!r}.").strip()
        served = sum(o.success for o in results)
        # The fleet's version and every server's new one in one step: nobody judged half-way.
        self.registry.set_fleet_version(
            fleet if served and fleet is not None else self.fleet_version,
            f"{kind} {self.current.id if self.current else ''}".strip(),
            worker_versions={o.worker: v for o, v in zip(results, versions) if v is not None})
        for result, version in zip(results, versions):
            worker = result.worker
            if result.success:
                self.membership.rejoin(worker, f"weights: updated to {version!r}", kinds=(HoldKind.WEIGHTS,))
            else:
                self.membership.leave_out(worker, HoldKind.WEIGHTS, f"{kind} failed: {result.message}"[:500])
            result.extra["routable"] = worker.routable
        message = summary(results, kind)
        failed = len(results) - served
        if failed:
            message += (f" {failed} server(s) left out of routing until they serve version "
                        f"{self.fleet_version!r}.")
        return message

    # ---- pause / continue ----------------------------------------------------------------------------
    async def pause(self, body: dict, *, retry: bool) -> tuple[int, dict]:
        mode = body.get("mode", "abort")
        return await self.operations.run("pause_generation", {"mode": mode, "retry_aborted": retry},
                                         lambda op: self._pause(op, body, mode, retry))

    async def _pause(self, op: Operation, body: dict, mode: str, retry: bool) -> tuple[int, dict]:
        self.traffic.hold(PAUSE_HOLD)  # kept until continue_generation
        op.step("hold").end("ok", "admission closed until continue_generation")
        self.paused = mode
        self.traffic.hold_silence(PAUSE_HOLD)  # paused answers go silent: the legs' idle timeout waits
        workers = self.targets()
        if mode == "abort":
            op.aborted_requests = self._mark_aborted(workers, retry)
        action = StopAction.ROUTING if mode != "abort" else StopAction.RETRY if retry else StopAction.ANSWER
        stopped = await self.coordinator.stop_routing(op.ticket, workers, action)
        op.aborted_requests += stopped.marked
        step = op.step("pause", self.config.abort_timeout_secs)
        results = await self._sent(fan_out(workers, lambda w: self._call(w, "/pause_generation", body,
                                                                          self.config.abort_timeout_secs)))
        step.end("ok" if all(o.success for o in results) else "failed", summary(results, "pause_generation"))
        if mode == "abort":  # the servers answered once their requests were gone; so must the router's
            step = op.step("quiesce", self.config.abort_timeout_secs)
            quiet = await wait_quiet(self.registry, self.upstream, workers,
                                     time.monotonic() + self.config.abort_timeout_secs, abort=True,
                                     elsewhere=lambda w: self.coordinator.inflight_elsewhere(op.ticket, w))
            op.quiesce_s = time.monotonic() - op.started
            step.end("ok" if quiet.ok else "timeout", f"busy: {quiet.busy}" if quiet.busy else "")
            paused_requests = 0
        else:  # the router's requests now stalled in the servers (every replica's)
            paused_requests = self.traffic.count_on(workers) + stopped.inflight
        op.workers = [o.to_dict() for o in results]
        status = http_status(results)
        message = "Generation paused successfully." if status == 200 else summary(results, "pause_generation")
        return status, {"success": status == 200, "message": message, "status": "ok" if status == 200 else "error",
                        "num_paused_requests": paused_requests, "num_aborted_requests": op.aborted_requests,
                        "workers": op.workers}

    async def resume(self, body: dict) -> tuple[int, dict]:
        return await self.operations.run("continue_generation", {}, lambda op: self._resume(op, body))

    async def _restore(self, op: Operation, step_name: str, call: str, body: dict, timeout: float,
                       kind: HoldKind) -> list:
        """Fan out a call that gives a server back its ability to serve (continue, memory resume): those
        that took it rejoin routing (at the fleet's weight version), the others are left out as `kind`."""
        step = op.step(step_name, timeout)
        results = await self._sent(fan_out(self.targets(), lambda w: self._call(w, "/" + call, body, timeout)))
        step.end("ok" if all(o.success for o in results) else "failed", summary(results, call))
        for result in results:
            if result.success:
                await self.membership.rejoin_if_current(result.worker, f"{call} succeeded", kind)
            else:  # it cannot serve (still paused, memory not back, or unreachable)
                self.membership.leave_out(result.worker, kind, f"{call} failed: {result.message}")
        return results

    async def _resume(self, op: Operation, body: dict) -> tuple[int, dict]:
        results = await self._restore(op, "continue", "continue_generation", body, self.config.abort_timeout_secs,
                                       HoldKind.PAUSED)
        for result in results:
            result.extra["routable"] = result.worker.routable
        self.paused = None
        self.traffic.release_silence(PAUSE_HOLD)
        self.traffic.release(PAUSE_HOLD)
        op.step("release").end("ok", "admission open")
        op.workers = [o.to_dict() for o in results]
        status = http_status(results)
        message = "Generation continued successfully." if status == 200 else summary(results, "continue_generation")
        return status, {"success": status == 200, "message": message, "status": "ok" if status == 200 else "error",
                        "workers": op.workers}

    # ---- memory release / resume -------------------------------------------------------------------
    async def release_memory(self, body: dict, *, abort: bool, retry: bool) -> tuple[int, dict]:
        options = {"tags": body.get("tags"), "abort_all_requests": abort}
        return await self.operations.run("release_memory_occupation", options,
                                         lambda op: self._release_memory(op, body, abort, retry))

    async def _release_memory(self, op: Operation, body: dict, abort: bool, retry: bool) -> tuple[int, dict]:
        held_already = bool(self.released_tags)
        async with self._holding(op, MEMORY_HOLD, keep=True):
            workers = self.targets()
            if not await self._quiesce(op, workers, abort=abort, retry=retry):
                if not held_already:
                    self.traffic.release(MEMORY_HOLD)
                return self._quiesce_timeout_answer(op, "release_memory_occupation")
            step = op.step("release", self.config.weight_update_timeout_secs)
            timeout = self.config.weight_update_timeout_secs
            results = await self._sent(fan_out(workers, lambda w: self._call(w, "/release_memory_occupation", body,
                                                                              timeout)))
            step.end("ok" if all(o.success for o in results) else "failed",
                     summary(results, "release_memory_occupation"))
            if any(o.success for o in results):
                self.released_tags |= set(body.get("tags") or ALL_MEMORY_TAGS)
            elif not held_already:
                self.traffic.release(MEMORY_HOLD)  # nothing was released: serve on
        return self._aggregate(op, results, "release_memory_occupation",
                               memory_released=sorted(self.released_tags))

    async def resume_memory(self, body: dict) -> tuple[int, dict]:
        return await self.operations.run("resume_memory_occupation", {"tags": body.get("tags")},
                                         lambda op: self._resume_memory(op, body))

    async def _resume_memory(self, op: Operation, body: dict) -> tuple[int, dict]:
        results = await self._restore(op, "resume", "resume_memory_occupation", body,
                                       self.config.weight_update_timeout_secs, HoldKind.MEMORY)
        tags = body.get("tags")
        self.released_tags -= set(tags) if tags else set(self.released_tags)
        if not self.released_tags:
            self.traffic.release(MEMORY_HOLD)
            op.step("release").end("ok", "admission open")
        return self._aggregate(op, results, "resume_memory_occupation",
                               memory_released=sorted(self.released_tags))

    # ---- plain fan-outs ------------------------------------------------------------------------------
    async def broadcast(self, path: str, body: dict | None, *, timeout: float | None = None,
                        workers: list[Worker] | None = None,
                        per_worker: Callable[[Worker], dict] | None = None) -> tuple[int, dict]:
        """A control call that changes no routing (update groups, sessions): to every server, at once."""
        timeout = timeout or self.config.weight_update_timeout_secs
        workers = self.targets() if workers is None else workers
        results = await fan_out(workers, lambda w: self._call(
            w, path, per_worker(w) if per_worker else body, timeout))
        if path == "/begin_weight_update":
            self.session_open = any(o.success for o in results)
        elif path == "/end_weight_update":
            self.session_open = False
        return self._aggregate(None, results, path.strip("/"))

    async def _call(self, worker: Worker, path: str, body: dict | None, timeout: float) -> WorkerResult:
        return WorkerResult.of(worker, await self.upstream.post(worker.url, path, body or {}, timeout=timeout))

    def _aggregate(self, op: Operation | None, results: list[WorkerResult], what: str, **extra) -> tuple[int, dict]:
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
        """Cancel the running operation if it is a weight update that has not reached its `update` step (it
        only held and emptied the fleet: its hold is released and nothing changed on any server); return it.
        One past that point is left to finish within its own deadlines, never cut half-way."""
        op = self.current
        if op is None or op.kind not in UPDATE_KINDS or any(step.name == "update" for step in op.steps):
            return None
        return self.operations.roll_back()

    async def release_pause(self) -> tuple[int, dict] | None:
        """Shutdown: a pause the router put on the fleet is ended with continue_generation, so that no server
        stays paused with no router to continue it (None when the fleet is not paused). A replica of a
        cluster leaves the fleet's pause to the replicas that stay (continue it at any of them)."""
        if self.paused is None or self.coordinator.clustered:
            return None
        return await self.operations.run("continue_generation", {"reason": "shutdown"},
                                         lambda op: self._resume(op, {}), shutting_down=True)

    # ---- what the router replicas of a fleet share beside the registry and the holds ---------------------
    def shared_state(self) -> dict:
        return {"paused": self.paused, "memory_released": sorted(self.released_tags)}

    def adopt_shared_state(self, state: dict) -> None:
        paused, released = state.get("paused"), state.get("memory_released")
        self.paused = paused if isinstance(paused, str) else None
        self.released_tags = {str(t) for t in released} if isinstance(released, list) else set()

    async def fleet_version_now(self) -> FleetVersion:
        return await read_fleet_weight_version(self.registry, self.upstream, self.targets())


def _paused_count(results: list[WorkerResult]) -> int:
    total = 0
    for result in results:
        value = result.data.get("num_paused_requests") if isinstance(result.data, dict) else None
        if isinstance(value, list):
            total += sum(v for v in value if isinstance(v, int))
        elif isinstance(value, int) and not isinstance(value, bool):
            total += value
    return total


WEIGHTS = web.AppKey("weights", WeightFlow)
