"""Live P/D role conversion of one worker, orchestrated by the router.

    active ─► draining | aborting ─► converting ─► verifying ─► active in the other pool
                  │                      │              │
                  └──────────────────────┴──────────────┴─► active in the old pool (failed safely)
                                                           or failed (unsafe: never routed to until an
                                                           operator reinstates or removes it)

Each step has its own deadline and leaves an audit record (name, start, duration, outcome, message). The
worker leaves routing the moment the flow starts (its state is no longer `active`), so the emptying step
only waits: for the router's in-flight count to reach 0 and the server to report nothing running or
waiting (`drain`), or after `abort_all` for the same (`abort`; the request path re-sends router-aborted
requests when `retry_aborted` is on). The worker joins the other pool only after the server's live role has
been read back and its bootstrap port learnt: a switch that answered success without changing the role is
a failure.

Two server APIs: SGLang 0.5.23's `/pd_role_switch` (refuses while not idle, with `safe_to_restore` telling
whether the server is unchanged; `safe_to_restore` is false on success, so it is read only on failure) and
the earlier design's `/convert_pd_role` (reports the bootstrap port a new prefill listens on).
"""

from __future__ import annotations

import asyncio
import collections
import enum
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from router.control.health import agreed_weight_version, rejoin_refusal
from router.control.upstream import Reply, Upstream, bootstrap_port_of, live_role_of, weight_version_of
from router.core.errors import BadGateway, Conflict
from router.core.registry import Registry, Role, Worker, WorkerState
from router.flows.fleet import ABORT_REPEAT_SECS
from router.flows.steps import Step

logger = logging.getLogger(__name__)

PD_ROLE_SWITCH = "pd_role_switch"
CONVERT_PD_ROLE = "convert_pd_role"
SWITCH_APIS = (PD_ROLE_SWITCH, CONVERT_PD_ROLE)  # probing order when the server did not say

# 0.5.23 refuses a switch to decode without it. 0 skips the server's CUDA-graph headroom check; a failed
# capture only degrades decode to eager mode, so 0 is the value that lets a switch proceed everywhere.
DEFAULT_DECODE_CUDA_GRAPH_MEMORY_GB = 0.0
VERIFY_TIMEOUT_SECS = 15.0
HISTORY_SIZE = 100
INFO_TIMEOUT = 5.0
HEALTH_TIMEOUT = 25.0  # 0.5.23's /health runs a 1-token generation and waits up to 20 s for progress
POLL_FIRST, POLL_MAX = 0.01, 0.2
SWITCH_RETRY_FIRST, SWITCH_RETRY_MAX = 0.1, 2.0

# Server options the router knows, and the APIs that take each (server_patches' /convert_pd_role passes the
# CUDA-graph ones on to the in-place switch). Others go in `server_options`, sent verbatim.
BOTH_APIS = frozenset(SWITCH_APIS)
SERVER_OPTIONS: dict[str, frozenset[str]] = {
    "decode_cuda_graph_bs": BOTH_APIS,
    "decode_cuda_graph_memory_gb": BOTH_APIS,
    "bootstrap_port": frozenset({CONVERT_PD_ROLE}),
    "disable_radix_cache": frozenset({CONVERT_PD_ROLE}),
    "disable_cuda_graph": frozenset({CONVERT_PD_ROLE}),
}


class DrainMode(str, enum.Enum):
    DRAIN = "drain"  # stop routing; wait for in-flight requests to finish
    ABORT = "abort"  # stop routing; abort everything on the worker; wait until it is idle

    def __str__(self) -> str:
        return self.value


class ConversionOutcome(str, enum.Enum):
    CONVERTED = "converted"  # active in the new pool
    RESTORED = "restored"  # failed safely: active again in the old pool
    FAILED = "failed"  # left unsafe: worker state `failed`
    REFUSED = "refused"  # never started (busy, last routable worker of its pool, not active)
    CANCELLED = "cancelled"  # the router shut down mid-flow

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class Plan:
    """What an operator asked for (validated by the API layer)."""

    mode: DrainMode = DrainMode.DRAIN
    new_role: Role | None = None  # None: the opposite of the worker's role
    empty_timeout_s: float | None = None  # drain/abort deadline; None: the router's drain_timeout_secs
    switch_timeout_s: float | None = None  # None: the router's switch_timeout_secs
    verify_timeout_s: float | None = None
    server_options: dict = field(default_factory=dict)  # known options (SERVER_OPTIONS), routed by API
    raw_server_options: dict = field(default_factory=dict)  # sent verbatim to whichever API the server has
    # The server API to try first: the router's /convert_pd_role asks for the server's own /convert_pd_role
    # (which takes the design's options) where it exists; None: the API learnt from the server.
    api: str | None = None


@dataclass(eq=False, slots=True)
class Conversion:
    id: str
    worker_id: str
    worker_url: str
    old_role: Role
    new_role: Role
    mode: DrainMode
    started_at: float = field(default_factory=time.time)
    t0: float = field(default_factory=time.monotonic)
    state: str = "starting"  # the step running now, or "done"
    outcome: ConversionOutcome | None = None
    message: str = ""
    status: int = 0  # the HTTP status that reports the outcome
    api: str | None = None
    bootstrap_port: int | None = None
    server_switch_s: float | None = None  # the answering switch call, timed by the router
    duration_s: float | None = None
    notes: list[str] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)
    done: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def running(self) -> bool:
        return self.outcome is None

    @property
    def success(self) -> bool:
        return self.outcome is ConversionOutcome.CONVERTED

    def step_time(self, *names: str) -> float:
        return sum(s.duration_s or 0.0 for s in self.steps if s.name in names)

    def finish(self, outcome: ConversionOutcome, message: str, status: int) -> None:
        self.outcome, self.message, self.status = outcome, message, status
        self.state = "done"
        self.duration_s = time.monotonic() - self.t0
        self.done.set()

    async def wait(self) -> "Conversion":
        await self.done.wait()
        return self

    def to_dict(self) -> dict:
        empty_s = self.step_time("drain", "abort")
        overhead = None
        if self.duration_s is not None:
            overhead = max(self.duration_s - empty_s - (self.server_switch_s or 0.0), 0.0)
        return {
            "id": self.id, "worker_id": self.worker_id, "worker_url": self.worker_url,
            "old_role": self.old_role.value, "new_role": self.new_role.value, "mode": self.mode.value,
            "state": self.state, "outcome": None if self.outcome is None else self.outcome.value,
            "success": self.success, "message": self.message, "status": self.status, "api": self.api,
            "bootstrap_port": self.bootstrap_port, "started_at": self.started_at,
            "duration_s": None if self.duration_s is None else round(self.duration_s, 6),
            # where the time went: emptying the worker, the server's own switch, and the rest (router-side)
            "empty_s": round(empty_s, 6),
            "server_switch_s": None if self.server_switch_s is None else round(self.server_switch_s, 6),
            "overhead_s": None if overhead is None else round(overhead, 6),
            "notes": list(self.notes),
            "steps": [{"step": s.name, **s.to_dict()} for s in self.steps],  # "step": the API's first key
        }


class StepFailed(Exception):
    """A step could not complete. `safe`: True → the server is unchanged (back to the old pool); False → the
    server may be broken (`failed`); None → unknown: decided by reading the live role back."""

    def __init__(self, message: str, *, safe: bool | None, status: int = 502):
        super().__init__(message)
        self.message = message
        self.safe = safe
        self.status = status


class _Unsupported(Exception):
    """The server does not have this switch API (404/405): nothing happened."""


def _positive(value: float | None, default: float) -> float:
    return value if value is not None and value > 0 else default


def _not_idle(message: str) -> bool:
    text = message.lower()
    return "not idle" in text or "drain all requests" in text


class Conversions:
    """Runs conversions (one per worker at a time) and keeps their bounded history."""

    def __init__(self, registry: Registry, upstream: Upstream, spawn: Callable[[Awaitable], asyncio.Task], *,
                 drain_timeout_s: float = 300.0, switch_timeout_s: float = 120.0,
                 verify_timeout_s: float = VERIFY_TIMEOUT_SECS, history_size: int = HISTORY_SIZE,
                 fleet_busy: Callable[[], str | None] = lambda: None) -> None:
        self.registry = registry
        self.upstream = upstream
        self.spawn = spawn
        self.drain_timeout_s = drain_timeout_s
        self.switch_timeout_s = switch_timeout_s
        self.verify_timeout_s = verify_timeout_s
        # Why a fleet-wide operation (a weight update's hold) forbids starting a conversion now, or None.
        self.fleet_busy = fleet_busy
        self._ids = itertools.count(1)
        self._running: dict[str, Conversion] = {}  # by worker id
        self._tasks: dict[str, asyncio.Task] = {}  # by conversion id
        self._history: collections.OrderedDict[str, Conversion] = collections.OrderedDict()
        self._history_size = history_size
        # (event, conversion, details): "finished" once per conversion (refusals included); "abort_all" per
        # abort sent, with `inflight` = the router's requests it aborted (counted once per conversion)
        self.observers: list[Callable[[str, Conversion, dict], None]] = []

    # ---- reads -------------------------------------------------------------------------------------
    def running(self) -> list[Conversion]:
        return list(self._running.values())

    def history(self) -> list[Conversion]:
        """Newest first, running ones included."""
        return list(reversed(self._history.values()))

    def get(self, conversion_id: str) -> Conversion | None:
        return self._history.get(conversion_id)

    def of_worker(self, worker: Worker) -> Conversion | None:
        return self._running.get(worker.id)

    # ---- start -------------------------------------------------------------------------------------
    def start(self, worker: Worker, plan: Plan) -> Conversion | None:
        """Check, take the worker out of routing and run the flow in the background.

        Returns None when the worker already has the asked role (nothing to do). Raises Conflict, after
        recording the refusal, when the conversion must not start. Everything up to taking the worker out of
        routing happens without awaiting, so two concurrent calls cannot both pass the checks."""
        new_role = plan.new_role or worker.role.opposite
        refusal = self._busy(worker)
        if refusal is None and new_role is worker.role:
            return None
        conversion = Conversion(id=f"c{next(self._ids)}", worker_id=worker.id, worker_url=worker.url,
                                old_role=worker.role, new_role=new_role, mode=plan.mode)
        refusal = refusal or self.fleet_busy() or self._last_of_pool(worker)
        if refusal is not None:
            self._finish(conversion, ConversionOutcome.REFUSED, refusal, 409)
            self._remember(conversion)
            logger.warning("conversion %s of %s refused: %s", conversion.id, worker.url, refusal)
            raise Conflict(refusal, conversion_id=conversion.id)
        self._running[worker.id] = conversion
        self._remember(conversion)
        if plan.mode is DrainMode.DRAIN:
            self._set(worker, conversion, WorkerState.DRAINING, "drain", "no new requests; in-flight ones finish")
        else:
            self._set(worker, conversion, WorkerState.ABORTING, "abort", "aborting its requests")
        logger.info("conversion %s: %s %s -> %s (%s mode) started", conversion.id, worker.url, worker.role,
                    new_role, plan.mode)
        task = self.spawn(self._run(conversion, worker, plan))
        self._tasks[conversion.id] = task
        task.add_done_callback(lambda _t, cid=conversion.id: self._tasks.pop(cid, None))
        return conversion

    def _busy(self, worker: Worker) -> str | None:
        if self.registry.find(worker.id) is not worker:
            return f"worker {worker.id} is no longer registered"
        running = self._running.get(worker.id)
        if running is not None:
            return (f"worker {worker.id} ({worker.url}) is already being converted by {running.id} "
                    f"(step {running.state}); one conversion per worker at a time")
        if worker.state is not WorkerState.ACTIVE:
            return (f"worker {worker.id} ({worker.url}) is {worker.state} ({worker.state_reason or '-'}): only an "
                    f"active worker can be converted")
        return None

    def _last_of_pool(self, worker: Worker) -> str | None:
        others = [w for w in self.registry.routable(worker.role) if w is not worker]
        if not others:
            return (f"worker {worker.id} ({worker.url}) is the last routable {worker.role} worker: converting it "
                    f"would leave no {worker.role} worker to route to")
        return None

    def _finish(self, conversion: Conversion, outcome: ConversionOutcome, message: str, status: int) -> None:
        conversion.finish(outcome, message, status)
        self._notify("finished", conversion)

    def _notify(self, event: str, conversion: Conversion, **details) -> None:
        for observe in self.observers:
            try:
                observe(event, conversion, details)
            except Exception:  # an observer (metrics) must not break a flow
                logger.exception("conversion observer failed on %s", event)

    def _remember(self, conversion: Conversion) -> None:
        self._history[conversion.id] = conversion
        while len(self._history) > self._history_size:
            oldest_id = next(iter(self._history))
            if self._history[oldest_id].running:  # never forget a running one; the bound is soft
                break
            self._history.pop(oldest_id)

    def _set(self, worker: Worker, conversion: Conversion, state: WorkerState, step: str, detail: str) -> None:
        conversion.state = step
        self.registry.set_state(worker, state, f"conversion {conversion.id} {conversion.old_role}->"
                                               f"{conversion.new_role} ({conversion.mode}): {detail}")

    # ---- the flow ----------------------------------------------------------------------------------
    async def _run(self, conversion: Conversion, worker: Worker, plan: Plan) -> None:
        switch_called = False
        try:
            try:
                empty_timeout = _positive(plan.empty_timeout_s, self.drain_timeout_s)
                if plan.mode is DrainMode.DRAIN:
                    await self._step(conversion, "drain", empty_timeout, lambda s: self._drain(worker, s),
                                     on_timeout=lambda s: self._empty_timeout(worker, s, "drain"))
                else:
                    await self._step(conversion, "abort", empty_timeout, lambda s: self._abort(conversion, worker, s),
                                     on_timeout=lambda s: self._empty_timeout(worker, s, "abort"))
                self._set(worker, conversion, WorkerState.CONVERTING, "switch", "the server is switching role")
                switch_called = True
                answer = await self._step(
                    conversion, "switch", _positive(plan.switch_timeout_s, self.switch_timeout_s),
                    lambda s: self._switch(conversion, worker, plan, s),
                    on_timeout=lambda s: StepFailed(f"the server did not switch within {s.deadline_s:g} s "
                                                    f"({s.message or 'no answer'})", safe=None, status=504))
            except StepFailed as failure:
                if not await self._recover(conversion, worker, failure, may_resume=switch_called):
                    return
                answer = {}
            self._set(worker, conversion, WorkerState.VERIFYING, "verify", "reading its live role back")
            verify_timeout = _positive(plan.verify_timeout_s, self.verify_timeout_s)
            seen: dict = {}
            try:
                port = await self._step(
                    conversion, "verify", verify_timeout, lambda s: self._verify(conversion, worker, answer, s, seen),
                    on_timeout=lambda s: self._verify_timeout(conversion, s, seen))
            except StepFailed as failure:
                await self._recover(conversion, worker, failure, may_resume=False)
                return
            self._activate(conversion, worker, port)
        except asyncio.CancelledError:
            self._end_cancelled(conversion, worker, switch_called)
            raise
        except Exception as exc:  # a bug must not leave the worker half-converted and invisible
            logger.exception("conversion %s crashed", conversion.id)
            failure = StepFailed(f"internal error: {type(exc).__name__}: {exc}", safe=not switch_called, status=500)
            self._end_failed(conversion, worker, failure, not switch_called)
        finally:
            if self._running.get(worker.id) is conversion:
                del self._running[worker.id]
            if not conversion.done.is_set():  # defensive: every path above finishes the record
                self._finish(conversion, ConversionOutcome.FAILED, "conversion ended without an outcome", 500)

    async def _step(self, conversion: Conversion, name: str, deadline_s: float,
                    body: Callable[[Step], Awaitable[Any]], *, on_timeout: Callable[[Step], StepFailed]) -> Any:
        step = Step(name, deadline_s)
        conversion.steps.append(step)
        conversion.state = name
        try:
            async with asyncio.timeout(deadline_s):
                result = await body(step)
        except TimeoutError:
            failure = on_timeout(step)
            step.end("timeout", failure.message)
            self._log_step(conversion, step)
            raise failure from None
        except StepFailed as failure:
            step.end("failed", failure.message)
            self._log_step(conversion, step)
            raise
        except asyncio.CancelledError:
            step.end("cancelled", "the router is shutting down")
            raise
        step.end("ok")
        self._log_step(conversion, step)
        return result

    @staticmethod
    def _log_step(conversion: Conversion, step: Step) -> None:
        level = logging.INFO if step.outcome == "ok" else logging.WARNING
        logger.log(level, "conversion %s step %s: %s in %.3f s%s", conversion.id, step.name, step.outcome,
                   step.duration_s or 0.0, f" ({step.message})" if step.message else "")

    # ---- emptying the worker -----------------------------------------------------------------------
    async def _drain(self, worker: Worker, step: Step) -> None:
        await self._wait_idle(worker, step)
        step.message = step.message or "idle on the router and the server"

    async def _abort(self, conversion: Conversion, worker: Worker, step: Step) -> None:
        while True:
            # Mark first: a request aborted by this call must be recognisable as router-aborted.
            self.registry.mark_aborted([worker])
            # The router's requests on the worker, counted at the first abort only: the worker is out of
            # routing, so a later round finds the same requests (still ending), not new ones.
            inflight = worker.inflight if step.attempts == 0 else 0
            reply = await self.upstream.abort(worker.url, abort_all=True, timeout=INFO_TIMEOUT)
            step.attempts += 1
            self._notify("abort_all", conversion, inflight=inflight)
            if not reply.ok:
                step.message = f"abort_all answered {reply.status or 'nothing'}: {reply.message()}; waiting"
            try:
                async with asyncio.timeout(ABORT_REPEAT_SECS):
                    await self._wait_idle(worker, step)
                return
            except TimeoutError:
                continue  # a request reached the server after the abort, or the abort lags: abort again

    async def _wait_idle(self, worker: Worker, step: Step) -> None:
        """Router-side in-flight count 0, then the server reports nothing running, waiting or queued."""
        if worker.inflight:
            step.message = f"{worker.inflight} requests in flight on the router"
            await self.registry.wait_idle(worker, float("inf"))
        router_idle = time.monotonic()
        step.details["router_idle_s"] = round(router_idle - step.t0, 6)
        delay = POLL_FIRST
        while True:
            load = await self.upstream.load(worker.url, timeout=INFO_TIMEOUT)
            step.details["server_polls"] = step.details.get("server_polls", 0) + 1
            if load is None:
                step.message = "the server reports no load: relied on the router's in-flight count"
                break
            if load.idle:
                break
            step.message = (f"the server reports {load.running} running, {load.waiting} waiting and "
                            f"{load.queued} in its PD queues")
            await asyncio.sleep(delay)
            delay = min(delay * 2, POLL_MAX)
        step.details["server_idle_after_s"] = round(time.monotonic() - router_idle, 6)

    def _empty_timeout(self, worker: Worker, step: Step, what: str) -> StepFailed:
        detail = step.message or "not idle"
        if worker.inflight:
            detail = f"{worker.inflight} requests still in flight on the router"
        return StepFailed(f"{what} deadline ({step.deadline_s:g} s) exceeded: {detail}", safe=True, status=504)

    # ---- the switch --------------------------------------------------------------------------------
    async def _switch(self, conversion: Conversion, worker: Worker, plan: Plan, step: Step) -> dict:
        # The plan's API, then the one learnt from /server_info; a 404 there still tries the other one.
        apis = tuple(dict.fromkeys([a for a in (plan.api, worker.switch_api) if a] + list(SWITCH_APIS)))
        unsupported: list[str] = []
        for api in apis:
            try:
                answer = await self._switch_with(api, conversion, worker, plan, step)
            except _Unsupported:
                unsupported.append(api)
                continue
            conversion.api = api
            if worker.switch_api is None or worker.switch_api in unsupported:  # learnt by probing
                self.registry.update_info(worker, switch_api=api)
            return answer
        raise StepFailed(f"the server has no role-switch API (neither {' nor '.join('/' + a for a in apis)} "
                         f"exists): start it with --enable-pd-role-switch", safe=True)

    def _switch_body(self, api: str, conversion: Conversion, worker: Worker, plan: Plan) -> dict:
        options = {k: v for k, v in plan.server_options.items() if api in SERVER_OPTIONS.get(k, ())}
        ignored = sorted(k for k in plan.server_options if api not in SERVER_OPTIONS.get(k, ()))
        if ignored:
            note = f"ignored options that /{api} does not take: {', '.join(ignored)}"
            if note not in conversion.notes:
                conversion.notes.append(note)
        if api == PD_ROLE_SWITCH:
            body = {"new_role": conversion.new_role.value, **options, **plan.raw_server_options}
        else:
            # `check_idle` is left to its default (true: refuse when busy): the router has emptied the server
            # already, and retries a "not idle" refusal until the step's deadline.
            body = {"server_url": worker.url, **options, **plan.raw_server_options}
        if conversion.new_role is Role.DECODE:
            body.setdefault("decode_cuda_graph_memory_gb", DEFAULT_DECODE_CUDA_GRAPH_MEMORY_GB)
        return body

    async def _switch_with(self, api: str, conversion: Conversion, worker: Worker, plan: Plan, step: Step) -> dict:
        body = self._switch_body(api, conversion, worker, plan)
        deadline = step.t0 + step.deadline_s
        delay = SWITCH_RETRY_FIRST
        while True:
            started = time.monotonic()
            # The step's own deadline ends a call that outlives it (as a timeout); the call's is a backstop.
            reply = await self.upstream.post(worker.url, "/" + api, body,
                                             timeout=max(deadline - started, 0.0) + 1.0)
            conversion.server_switch_s = time.monotonic() - started
            step.attempts += 1
            if reply.status in (404, 405):
                raise _Unsupported(api)
            if reply.success():
                step.message = f"/{api}: {reply.message() or 'ok'}"
                return reply.data if isinstance(reply.data, dict) else {}
            message = reply.message()
            if reply.status == 0:
                # Refused connections mean nothing reached the server; a timeout or a cut answer may have.
                reached = not reply.text.startswith("ClientConnector")
                raise StepFailed(f"/{api} got no answer: {message}", safe=None if reached else True)
            data = reply.data if isinstance(reply.data, dict) else {}
            safe = data.get("safe_to_restore")
            if _not_idle(message) and safe is not False:
                # Transient (0.5.23: e.g. a decode holding KV of an aborted request for up to 30 s).
                step.message = f"/{api} refused, will retry: {message}"
                await asyncio.sleep(min(delay, max(deadline - time.monotonic(), 0)))
                delay = min(delay * 2, SWITCH_RETRY_MAX)
                continue
            if safe is True or reply.status == 422:
                raise StepFailed(f"/{api} refused ({reply.status}): {message}", safe=True)
            if safe is False:
                raise StepFailed(f"/{api} failed and the server is not safe to route to ({reply.status}): "
                                 f"{message}", safe=False)
            raise StepFailed(f"/{api} failed ({reply.status}): {message}", safe=None)

    async def _live_role(self, worker: Worker) -> tuple[str | None, Reply | None]:
        model, server = await asyncio.gather(self.upstream.model_info(worker.url, timeout=INFO_TIMEOUT),
                                             self.upstream.server_info(worker.url, timeout=INFO_TIMEOUT))
        role = live_role_of(model.data if model.ok else None, server.data if server.ok else None)
        return role, server if server.ok else None

    async def _recover(self, conversion: Conversion, worker: Worker, failure: StepFailed, *,
                       may_resume: bool) -> bool:
        """After a failed step: True if the server did switch after all (go on verifying), else end the flow,
        in the old pool when the server is known unchanged, else `failed`."""
        safe, message = failure.safe, failure.message
        if safe is None:
            # Unknown: nothing changed only if the server still reports its old role and is healthy.
            live, _ = await self._live_role(worker)
            if may_resume and live == conversion.new_role.value:
                conversion.notes.append(f"{message}; but the server reports role {live}: verifying")
                logger.warning("conversion %s: %s, yet the server reports the new role", conversion.id, message)
                return True
            if live == conversion.old_role.value:
                health = await self.upstream.health(worker.url, timeout=HEALTH_TIMEOUT)
                safe = health.ok
                message += f"; the server still reports role {live}"
                if not health.ok:
                    message += f" but /health answered {health.status or 'nothing'}"
            else:
                safe = False
                message += f"; the server reports role {live or 'nothing'}"
        self._end_failed(conversion, worker, StepFailed(message, safe=safe, status=failure.status), safe)
        return False

    # ---- verification and activation ---------------------------------------------------------------
    async def _verify(self, conversion: Conversion, worker: Worker, answer: dict, step: Step, seen: dict) -> int | None:
        delay = POLL_FIRST
        while True:
            step.attempts += 1
            live, server = await self._live_role(worker)
            seen["live"] = live
            if live == conversion.new_role.value:
                break
            step.message = f"the server reports role {live or 'unknown'}"
            await asyncio.sleep(delay)
            delay = min(delay * 2, POLL_MAX)
        if conversion.new_role is Role.DECODE:
            step.message = "role decode confirmed"
            return None
        port = answer.get("bootstrap_port")
        source = f"/{conversion.api}'s answer"
        if not isinstance(port, int) or isinstance(port, bool):
            port, source = bootstrap_port_of(server.data if server is not None else None), "/server_info"
        if port is None:
            step.message = ("role prefill confirmed; the server reports no bootstrap port: routing with "
                            "bootstrap_port null (decode servers use their own default)")
            logger.warning("conversion %s: %s", conversion.id, step.message)
        else:
            step.message = f"role prefill confirmed; bootstrap port {port} (from {source})"
        return port

    def _verify_timeout(self, conversion: Conversion, step: Step, seen: dict) -> StepFailed:
        live = seen.get("live")
        if live == conversion.old_role.value:  # nothing changed, if it is healthy: _recover checks
            return StepFailed(f"the switch answered success but the server still reports role {live} after "
                              f"{step.deadline_s:g} s", safe=None, status=502)
        return StepFailed(f"the server's role could not be confirmed within {step.deadline_s:g} s "
                          f"(it reports {live or 'nothing'})", safe=False, status=504)

    def _activate(self, conversion: Conversion, worker: Worker, port: int | None) -> None:
        conversion.bootstrap_port = port
        self.registry.move(worker, conversion.new_role, port, WorkerState.ACTIVE,
                           f"converted from {conversion.old_role} by {conversion.id}")
        message = f"{worker.url} converted from {conversion.old_role} to {conversion.new_role}"
        if port is not None:
            message += f" (bootstrap port {port})"
        self._finish(conversion, ConversionOutcome.CONVERTED, message, 200)
        logger.info("conversion %s: %s in %.3f s", conversion.id, message, conversion.duration_s)

    # ---- failure -------------------------------------------------------------------------------------
    def _end_failed(self, conversion: Conversion, worker: Worker, failure: StepFailed, safe: bool) -> None:
        if self.registry.find(worker.id) is not worker:
            self._finish(conversion, ConversionOutcome.FAILED, f"{failure.message}; the worker was removed meanwhile",
                         failure.status)
            return
        if safe:
            self.registry.set_state(worker, WorkerState.ACTIVE,
                                    f"conversion {conversion.id} failed safely: {failure.message}")
            message = f"conversion failed; {worker.url} is back in the {worker.role} pool: {failure.message}"
            self._finish(conversion, ConversionOutcome.RESTORED, message, failure.status)
        else:
            self.registry.set_state(worker, WorkerState.FAILED,
                                    f"conversion {conversion.id} left it unsafe: {failure.message}; reinstate "
                                    f"(POST /admin/workers/{worker.id}/reinstate) or remove it")
            message = (f"conversion failed and {worker.url} is not safe to route to (state failed; POST "
                       f"/admin/workers/{worker.id}/reinstate or DELETE /workers/{worker.id}): {failure.message}")
            self._finish(conversion, ConversionOutcome.FAILED, message, failure.status)
        logger.warning("conversion %s: %s", conversion.id, conversion.message)

    def _end_cancelled(self, conversion: Conversion, worker: Worker, switch_called: bool) -> None:
        if self.registry.find(worker.id) is worker:
            if switch_called:
                self.registry.set_state(worker, WorkerState.FAILED,
                                        f"conversion {conversion.id} interrupted during the switch")
            else:
                self.registry.set_state(worker, WorkerState.ACTIVE, f"conversion {conversion.id} cancelled")
        self._finish(conversion, ConversionOutcome.CANCELLED, "the router shut down during the conversion", 503)

    # ---- operator actions ----------------------------------------------------------------------------
    async def reinstate(self, worker: Worker, timeout: float = 30.0) -> str:
        """Put a `failed` worker back into routing in the role its server reports now, once it is healthy."""
        if worker.state is not WorkerState.FAILED:
            raise Conflict(f"worker {worker.id} is {worker.state}, not failed: nothing to reinstate")
        (live, server), health = await asyncio.gather(self._live_role(worker),
                                                      self.upstream.health(worker.url, timeout=timeout))
        if live not in (Role.PREFILL.value, Role.DECODE.value):
            raise BadGateway(f"cannot reinstate {worker.url}: it reports no prefill/decode role "
                             f"(live role {live or 'unknown'})")
        if not health.ok:
            raise BadGateway(f"cannot reinstate {worker.url}: /health answered {health.status or 'nothing'} "
                             f"{health.message()}")
        if worker.state is not WorkerState.FAILED or self.registry.find(worker.id) is not worker:
            raise Conflict(f"worker {worker.id} changed while it was being checked")
        # Never a silent mix of weights: it must carry the version the routable fleet agrees on.
        version = weight_version_of(server.data if server is not None else None)
        fleet = agreed_weight_version([w.weight_version for w in self.registry.workers() if w.routable])
        if (refusal := rejoin_refusal(version, fleet)) is not None:
            raise Conflict(f"cannot reinstate {worker.url}: {refusal}")
        if version is not None:
            self.registry.update_info(worker, weight_version=version)
        role = Role(live)
        port = None
        if role is Role.PREFILL:
            port = bootstrap_port_of(server.data if server is not None else None)
            if port is None and worker.role is Role.PREFILL:
                port = worker.bootstrap_port
        self.registry.move(worker, role, port, WorkerState.ACTIVE, "reinstated by an operator")
        return f"{worker.url} reinstated as {role}" + (f" (bootstrap port {port})" if port is not None else "")

    # ---- shutdown ------------------------------------------------------------------------------------
    def roll_back_unswitched(self) -> list[Conversion]:
        """Cancel the conversions still emptying their worker (drain or abort step): the server has not been
        asked to switch, so its worker simply goes back to its pool. Those switching or verifying go on: the
        server finishes a switch it has started either way, and the flow records where it ended."""
        cancelled = []
        for conversion in self.running():
            task = self._tasks.get(conversion.id)
            if conversion.state in ("drain", "abort") and task is not None and not task.done():
                task.cancel()
                cancelled.append(conversion)
        return cancelled

    async def wait_all(self) -> None:
        """Until no conversion runs."""
        while running := self.running():
            await asyncio.gather(*(c.wait() for c in running))

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
