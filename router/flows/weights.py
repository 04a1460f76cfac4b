"""Fleet-wide pause, abort, memory release and weight updates, each one synchronous call.

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

The fleet never serves a silent mix of versions: a server left out rejoins only when its live version is
the fleet's (after a later update reaches it, or when the reconciler sees it was fixed; new workers that
report another version are kept out the same way). When every server refused a disk update or a version
relabel and all still report the version they had, nothing changed: the fleet keeps serving.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from router.control.upstream import Upstream, fan_out
from router.core.config import RouterConfig
from router.core.errors import Conflict, RouterError, ServiceUnavailable
from router.core.registry import Registry, Worker, WorkerState
from router.core.traffic import AbortAction, LiveRequest, RequestPathControl
from router.flows.fleet import (
    ABORT_REPEAT_SECS,
    INFO_TIMEOUT,
    FleetVersion,
    WorkerResult,
    http_status,
    live_weight_version,
    most_common,
    read_fleet_weight_version,
    summary,
    wait_quiet,
)
from router.flows.steps import Step

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
HISTORY_SIZE = 50
CACHE_NOT_FLUSHED = "cache was not flushed"
SESSION_ALREADY_OPEN = "already open"


@dataclass(slots=True)
class Operation:
    """One fleet-wide operation (update, pause, continue, memory release/resume): its visible state."""

    id: str
    kind: str
    options: dict
    started_at: float = field(default_factory=time.time)
    started: float = field(default_factory=time.monotonic)
    state: str = "running"  # running | succeeded | failed
    steps: list[Step] = field(default_factory=list)
    status: int = 0
    message: str = ""
    hold_s: float | None = None  # how long new requests were held
    quiesce_s: float | None = None  # from the call to a quiet fleet
    aborted_requests: int = 0
    held_requests: int = 0
    weight_version: str | None = None
    workers: list[dict] = field(default_factory=list)
    duration_s: float | None = None

    def step(self, name: str, deadline_s: float | None = None) -> Step:
        step = Step(name, deadline_s)
        self.steps.append(step)
        return step

    @property
    def current_step(self) -> str | None:
        running = [s.name for s in self.steps if s.running]
        return running[-1] if running else None

    def finish(self, status: int, message: str) -> None:
        self.status = status
        self.message = message
        self.state = "succeeded" if status == 200 else "failed"
        self.duration_s = time.monotonic() - self.started
        for step in self.steps:
            if step.running:
                step.end("failed", "interrupted")

    def to_dict(self) -> dict:
        return {"id": self.id, "kind": self.kind, "state": self.state, "step": self.current_step,
                "options": self.options, "started_at": self.started_at, "duration_s": _round(self.duration_s),
                "status": self.status, "message": self.message, "hold_s": _round(self.hold_s),
                "quiesce_s": _round(self.quiesce_s), "aborted_requests": self.aborted_requests,
                "held_requests": self.held_requests, "weight_version": self.weight_version,
                "steps": [s.to_dict() for s in self.steps], "workers": self.workers}


@dataclass(slots=True)
class LeftOut:
    kind: str  # weights | paused | memory: which call can bring the server back
    reason: str
    since: float = field(default_factory=time.time)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


class WeightFlow:
    def __init__(self, config: RouterConfig, registry: Registry, upstream: Upstream, traffic: RequestPathControl,
                 spawn: Callable[[Awaitable], asyncio.Task]) -> None:
        self.config = config
        self.registry = registry
        self.upstream = upstream
        self.traffic = traffic  # the request path: admission's hold and the router's live requests
        self.spawn = spawn
        self.fleet_version: str | None = None  # set by the first update (or adopted from an agreeing fleet)
        self.left_out: dict[str, LeftOut] = {}
        self.paused: str | None = None  # the pause mode while the router holds the fleet paused
        self.released_tags: set[str] = set()
        self.session_open = False  # a begin_weight_update session opened through the router
        self.current: Operation | None = None
        self.history: collections.deque[Operation] = collections.deque(maxlen=HISTORY_SIZE)
        self._lock = asyncio.Lock()
        self._ids = itertools.count(1)
        self._no_session_api: set[str] = set()  # workers whose server has no begin/end_weight_update
        self.observers: list[Callable[[Operation], None]] = []  # told of every finished operation (metrics)
        self._wake = asyncio.Event()
        self._reconciler: asyncio.Task | None = None
        # Role conversions running now (set by the app): an operation waits for them after closing admission
        # (which keeps new ones from starting), so no server switches role under a fleet-wide operation.
        self.conversions_running: Callable[[], list] = lambda: []
        # Why no new operation may start now (the router is shutting down), or None (set by the app).
        self.refusing: Callable[[], str | None] = lambda: None
        self._op_task: asyncio.Task | None = None  # the running operation's task
        self._rolling_back = False
        registry.subscribe(self._on_registry_event)

    # ---- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        self._reconciler = self.spawn(self._reconcile_loop())

    async def close(self) -> None:
        if self._reconciler is not None:
            self._reconciler.cancel()
            await asyncio.gather(self._reconciler, return_exceptions=True)

    # ---- state -------------------------------------------------------------------------------------
    def state(self) -> dict:
        last = self.history[-1] if self.history else None
        return {
            "fleet_weight_version": self.fleet_version,
            "paused": self.paused,
            "memory_released": sorted(self.released_tags),
            "session_open": self.session_open,
            "admission": self.traffic.admission_state(),
            "left_out": [{"id": wid, "url": w.url if (w := self.registry.find(wid)) else None, "kind": lo.kind,
                          "reason": lo.reason, "since": lo.since} for wid, lo in self.left_out.items()],
            "current": self.current.to_dict() if self.current else None,
            "last": last.to_dict() if last else None,
            "history": [op.to_dict() for op in reversed(self.history)],
        }

    def find(self, op_id: str) -> Operation | None:
        if self.current is not None and self.current.id == op_id:
            return self.current
        return next((op for op in self.history if op.id == op_id), None)

    def targets(self) -> list[Worker]:
        """Servers a fleet-wide call goes to: every known server but pending ones (not reachable yet) and
        failed ones that another flow left unsafe (ours come back through these calls)."""
        return [w for w in self.registry.workers()
                if w.state is not WorkerState.PENDING
                and (w.state is not WorkerState.FAILED or w.id in self.left_out)]

    # ---- running one operation at a time, immune to the caller going away ---------------------------
    async def run(self, kind: str, options: dict, body: Callable[[Operation], Awaitable[tuple[int, dict]]],
                  *, shutting_down: bool = False) -> tuple[int, dict]:
        """Run an operation as an owned task: a client that disconnects does not cancel a fleet update
        half-way. Operations run one at a time; a caller waits for its turn up to the update deadline.
        `shutting_down`: the shutdown's own operation, which runs while others are refused."""
        return await asyncio.shield(self.spawn(self._run(kind, options, body, shutting_down)))

    def _refuse_while_shutting_down(self, shutting_down: bool) -> None:
        if not shutting_down and (refusal := self.refusing()) is not None:
            raise ServiceUnavailable(f"{refusal}: no fleet operation starts now")

    async def _run(self, kind, options, body, shutting_down: bool = False) -> tuple[int, dict]:
        self._refuse_while_shutting_down(shutting_down)
        op = Operation(f"op{next(self._ids)}", kind, options)
        try:
            async with asyncio.timeout(self.config.weight_update_timeout_secs):
                await self._lock.acquire()
        except TimeoutError:
            busy = self.current.to_dict() if self.current else None
            raise Conflict(f"another fleet operation is still running after "
                           f"{self.config.weight_update_timeout_secs:g} s", current=busy) from None
        try:
            self._refuse_while_shutting_down(shutting_down)  # it waited for its turn: check again
        except ServiceUnavailable:
            self._lock.release()
            raise
        self.current = op
        self._op_task = asyncio.current_task()
        status, answer = 500, {}
        try:
            status, answer = await body(op)
            return status, answer
        except asyncio.CancelledError:
            if not self._rolling_back:
                raise
            # Cancelled by the shutdown before any server changed: the caller gets an answer that says so.
            message = f"{self.refusing() or 'the router is shutting down'}: {kind} rolled back, nothing was changed"
            status, answer = 503, {"success": False, "message": message}
            raise ServiceUnavailable(message) from None
        except RouterError as error:
            status, answer = error.status, {"success": False, "message": error.message}
            raise
        except Exception as exc:  # recorded, then the error middleware answers 500
            status, answer = 500, {"success": False, "message": f"{type(exc).__name__}: {exc}"}
            logger.exception("fleet operation %s (%s) failed", op.id, kind)
            raise
        finally:
            op.finish(status, str(answer.get("message", "")))
            self.current = None
            self._op_task = None
            self._rolling_back = False
            self.history.append(op)
            for observe in self.observers:
                observe(op)
            self._lock.release()
            logger.info("fleet operation %s %s: %s in %.3f s (%s)", op.id, kind, op.state, op.duration_s,
                        op.message[:300])

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
            if not keep:
                self.traffic.release(reason)
            op.hold_s = time.monotonic() - started
            op.held_requests = self.traffic.held_total - held_before

    async def _wait_for_conversions(self, op: Operation) -> None:
        running = self.conversions_running()
        if not running:
            return
        timeout = max(op.started + self.config.weight_update_timeout_secs - time.monotonic(), 0.0)
        step = op.step("conversions", timeout)
        names = ", ".join(c.worker_url for c in running)
        done, pending = await asyncio.wait([asyncio.ensure_future(c.wait()) for c in running], timeout=timeout)
        for task in pending:
            task.cancel()
        if pending:
            step.end("timeout", f"role conversion of {names} still running")
            raise Conflict(f"a role conversion is still running ({names}); nothing was changed")
        step.end("ok", f"waited for the role conversion of {names}")

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
        quiet = await wait_quiet(self.registry, self.upstream, workers, time.monotonic() + timeout, abort=abort)
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
        return await self.run(kind, options, lambda op: self._update(op, kind, body, target, abort, retry))

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
                asyncio.gather(*(live_weight_version(self.upstream, w) for w in workers)),
                self._quiesce(op, workers, abort=abort, retry=retry))
            if not quiet:
                return self._quiesce_timeout_answer(op, "update")
            before = dict(zip(workers, snapshot))

            step = op.step("update", self.config.weight_update_timeout_secs)
            results = await fan_out(workers, lambda w: self._apply(kind, w, body, deadline))
            step.end("ok" if all(o.success for o in results) else "failed", summary(results, kind))

            step = op.step("verify", INFO_TIMEOUT)
            versions = await asyncio.gather(*(live_weight_version(self.upstream, w) for w in workers))
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
        served = 0
        for result, version in zip(results, versions):
            worker = result.worker
            if version is not None and self.registry.find(worker.id) is worker:
                self.registry.update_info(worker, weight_version=version)
            if result.success and fleet is not None and version is not None and version != fleet:
                result.success = False
                result.message = (f"{result.message} But it reports weight_version {version!r}, not the "
                                   f"fleet's {fleet!r}.").strip()
            if result.success:
                served += 1
                self._rejoin(worker, f"weights: updated to {version!r}", kinds=("weights",))
            else:
                self._leave_out(worker, "weights", f"{kind} failed: {result.message}"[:500])
            result.extra["routable"] = worker.routable
        if served and fleet is not None:
            self.fleet_version = fleet
        message = summary(results, kind)
        failed = len(results) - served
        if failed:
            message += (f" {failed} server(s) left out of routing until they serve version "
                        f"{self.fleet_version!r}.")
        return message

    # ---- leaving routing and coming back ------------------------------------------------------------
    def _leave_out(self, worker: Worker, kind: str, reason: str) -> None:
        if self.registry.find(worker.id) is not worker:
            return
        held = self.left_out.get(worker.id)
        if held is not None and held.kind != kind and kind == "weights":
            kind = held.kind  # still paused / without its memory: only that call can bring it back
        self.left_out[worker.id] = LeftOut(kind, reason)
        self.registry.set_state(worker, WorkerState.FAILED, f"left out by {kind}: {reason}")

    def _rejoin(self, worker: Worker, reason: str, kinds: tuple[str, ...]) -> bool:
        left = self.left_out.get(worker.id)
        if left is None or left.kind not in kinds:
            return False
        del self.left_out[worker.id]
        if self.registry.find(worker.id) is worker and worker.state is WorkerState.FAILED:
            self.registry.set_state(worker, WorkerState.ACTIVE, reason)
        return True

    async def _rejoin_if_current(self, worker: Worker, reason: str, kind: str) -> None:
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
        self._rejoin(worker, reason, kinds=(kind,))

    def _on_registry_event(self, event: str, worker: Worker, details: dict) -> None:
        if event == "removed":
            self.left_out.pop(worker.id, None)
            self._no_session_api.discard(worker.id)
        elif event == "state" and details.get("old") == WorkerState.FAILED.value \
                and details.get("new") != WorkerState.FAILED.value and worker.id in self.left_out:
            self.left_out.pop(worker.id)  # an operator put it back (reinstate): no longer ours to hold out
            self._wake.set()
        elif event == "added" or (event == "state" and details.get("new") == WorkerState.ACTIVE.value) \
                or (event == "info" and "weight_version" in details):
            self._wake.set()

    async def _reconcile_loop(self) -> None:
        interval = max(self.config.health.interval_secs, 0.5)
        while True:
            try:  # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancel racing a wake-up
                async with asyncio.timeout(interval):
                    await self._wake.wait()
            except TimeoutError:
                pass
            self._wake.clear()
            if self._lock.locked():
                continue
            try:
                async with self._lock:
                    await self._reconcile()
            except Exception:  # keep reconciling; the next round may succeed
                logger.exception("weight version reconciliation failed")

    async def reconcile(self) -> dict:
        async with self._lock:
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
                self._rejoin(worker, f"weights: serves the fleet's version {fleet!r}", kinds=("weights",))
                rejoined.append(worker.url)
            elif worker in suspects and version is not None and version != fleet \
                    and worker.state is WorkerState.ACTIVE:
                self._leave_out(worker, "weights", f"serves weight_version {version!r}, the fleet serves {fleet!r}")
                kept_out.append(worker.url)
        if rejoined or kept_out:
            logger.info("weight reconciliation: rejoined %s, left out %s", rejoined, kept_out)
        return {"fleet_weight_version": fleet, "rejoined": rejoined, "left_out": kept_out}

    # ---- pause / continue ----------------------------------------------------------------------------
    async def pause(self, body: dict, *, retry: bool) -> tuple[int, dict]:
        mode = body.get("mode", "abort")
        return await self.run("pause_generation", {"mode": mode, "retry_aborted": retry},
                              lambda op: self._pause(op, body, mode, retry))

    async def _pause(self, op: Operation, body: dict, mode: str, retry: bool) -> tuple[int, dict]:
        self.traffic.hold(PAUSE_HOLD)  # kept until continue_generation
        op.step("hold").end("ok", "admission closed until continue_generation")
        self.paused = mode
        workers = self.targets()
        if mode == "abort":
            op.aborted_requests = self._mark_aborted(workers, retry)
        step = op.step("pause", self.config.abort_timeout_secs)
        results = await fan_out(workers, lambda w: self._call(w, "/pause_generation", body,
                                                               self.config.abort_timeout_secs))
        step.end("ok" if all(o.success for o in results) else "failed", summary(results, "pause_generation"))
        if mode == "abort":  # the servers answered once their requests were gone; so must the router's
            step = op.step("quiesce", self.config.abort_timeout_secs)
            quiet = await wait_quiet(self.registry, self.upstream, workers,
                                     time.monotonic() + self.config.abort_timeout_secs, abort=True)
            op.quiesce_s = time.monotonic() - op.started
            step.end("ok" if quiet.ok else "timeout", f"busy: {quiet.busy}" if quiet.busy else "")
            paused_requests = 0
        else:
            paused_requests = self.traffic.count_on(workers)  # the router's requests now stalled in the servers
        op.workers = [o.to_dict() for o in results]
        status = http_status(results)
        message = "Generation paused successfully." if status == 200 else summary(results, "pause_generation")
        return status, {"success": status == 200, "message": message, "status": "ok" if status == 200 else "error",
                        "num_paused_requests": paused_requests, "num_aborted_requests": op.aborted_requests,
                        "workers": op.workers}

    async def resume(self, body: dict) -> tuple[int, dict]:
        return await self.run("continue_generation", {}, lambda op: self._resume(op, body))

    async def _restore(self, op: Operation, step_name: str, call: str, body: dict, timeout: float,
                       kind: str) -> list:
        """Fan out a call that gives a server back its ability to serve (continue, memory resume): those
        that took it rejoin routing (at the fleet's weight version), the others are left out as `kind`."""
        step = op.step(step_name, timeout)
        results = await fan_out(self.targets(), lambda w: self._call(w, "/" + call, body, timeout))
        step.end("ok" if all(o.success for o in results) else "failed", summary(results, call))
        for result in results:
            if result.success:
                await self._rejoin_if_current(result.worker, f"{call} succeeded", kind)
            else:  # it cannot serve (still paused, memory not back, or unreachable)
                self._leave_out(result.worker, kind, f"{call} failed: {result.message}")
        return results

    async def _resume(self, op: Operation, body: dict) -> tuple[int, dict]:
        results = await self._restore(op, "continue", "continue_generation", body, self.config.abort_timeout_secs,
                                       "paused")
        for result in results:
            result.extra["routable"] = result.worker.routable
        self.paused = None
        self.traffic.release(PAUSE_HOLD)
        op.step("release").end("ok", "admission open")
        op.workers = [o.to_dict() for o in results]
        status = http_status(results)
        message = "Generation continued successfully." if status == 200 else summary(results, "continue_generation")
        return status, {"success": status == 200, "message": message, "status": "ok" if status == 200 else "error",
                        "workers": op.workers}

    # ---- memory release / resume -------------------------------------------------------------------
    async def release_memory(self, body: dict, *, abort: bool, retry: bool) -> tuple[int, dict]:
        return await self.run("release_memory_occupation", {"tags": body.get("tags"), "abort_all_requests": abort},
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
            results = await fan_out(workers, lambda w: self._call(w, "/release_memory_occupation", body,
                                                                   self.config.weight_update_timeout_secs))
            step.end("ok" if all(o.success for o in results) else "failed",
                     summary(results, "release_memory_occupation"))
            if any(o.success for o in results):
                self.released_tags |= set(body.get("tags") or ALL_MEMORY_TAGS)
            elif not held_already:
                self.traffic.release(MEMORY_HOLD)  # nothing was released: serve on
        return self._aggregate(op, results, "release_memory_occupation",
                               memory_released=sorted(self.released_tags))

    async def resume_memory(self, body: dict) -> tuple[int, dict]:
        return await self.run("resume_memory_occupation", {"tags": body.get("tags")},
                              lambda op: self._resume_memory(op, body))

    async def _resume_memory(self, op: Operation, body: dict) -> tuple[int, dict]:
        results = await self._restore(op, "resume", "resume_memory_occupation", body,
                                       self.config.weight_update_timeout_secs, "memory")
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

    # ---- abort ---------------------------------------------------------------------------------------
    async def abort(self, *, rid: str | None, abort_all: bool) -> tuple[int, dict | None]:
        """Abort one request (on the two servers that hold it) or all; return once the router's aborted
        requests have ended (SGLang's own abort returns at once and aborts later)."""
        deadline = time.monotonic() + self.config.abort_timeout_secs
        if abort_all:
            aborted = self.traffic.mark_all(AbortAction.ANSWER)
            results = await fan_out(self.targets(), lambda w: self._abort_call(w, {"abort_all": True}))
        else:
            found = self.traffic.mark_rid(rid, AbortAction.ANSWER)
            if found is None:  # not routed by this router now: every server may know it
                results = await fan_out(self.targets(), lambda w: self._abort_call(w, {"rid": rid}))
                aborted = []
            else:
                request, rids = found
                aborted = [request]
                results = await fan_out((request.prefill, request.decode), lambda w: self._abort_rids(w, rids))
        pending = await self._wait_ended(aborted, deadline)
        if not all(o.success for o in results):
            return 502, {"success": False, "message": summary(results, "abort_request"),
                         "workers": [o.to_dict() for o in results]}
        if pending:
            return 504, {"success": False, "message": f"{len(pending)} aborted request(s) still running after "
                                                      f"{self.config.abort_timeout_secs:g} s",
                         "workers": [o.to_dict() for o in results]}
        return 200, None  # SGLang's answer: 200, empty body

    async def _abort_call(self, worker: Worker, body: dict) -> WorkerResult:
        reply = await self.upstream.post(worker.url, "/abort_request", body, timeout=INFO_TIMEOUT)
        return WorkerResult.of(worker, reply)

    async def _abort_rids(self, worker: Worker, rids: list[str]) -> WorkerResult:
        results = [await self._abort_call(worker, {"rid": rid}) for rid in rids]
        return next((o for o in results if not o.success), results[0]) if results else \
            WorkerResult(worker, True, 200, "nothing to abort")

    async def _wait_ended(self, requests: list[LiveRequest], deadline: float) -> list[LiveRequest]:
        """Wait for aborted requests to end; abort again by rid those still there (a leg can reach its
        server after the abort did)."""
        last_abort = time.monotonic()
        delay = 0.005
        while True:
            pending = self.traffic.still_live(requests)
            now = time.monotonic()
            if not pending or now >= deadline:
                return pending
            if now - last_abort >= ABORT_REPEAT_SECS:
                last_abort = now
                await asyncio.gather(*(self._abort_rids(w, a.rids) for a in pending if a.rids
                                       for w in (a.prefill, a.decode)))
            await asyncio.sleep(min(delay, max(deadline - now, 0)))
            delay = min(delay * 2, 0.1)

    # ---- shutdown ------------------------------------------------------------------------------------
    async def wait_current(self) -> None:
        """Until no operation runs (one waiting for its turn is refused once shutdown began)."""
        while (task := self._op_task) is not None and not task.done():
            await asyncio.wait((task,))

    def roll_back_current(self) -> Operation | None:
        """Cancel the running operation if it is a weight update that has not reached its `update` step (it
        only held and emptied the fleet: its hold is released and nothing changed on any server); return it.
        One past that point is left to finish within its own deadlines, never cut half-way."""
        op, task = self.current, self._op_task
        if op is None or task is None or task.done() or op.kind not in UPDATE_KINDS \
                or any(step.name == "update" for step in op.steps):
            return None
        self._rolling_back = True
        task.cancel()
        return op

    async def release_pause(self) -> tuple[int, dict] | None:
        """Shutdown: a pause the router put on the fleet is ended with continue_generation, so that no server
        stays paused with no router to continue it (None when the fleet is not paused)."""
        if self.paused is None:
            return None
        return await self.run("continue_generation", {"reason": "shutdown"}, lambda op: self._resume(op, {}),
                              shutting_down=True)

    async def abort_requests(self, requests: list[LiveRequest], deadline: float) -> list[LiveRequest]:
        """Abort these requests (already marked) on both of their servers, by rid; return those still running
        at `deadline` (monotonic)."""
        sends = [self._abort_rids(w, r.rids) for r in requests if r.rids for w in (r.prefill, r.decode)]
        if sends:
            try:
                async with asyncio.timeout(max(deadline - time.monotonic(), 0.0)):
                    await asyncio.gather(*sends)
            except TimeoutError:
                pass
        return await self._wait_ended(requests, deadline)

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
