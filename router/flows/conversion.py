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
requests when `retry_aborted` is on), or, in `shed` mode, for the same once the requests that still wait on
their prefill (nothing of them decoded, their clients have seen nothing) were aborted on both their servers and
re-sent elsewhere: a decode moved to a backlogged prefill pool need not wait on the backlog it is to relieve.
The worker joins the other pool only after the server's live role has been read back and its bootstrap port
learnt: a switch that answered success without changing the role is a failure.

This module is the state machine; the calls to the server (its two switch APIs, reading its role back) are
in `role_switch.py`, the plan and the record in `conversion_record.py`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
from typing import Any, Awaitable, Callable, TypeVar

from aiohttp import web

from router.control.live_state import rejoin_check
from router.control.upstream import Upstream
from router.core.coordination import OperationCoordinator, StopAction, Ticket, worker_scope
from router.core.errors import Conflict, RouterError, ServiceUnavailable
from router.core.reabort import abort_until_ended
from router.core.registry import Registry, Role, Worker, WorkerState
from router.core.traffic import RequestPathControl
from router.flows.conversion_record import Conversion, ConversionBook, ConversionOutcome, DrainMode, Plan
from router.flows.fleet import Quiet, wait_quiet
from router.flows.ownership import Owned
from router.flows.conversion_recovery import recover_conversion
from router.flows.role_switch import RoleSwitch
from router.flows.steps import Step, StepFailed, run_step

logger = logging.getLogger(__name__)
T = TypeVar("T")

VERIFY_TIMEOUT_SECS = 15.0
HISTORY_SIZE = 100


def _positive(value: float | None, default: float) -> float:
    return value if value is not None and value > 0 else default


class Conversions:
    """Runs conversions (one per worker at a time) and keeps their bounded history."""

    def __init__(self, registry: Registry, upstream: Upstream, spawn: Callable[[Awaitable], asyncio.Task], *,
                 drain_timeout_s: float = 300.0, switch_timeout_s: float = 120.0,
                 verify_timeout_s: float = VERIFY_TIMEOUT_SECS, history_size: int = HISTORY_SIZE,
                 fleet_busy: Callable[[], str | None] = lambda: None,
                 coordinator: OperationCoordinator, traffic: RequestPathControl,
                 observers: list[Callable[[str, Conversion, dict], None]] | None = None) -> None:
        self.registry = registry
        self.upstream = upstream
        self.server = RoleSwitch(registry, upstream)  # the calls to the server being converted
        self.spawn = spawn
        self.drain_timeout_s = drain_timeout_s
        self.switch_timeout_s = switch_timeout_s
        self.verify_timeout_s = verify_timeout_s
        # Why a fleet-wide operation (a weight update's hold) forbids starting a conversion now, or None.
        self.fleet_busy = fleet_busy
        # The other router replicas of the fleet (a lone router's does nothing): `begin` takes the worker for
        # this conversion across all of them, and every replica stops routing to it before it drains.
        self.coordinator = coordinator
        self.traffic = traffic  # the request path's live requests: `shed` mode re-sends some of them
        self._ids = itertools.count(1)
        self.book = ConversionBook(history_size)  # what runs now and the last ones
        # (event, conversion, details): "finished" once per conversion (refusals included); "abort_all" once
        # its abort step ends, with `inflight` = the router's requests it aborted and `aborts` = abort_all sent
        self.observers = observers if observers is not None else []

    # ---- reads -------------------------------------------------------------------------------------
    def running(self) -> list[Conversion]:
        return self.book.running()

    def history(self) -> list[Conversion]:
        """Newest first, running ones included."""
        return self.book.history()

    def get(self, conversion_id: str) -> Conversion | None:
        return self.book.get(conversion_id)

    def of_worker(self, worker: Worker) -> Conversion | None:
        return self.book.of_worker(worker.id)

    async def recover(self, ticket: Ticket, record: dict) -> tuple[str, str]:
        """A conversion whose router replica died, recovered from its record (`core/recovery.py`)."""
        return await recover_conversion(self.registry, self.upstream, self.server, ticket, record,
                                        default_switch_s=self.switch_timeout_s)

    # ---- start -------------------------------------------------------------------------------------
    async def begin(self, worker: Worker, plan: Plan) -> Conversion | None:
        """`start`, once the coordinator gave this conversion its worker: one conversion of a worker across
        every router replica, and none while a fleet-wide operation runs (Conflict), none while the replicas
        cannot agree (ServiceUnavailable). A lone router's coordinator gives it at once."""
        new_role = plan.new_role or worker.role.opposite
        refusal = self._busy(worker)
        if refusal is None and new_role is worker.role:
            return None
        if refusal is not None or not self.coordinator.clustered:
            return self.start(worker, plan)  # refused here already, or nobody to agree with
        details = {"worker_url": worker.url, "worker_id": worker.id, "old_role": worker.role.value,
                   "new_role": new_role.value, "mode": plan.mode.value,
                   "switch_timeout_s": _positive(plan.switch_timeout_s, self.switch_timeout_s)}
        try:
            owned = await Owned.acquire(self.coordinator, "conversion", worker_scope(worker.url), details)
        except RouterError as error:
            conversion = Conversion(id=f"c{next(self._ids)}", worker_id=worker.id, worker_url=worker.url,
                                    old_role=worker.role, new_role=new_role, mode=plan.mode)
            self._refuse(conversion, error.message, error.status)
            raise
        try:
            conversion = self.start(worker, plan, owned)
        except BaseException as exc:
            await owned.release("refused", str(exc))
            raise
        if conversion is None:
            await owned.release("unchanged")
        return conversion

    def start(self, worker: Worker, plan: Plan, owned: Owned | None = None) -> Conversion | None:
        """Check, take the worker out of routing and run the flow in the background.

        Returns None when the worker already has the asked role (nothing to do). Raises Conflict, after
        recording the refusal, when the conversion must not start. Everything up to taking the worker out of
        routing happens without awaiting, so two concurrent calls cannot both pass the checks. `owned`: the
        worker's conversion across the router replicas (`begin`); none: nobody else to agree with."""
        new_role = plan.new_role or worker.role.opposite
        refusal = self._busy(worker)
        if refusal is None and new_role is worker.role:
            return None
        conversion = Conversion(id=f"c{next(self._ids)}", worker_id=worker.id, worker_url=worker.url,
                                old_role=worker.role, new_role=new_role, mode=plan.mode)
        refusal = refusal or self._dp_refusal(worker) or self.fleet_busy() or self._last_of_pool(worker)
        if refusal is not None:
            self._refuse(conversion, refusal, 409)
            raise Conflict(refusal, conversion_id=conversion.id)
        self.book.started(conversion)
        if plan.mode is DrainMode.DRAIN:
            self._set(worker, conversion, WorkerState.DRAINING, "drain", "no new requests; in-flight ones finish")
        elif plan.mode is DrainMode.SHED:
            self._set(worker, conversion, WorkerState.DRAINING, "drain", "no new requests; those still waiting on "
                                                                       "their prefill are re-sent, the rest finish")
        else:
            self._set(worker, conversion, WorkerState.ABORTING, "abort", "aborting its requests")
        logger.info("conversion %s: %s %s -> %s (%s mode) started", conversion.id, worker.url, worker.role,
                    new_role, plan.mode)
        task = self.spawn(self._run(conversion, worker, plan, owned or Owned.alone(self.coordinator)))
        self.book.runs_in(conversion, task)
        return conversion

    def _refuse(self, conversion: Conversion, refusal: str, status: int) -> None:
        self._finish(conversion, ConversionOutcome.REFUSED, refusal, status)
        conversion.settled.set()
        self.book.remember(conversion)
        # a 503 (the replicas cannot agree now: etcd) is logged where it is answered
        logger.log(logging.INFO if status == 503 else logging.WARNING, "conversion %s of %s refused: %s",
                   conversion.id, conversion.worker_url, refusal)

    def _busy(self, worker: Worker) -> str | None:
        if self.registry.find(worker.id) is not worker:
            return f"worker {worker.id} is no longer registered"
        running = self.book.of_worker(worker.id)
        if running is not None:
            return (f"worker {worker.id} ({worker.url}) is already being converted by {running.id} "
                    f"(step {running.state}); one conversion per worker at a time")
        if worker.state is not WorkerState.ACTIVE:
            return (f"worker {worker.id} ({worker.url}) is {worker.state} ({worker.state_reason or '-'}): only an "
                    f"active worker can be converted")
        return None

    @staticmethod
    def _dp_refusal(worker: Worker) -> str | None:
        """What SGLang 0.5.23 would answer for this attention-DP server's switch, said before draining it."""
        if worker.dp_switch_refusal is None:
            return None
        return f"worker {worker.id} ({worker.url}) cannot switch roles: {worker.dp_switch_refusal}"

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

    def _set(self, worker: Worker, conversion: Conversion, state: WorkerState, step: str, detail: str) -> None:
        conversion.state = step
        self.registry.set_state(worker, state, f"conversion {conversion.id} {conversion.old_role}->"
                                               f"{conversion.new_role} ({conversion.mode}): {detail}")

    # ---- the flow ----------------------------------------------------------------------------------
    async def _run(self, conversion: Conversion, worker: Worker, plan: Plan, owned: Owned) -> None:
        switch_called = False
        try:
            try:
                empty_timeout = _positive(plan.empty_timeout_s, self.drain_timeout_s)
                if plan.mode is not DrainMode.ABORT:
                    action = StopAction.SHED if plan.mode is DrainMode.SHED else StopAction.ROUTING
                    await self._step(conversion, "drain", empty_timeout,
                                     lambda s: self._while_owned(owned, self._drain(owned, worker, s, action)),
                                     on_timeout=lambda s: self._empty_timeout(worker, s, "drain"))
                else:
                    await self._step(conversion, "abort", empty_timeout,
                                     lambda s: self._while_owned(owned, self._abort(conversion, owned, worker, s)),
                                     on_timeout=lambda s: self._empty_timeout(worker, s, "abort"))
                # another replica taking it over knows from here on
                await self._while_owned(owned, owned.progress("switch"))
                self._set(worker, conversion, WorkerState.CONVERTING, "switch", "the server is switching role")
                switch_called = True
                answer = await self._step(
                    conversion, "switch", _positive(plan.switch_timeout_s, self.switch_timeout_s),
                    lambda s: self.server.switch(conversion, worker, plan, s),
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
                    conversion, "verify", verify_timeout,
                    lambda s: self.server.verify(conversion, worker, answer, s, seen),
                    on_timeout=lambda s: self.server.verify_timeout(conversion, s, seen))
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
            self.book.ended(conversion)
            if not conversion.done.is_set():  # defensive: every path above finishes the record
                self._finish(conversion, ConversionOutcome.FAILED, "conversion ended without an outcome", 500)
            # its outcome shared before anyone hears it (shielded: a shutdown waits)
            await owned.release(str(conversion.outcome), conversion.message)
            conversion.settled.set()

    async def _step(self, conversion: Conversion, name: str, deadline_s: float,
                    body: Callable[[Step], Awaitable[Any]], *, on_timeout: Callable[[Step], StepFailed]) -> Any:
        step = Step(name, deadline_s)
        conversion.steps.append(step)
        conversion.state = name
        try:
            return await run_step(step, body, on_timeout)
        finally:
            if step.outcome in ("ok", "failed", "timeout"):  # not a shutdown, nor a bug (logged by _run)
                self._log_step(conversion, step)

    @staticmethod
    def _log_step(conversion: Conversion, step: Step) -> None:
        level = logging.INFO if step.outcome == "ok" else logging.WARNING
        logger.log(level, "conversion %s step %s: %s in %.3f s%s", conversion.id, step.name, step.outcome,
                   step.duration_s or 0.0, f" ({step.message})" if step.message else "")

    # ---- emptying the worker -----------------------------------------------------------------------
    async def _drain(self, owned: Owned, worker: Worker, step: Step, action: StopAction) -> None:
        """Every replica, this one first, stops routing to the worker; with SHED each also marks its requests on
        it that still wait on their prefill to be re-sent and aborts them on both their servers (the prefill
        drops them from its queues). This one's are aborted again while they have not ended (an abort can reach
        a server before the request does). Then the wait for the rest."""
        report = await owned.stop_routing([worker], action)
        if action is StopAction.SHED:
            step.details["resent"] = report.marked
        here = list(report.here)
        resending = self.spawn(abort_until_ended(lambda: self.traffic.still_live(here), self.traffic.abort,
                                                 math.inf)) if here else None
        try:
            await self._wait_quiet(owned, worker, step, abort=False)
        finally:
            if resending is not None:
                resending.cancel()

    @staticmethod
    async def _while_owned(owned: Owned, work: Awaitable[T]) -> T:
        """The steps before the switch, ended the moment this replica stops owning the conversion (its lease
        ended) or the replicas cannot confirm what it asks of them: nothing was asked of the server yet, so
        that is a safe failure (503, naming why)."""
        try:
            return await owned.run(work)
        except ServiceUnavailable as exc:
            raise StepFailed(exc.message, safe=True, status=503) from None

    async def _abort(self, conversion: Conversion, owned: Owned, worker: Worker, step: Step) -> None:
        # Marked first (the abort epochs): a request aborted by these calls is recognisable as router-aborted.
        # The router's requests on the worker are counted once: it is out of routing, so a later round finds
        # the same requests (still ending), not new ones.
        stopped = (await owned.stop_routing([worker], StopAction.EPOCH)).marked
        try:
            await self._wait_quiet(owned, worker, step, abort=True)
        finally:
            self._notify("abort_all", conversion, inflight=stopped, aborts=step.attempts)

    async def _wait_quiet(self, owned: Owned, worker: Worker, step: Step, *, abort: bool) -> None:
        """The fleet's idle wait on this one server (`wait_quiet`): no replica has a request on it, then the
        server reports nothing running, waiting or queued; with `abort`, abort_all sent and sent again while
        it is busy. The step's deadline (`run_step`) bounds it; what is still busy is on the step meanwhile."""
        def watch(progress: Quiet) -> None:
            step.attempts = progress.aborts_sent
            step.message = _busy_message(progress.busy[0]) if progress.busy else ""

        quiet = await wait_quiet(self.registry, self.upstream, [worker], math.inf, abort=abort,
                                 elsewhere=owned.inflight_elsewhere, watch=watch)
        step.attempts = quiet.aborts_sent
        step.details.update(router_idle_s=round(quiet.router_idle_s or 0.0, 6), server_polls=quiet.server_polls,
                            server_idle_after_s=round(quiet.duration_s - (quiet.router_idle_s or 0.0), 6))
        how = f"abort_all sent {quiet.aborts_sent} times; " if abort else ""
        step.message = how + ("the server reports no load: relied on the router's in-flight count" if quiet.silent
                              else "idle on the router and the server")

    def _empty_timeout(self, worker: Worker, step: Step, what: str) -> StepFailed:
        detail = step.message or "not idle"
        if worker.inflight:
            detail = f"{worker.inflight} requests still in flight on the router"
        return StepFailed(f"{what} deadline ({step.deadline_s:g} s) exceeded: {detail}", safe=True, status=504)

    async def _recover(self, conversion: Conversion, worker: Worker, failure: StepFailed, *,
                       may_resume: bool) -> bool:
        """After a failed step: True if the server did switch after all (go on verifying), else end the flow,
        in the old pool when the server is known unchanged, else `failed`."""
        safe, message = failure.safe, failure.message
        if safe is None:
            # Unknown: nothing changed only if the server still reports its old role and is healthy.
            live, _ = await self.server.live_role(worker)
            if may_resume and live == conversion.new_role.value:
                conversion.notes.append(f"{message}; but the server reports role {live}: verifying")
                logger.warning("conversion %s: %s, yet the server reports the new role", conversion.id, message)
                return True
            safe, seen = await self.server.unchanged(worker.url, conversion.old_role, live)
            message += f"; {seen}"
        self._end_failed(conversion, worker, StepFailed(message, safe=safe, status=failure.status), safe)
        return False

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
        """Put a `failed` worker back into routing in the role its server reports now, once it is healthy,
        ready and on the fleet's weights (`discovery.rejoin_check`: never a silent mix of weights)."""
        if worker.state is not WorkerState.FAILED:
            raise Conflict(f"worker {worker.id} is {worker.state}, not failed: nothing to reinstate")
        async with await Owned.acquire(self.coordinator, "reinstate", worker_scope(worker.url),
                                       {"worker_url": worker.url}) as owned:
            message = await owned.run(self._reinstate(worker, timeout))
            owned.ended("reinstated", message)
            return message

    async def _reinstate(self, worker: Worker, timeout: float) -> str:
        live = await rejoin_check(self.registry, self.upstream, worker, what="reinstate", timeout=timeout)
        if worker.state is not WorkerState.FAILED or self.registry.find(worker.id) is not worker:
            raise Conflict(f"worker {worker.id} changed while it was being checked")
        if live.weight_version is not None:
            self.registry.update_info(worker, weight_version=live.weight_version)
        role = live.role
        port = None
        if role is Role.PREFILL:
            port = live.bootstrap_port
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
            task = self.book.task_of(conversion)
            if conversion.state in ("drain", "abort") and task is not None and not task.done():
                task.cancel()
                cancelled.append(conversion)
        return cancelled

    async def wait_all(self) -> None:
        """Until no conversion runs."""
        while running := self.running():
            await asyncio.gather(*(c.wait() for c in running))

    async def close(self) -> None:
        tasks = self.book.tasks()
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)


CONVERSIONS = web.AppKey("conversions", Conversions)


def _busy_message(busy: dict) -> str:
    """What keeps the server from being idle, as `wait_quiet` found it."""
    if busy.get("router_inflight"):
        return f"{busy['router_inflight']} requests in flight on the router"
    if busy.get("other_replicas_inflight"):
        return f"{busy['other_replicas_inflight']} requests in flight on other router replicas"
    return (f"the server reports {busy.get('running')} running, {busy.get('waiting')} waiting and "
            f"{busy.get('pd_queues')} in its PD queues")
