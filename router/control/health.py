"""Worker health: active probes, passive failure counting, and a circuit breaker per worker.

The decisions are pure functions of (state, observation, config, now) -> new state, with one test per
transition (tests/test_health_rules.py); `HealthMonitor` only applies them:
- probes: every `interval` each worker's health endpoint is asked, with a timeout, one probe in flight per
  worker (a slow worker is never stacked with probes). `failure_threshold` failed probes in a row make a
  worker unhealthy (its first probe failing is enough for a worker that never passed one);
  `success_threshold` passes in a row bring it back. A probe whose worker changed meanwhile (the registry's
  revision moved: state change, role switch, removal) is discarded.
- breaker: the proxy reports every leg's verdict (`Dispatcher.leg_observers`); `failure_threshold` worker faults
  in a row open it (the worker leaves routing), after `timeout` it goes half-open (traffic again), and
  `success_threshold` served legs close it, while one fault re-opens it.
- a worker its probes declare down has the requests still waiting on it (no byte sent to their clients)
  re-routed at once (`Eviction.evict`, dataplane/eviction.py), instead of waiting for the request deadline;
- the monitor's verdict (probes pass, breaker not open) goes to `registry.set_health`; the registry judges
  routability from it with the rest (state, weight version against the fleet's, holds). A worker coming back
  from being unhealthy has its live state read again first (`refresh`: role, bootstrap port, weight version,
  readiness), since it may have been restarted, converted or updated while away.
- servers held out as paused are not probed: a paused 0.5.23 server's /health waits for a generation that
  cannot run, then marks the server unhealthy.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

from aiohttp import web

from router.control.upstream import NoAnswer, Upstream
from router.core.config import BreakerConfig, HealthConfig
from router.core.registry import Registry, Worker, WorkerState
from router.core.routability import HoldKind, rejoin_refusal  # noqa: F401 (rejoin_refusal: importable here too)

logger = logging.getLogger(__name__)

# States in which a flow is talking to the server (switching its role): its answers to probes are the flow's
# business, and a probe would only see a server in transition. (Fleet-wide operations hold admission, and no
# probe runs while the fleet is held.)
UNPROBED_STATES = frozenset({WorkerState.PENDING, WorkerState.CONVERTING, WorkerState.VERIFYING})


# ---- pure rules ------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ProbeState:
    healthy: bool = True
    failures: int = 0  # failed probes in a row
    successes: int = 0  # passed probes in a row while unhealthy
    proven: bool = False  # a probe has passed since the worker was registered


def after_probe(state: ProbeState, ok: bool, config: HealthConfig) -> ProbeState:
    """The probe state after one probe result."""
    if ok:
        if state.healthy:
            return state if state.proven and not state.failures else ProbeState(proven=True)
        successes = state.successes + 1
        if successes >= max(config.success_threshold, 1):
            return ProbeState(proven=True)
        return ProbeState(healthy=False, successes=successes, proven=state.proven)
    failures = state.failures + 1
    if not state.healthy:
        return ProbeState(healthy=False, failures=failures, proven=state.proven)
    if failures >= max(config.failure_threshold, 1) or not state.proven:
        return ProbeState(healthy=False, failures=failures, proven=state.proven)
    return ProbeState(healthy=True, failures=failures, proven=True)


class Phase(str, enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class BreakerState:
    phase: Phase = Phase.CLOSED
    failures: int = 0  # worker faults in a row (closed), within --cb-window-duration-secs of the first
    successes: int = 0  # served legs in a row (half-open)
    opened_at: float = 0.0
    first_failure_at: float = 0.0  # the first of `failures`


CLOSED = BreakerState()


def breaker_after_verdict(state: BreakerState, ok: bool, now: float, config: BreakerConfig) -> BreakerState:
    """The breaker after one leg's verdict (True served, False the worker's fault)."""
    if state.phase is Phase.OPEN:
        return state  # a leg dispatched before the breaker opened: it says nothing new
    if state.phase is Phase.HALF_OPEN:
        if not ok:
            return BreakerState(Phase.OPEN, opened_at=now)
        successes = state.successes + 1
        if successes >= max(config.success_threshold, 1):
            return CLOSED
        return BreakerState(Phase.HALF_OPEN, successes=successes)
    if ok:
        return CLOSED if state.failures else state
    if state.failures and now - state.first_failure_at > config.window_secs:  # the old ones are out of the window
        state = CLOSED
    failures = state.failures + 1
    first = state.first_failure_at if state.failures else now
    if failures >= max(config.failure_threshold, 1):
        return BreakerState(Phase.OPEN, failures=failures, opened_at=now, first_failure_at=first)
    return BreakerState(Phase.CLOSED, failures=failures, first_failure_at=first)


def breaker_after_time(state: BreakerState, now: float, config: BreakerConfig) -> BreakerState:
    """An open breaker goes half-open once its timeout has passed."""
    if state.phase is Phase.OPEN and now - state.opened_at >= config.timeout_secs:
        return BreakerState(Phase.HALF_OPEN)
    return state


def health_verdict(probe: ProbeState, breaker: BreakerState, refusal: str | None) -> tuple[bool, str]:
    """Routable by health, and why not."""
    if not probe.healthy:
        return False, f"{probe.failures} failed health probe(s)" if probe.failures else "health probes failing"
    if breaker.phase is Phase.OPEN:
        return False, f"circuit breaker open after {breaker.failures} failure(s)"
    if refusal is not None:
        return False, refusal
    return True, "half-open: trial traffic" if breaker.phase is Phase.HALF_OPEN else "healthy"


# ---- the monitor ------------------------------------------------------------------------------------------
class WorkerHealth:
    """The monitor's per-worker record (mutable; the rules above produce its states)."""

    __slots__ = ("worker", "probe", "breaker", "epoch", "probe_task", "timer", "probes",
                 "stale_probes", "breaker_opened")

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.probe = ProbeState()
        self.breaker = CLOSED
        self.epoch = 0  # bumped on reset, so that in-flight probes of the old life are discarded
        self.probe_task: asyncio.Task | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.probes = 0
        self.stale_probes = 0
        self.breaker_opened = 0

    @property
    def refusal(self) -> str | None:
        """Why the registry refuses a worker its probes find healthy (its weights differ from the fleet's)."""
        worker = self.worker
        return worker.health_reason if worker.monitor_healthy and not worker.healthy else None

    def to_dict(self) -> dict:
        return {
            "worker_id": self.worker.id, "url": self.worker.url, "healthy": self.worker.healthy,
            "reason": self.worker.health_reason, "probe": {"healthy": self.probe.healthy,
                                                           "failures": self.probe.failures,
                                                           "successes": self.probe.successes},
            "breaker": {"phase": self.breaker.phase.value, "failures": self.breaker.failures,
                        "successes": self.breaker.successes, "opened_total": self.breaker_opened},
            "refusal": self.refusal, "probes_total": self.probes, "stale_probes_total": self.stale_probes,
        }


class HealthMonitor:
    def __init__(self, registry: Registry, upstream: Upstream, health: HealthConfig, breaker: BreakerConfig,
                 *, clock: Callable[[], float] = time.monotonic, is_held: Callable[[], bool] = lambda: False,
                 refresh: Callable[[Worker], Awaitable[object]] | None = None,
                 on_down: list[Callable[[Worker, str], object]] | None = None) -> None:
        self.registry = registry
        # True while a fleet-wide hold (weight update) is on: servers are paused and a real server's /health
        # waits for progress that cannot come, so probes then would only condemn healthy workers.
        self.is_held = is_held
        self.upstream = upstream
        self.health = health
        self.breaker = breaker
        self.clock = clock
        # Reads a server's live state again into the registry (LiveStateReader.refresh): a worker coming back from
        # being unhealthy may have been restarted, converted or updated meanwhile.
        self.refresh = refresh
        self._records: dict[str, WorkerHealth] = {}
        self._loop_task: asyncio.Task | None = None
        self._closed = False
        self.rounds = 0  # probe rounds run (tests wait on it)
        # Called with (worker, reason) when probes declare a worker down: the proxy re-routes the requests
        # still waiting on it (Eviction.evict), which would otherwise wait for the request deadline.
        self.on_down = on_down if on_down is not None else []
        registry.subscribe(self._on_registry_event)

    # ---- lifecycle --------------------------------------------------------------------------------------
    def start(self) -> None:
        for worker in self.registry.workers():
            self._track(worker)
        if self.health.enabled:
            self._loop_task = asyncio.ensure_future(self._run())

    async def close(self) -> None:
        self._closed = True
        tasks = [t for t in (self._loop_task, *(r.probe_task for r in self._records.values())) if t is not None]
        for record in self._records.values():
            if record.timer is not None:
                record.timer.cancel()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _run(self) -> None:
        interval = max(self.health.interval_secs, 0.01)
        while True:
            await asyncio.sleep(interval)
            self.rounds += 1
            for record in list(self._records.values()):
                self._probe_soon(record)

    # ---- registry events --------------------------------------------------------------------------------
    def _track(self, worker: Worker) -> None:
        if worker.id not in self._records:
            self._records[worker.id] = record = WorkerHealth(worker)
            self._probe_soon(record)

    def _on_registry_event(self, event: str, worker: Worker, details: dict) -> None:
        if self._closed:
            return
        if event == "added":
            self._track(worker)
        elif event == "removed":
            record = self._records.pop(worker.id, None)
            if record is not None:
                if record.timer is not None:
                    record.timer.cancel()
                if record.probe_task is not None:
                    record.probe_task.cancel()
        elif event == "moved":
            # A verified role switch: the old role's failure history says nothing about the new one.
            record = self._records.get(worker.id)
            if record is not None:
                self._reset(record, "role switched")
        elif event == "state" and details.get("old") == WorkerState.PENDING.value:
            record = self._records.get(worker.id)
            if record is not None:
                self._probe_soon(record)

    def _reset(self, record: WorkerHealth, reason: str) -> None:
        record.epoch += 1
        record.probe = ProbeState()
        record.breaker = CLOSED
        if record.timer is not None:
            record.timer.cancel()
            record.timer = None
        self._apply(record, reason)

    # ---- applying decisions -----------------------------------------------------------------------------
    def _apply(self, record: WorkerHealth, cause: str = "") -> None:
        healthy, reason = health_verdict(record.probe, record.breaker, None)
        if cause and not healthy:
            reason = f"{reason} ({cause})"
        self.registry.set_health(record.worker, healthy, reason, breaker=record.breaker.phase.value)

    # ---- passive: leg verdicts from the request path (hot: keep the common case to two lookups) ---------
    def on_leg(self, worker: Worker, verdict: bool | None) -> None:
        if verdict is None or not self.breaker.enabled:
            return
        record = self._records.get(worker.id)
        if record is None or record.worker is not worker:
            return
        state = record.breaker
        if verdict and state is CLOSED:
            return
        if worker.state is not WorkerState.ACTIVE:
            return  # draining or converting: failures there are the flow's doing
        new = breaker_after_verdict(state, verdict, self.clock(), self.breaker)
        if new == state:
            return
        record.breaker = new
        if new.phase is not state.phase:
            logger.warning("worker %s %s: circuit breaker %s -> %s", worker.id, worker.url, state.phase, new.phase)
            if new.phase is Phase.OPEN:
                record.breaker_opened += 1
                self._schedule_half_open(record)
            self._apply(record, "request failures" if new.phase is Phase.OPEN else "")

    def _schedule_half_open(self, record: WorkerHealth) -> None:
        if record.timer is not None:
            record.timer.cancel()
        opened = record.breaker
        delay = max(opened.opened_at + self.breaker.timeout_secs - self.clock(), 0.0)
        record.timer = asyncio.get_running_loop().call_later(delay, self._half_open, record, opened)

    def _half_open(self, record: WorkerHealth, opened: BreakerState) -> None:
        record.timer = None
        if record.breaker is not opened or self._records.get(record.worker.id) is not record:
            return
        new = breaker_after_time(opened, self.clock(), self.breaker)
        if new is opened:  # the clock disagrees with the timer (an injected clock): try again later
            self._schedule_half_open(record)
            return
        record.breaker = new
        logger.info("worker %s %s: circuit breaker half-open, trial traffic", record.worker.id, record.worker.url)
        self._apply(record)

    # ---- active probes ----------------------------------------------------------------------------------
    def _probe_soon(self, record: WorkerHealth) -> None:
        worker = record.worker
        if (self._closed or not self.health.enabled or worker.state in UNPROBED_STATES or self.is_held()
                or (worker.hold is not None and worker.hold.kind is HoldKind.PAUSED)
                or (record.probe_task is not None and not record.probe_task.done())):
            return
        record.probe_task = asyncio.ensure_future(self._probe(record))

    async def _probe(self, record: WorkerHealth) -> None:
        worker, epoch, revision = record.worker, record.epoch, record.worker.revision
        reply = await self.upstream.health(worker.url, self.health.endpoint, timeout=self.health.timeout_secs)
        if reply.no_answer is NoAnswer.LOCAL:  # the router could not open a connection: no verdict on the server
            return
        ok = reply.ok
        record.probes += 1
        if not self._current(record, epoch, revision) or self.is_held():
            record.stale_probes += 1
            return
        before = record.probe
        record.probe = after_probe(before, ok, self.health)
        if not ok and before.healthy and record.probe.healthy:
            logger.info("worker %s %s: health probe failed (%d/%d): %s", worker.id, worker.url,
                        record.probe.failures, self.health.failure_threshold, reply.message() or reply.status)
        if record.probe.healthy and (not before.healthy or record.refusal is not None) and self.refresh is not None:
            await self.refresh(worker)  # its role, port and weights as the server has them now
            if not self._current(record, epoch, None):
                record.stale_probes += 1
                return
        if record.probe.healthy is not before.healthy:
            cause = "" if ok else (reply.message() or f"HTTP {reply.status}")
            self._apply(record, cause[:200])
            if before.healthy and not record.probe.healthy:
                for callback in self.on_down:
                    callback(worker, worker.health_reason)

    def _current(self, record: WorkerHealth, epoch: int, revision: int | None) -> bool:
        worker = record.worker
        return (not self._closed and record.epoch == epoch and self._records.get(worker.id) is record
                and (revision is None or worker.revision == revision))

    # ---- views ------------------------------------------------------------------------------------------
    def state(self) -> dict:
        return {"probes": {"enabled": self.health.enabled, "interval_secs": self.health.interval_secs,
                           "timeout_secs": self.health.timeout_secs, "endpoint": self.health.endpoint},
                "breaker": {"enabled": self.breaker.enabled, "failure_threshold": self.breaker.failure_threshold,
                            "success_threshold": self.breaker.success_threshold,
                            "timeout_secs": self.breaker.timeout_secs},
                "workers": [r.to_dict() for r in self._records.values()]}

    def record(self, worker: Worker) -> WorkerHealth | None:
        return self._records.get(worker.id)


HEALTH = web.AppKey("health", HealthMonitor)
