"""The rebalancer's outer loop: observe the fleet, ask `policies.rebalance.decide`, then apply or advise.

Every interval it builds an observation from the registry (routable workers per pool, the router's in-flight
counts, the servers' last load reports) and from the latencies the router measured (TTFT and inter-token
latency of the requests that finished in the window), and calls the pure decision core. In advisory mode
(the default) a proposal is only recorded and logged as "would convert X"; in enabled mode it is handed to
the conversion flow through the `Converter` interface, one at a time. Every decision, refusals included, is
kept (the last `history`) with its reason and the guards that fired, for `GET /admin/rebalancer`.

The conversion flow owns its deadlines (drain, switch, verify): the loop never cancels a conversion half
way, it waits for the flow's outcome and starts the cooldown (or the failure cooldown) from its end.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Awaitable, Callable, Protocol

from policies.rebalance import (
    Decision,
    RebalanceMode,
    Observation,
    RebalanceConfig,
    WorkerView,
    conversion_ended,
    decide,
    initial_state,
)
from router.core.errors import Conflict, ServiceUnavailable
from router.core.registry import Registry, Role, Worker, WorkerState
from router.core.records import RequestRecord
from router.flows.conversion import Conversions
from router.flows.conversion_record import DrainMode, Plan

logger = logging.getLogger(__name__)

# Worker states that mean "a conversion (ours or an operator's) is under way".
CONVERTING_STATES = frozenset({WorkerState.DRAINING, WorkerState.ABORTING, WorkerState.CONVERTING,
                               WorkerState.VERIFYING})


@dataclass(frozen=True, slots=True)
class ConversionResult:
    ok: bool
    detail: str = ""
    conversion_id: str | None = None  # the conversion flow's record (GET /admin/conversions/{id})


class Converter(Protocol):
    """What the rebalancer needs from the conversion flow."""

    async def convert(self, worker: Worker, to_role: Role, *, reason: str, mode: str) -> ConversionResult: ...


class FlowConverter:
    """The Converter on top of the conversion flow (router/flows/conversion.py)."""

    def __init__(self, conversions: Conversions) -> None:
        self.conversions = conversions

    async def convert(self, worker: Worker, to_role: Role, *, reason: str, mode: str) -> ConversionResult:
        try:
            conversion = await self.conversions.begin(worker, Plan(mode=DrainMode(mode), new_role=to_role))
        except (Conflict, ServiceUnavailable) as refusal:
            return ConversionResult(False, f"refused: {refusal.message}")
        if conversion is None:
            return ConversionResult(True, f"{worker.id} already is {to_role}")
        conversion.notes.append(reason)
        await conversion.wait()
        return ConversionResult(conversion.success, f"{conversion.outcome}: {conversion.message}", conversion.id)


def p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[max(0, -(-len(ordered) * 9 // 10) - 1)]


class LatencyWindow:
    """TTFT and inter-token latency of the requests that finished recently (a request observer: O(1) each)."""

    def __init__(self, window_secs: float, clock: Callable[[], float], max_samples: int = 8192) -> None:
        self.window_secs = window_secs
        self.clock = clock
        self._samples: deque[tuple[float, float | None, float | None]] = deque(maxlen=max_samples)

    def observe(self, record: RequestRecord) -> None:
        if record.outcome != "success" or (record.ttft_s is None and record.itl_s is None):
            return
        self._samples.append((self.clock(), record.ttft_s, record.itl_s))

    def summary(self, now: float, min_samples: int) -> tuple[float | None, float | None, int]:
        """(p90 TTFT, p90 ITL, samples) of the window; a figure under min_samples is None."""
        horizon = now - self.window_secs
        while self._samples and self._samples[0][0] < horizon:
            self._samples.popleft()
        ttfts = [t for _, t, _ in self._samples if t is not None]
        itls = [i for _, _, i in self._samples if i is not None]
        return (p90(ttfts) if len(ttfts) >= min_samples else None,
                p90(itls) if len(itls) >= min_samples else None,
                len(self._samples))


class Rebalancer:
    def __init__(self, registry: Registry, config: RebalanceConfig, *, converter: Converter | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 spawn: Callable[[Awaitable], asyncio.Task] = asyncio.ensure_future,
                 convertible: Callable[[Worker], bool] = lambda worker: True,
                 leading: Callable[[], bool] = lambda: True) -> None:
        self.registry = registry
        # Router replicas of one fleet: only the one that leads decides (one rebalancer at a time).
        self.leading = leading
        self.config = config
        self.converter = converter
        self.convertible = convertible
        self.clock = clock
        self.spawn = spawn
        self.window = LatencyWindow(config.window_secs, clock)
        self.state = initial_state(clock())
        self.decisions: deque[dict] = deque(maxlen=config.history)
        self.conversions: deque[dict] = deque(maxlen=config.history)
        self.counters: Counter[str] = Counter()
        self.last_observation: dict | None = None
        self.applying: dict | None = None
        self._task: asyncio.Task | None = None
        # Called with (event, details) for every decision and conversion outcome (metrics, audit).
        self.listeners: list[Callable[[str, dict], None]] = []

    # ---- observe -------------------------------------------------------------------------------------
    def _view(self, worker: Worker) -> WorkerView:
        load = worker.server_load
        return WorkerView(id=worker.id, inflight=worker.inflight,
                          running=load.running if load else None, waiting=load.waiting if load else None,
                          kv_usage=load.token_usage if load else None, convertible=self.convertible(worker))

    def observe(self) -> Observation:
        now = self.clock()
        ttft, itl, samples = self.window.summary(now, self.config.min_samples)
        busy = None
        if self.applying is not None:
            busy = f"{self.applying['worker_id']} converting to {self.applying['to_role']}"
        else:
            moving = [w for w in self.registry.workers() if w.state in CONVERTING_STATES]
            if moving:
                busy = ", ".join(f"{w.id} {w.state}" for w in moving)
        return Observation(now=now,
                           prefill=tuple(self._view(w) for w in self.registry.routable(Role.PREFILL)),
                           decode=tuple(self._view(w) for w in self.registry.routable(Role.DECODE)),
                           ttft_s=ttft, itl_s=itl, samples=samples, busy=busy)

    # ---- decide ----------------------------------------------------------------------------------------
    def tick(self) -> Decision | None:
        """One observation and decision; applies or records it. None when the rebalancer is off."""
        if self.config.mode is RebalanceMode.OFF:
            return None
        if not self.leading():
            self.counters["ticks_not_leading"] += 1
            return None
        obs = self.observe()
        decision = decide(obs, self.state, self.config)
        self.state = decision.state
        self.last_observation = {"at": obs.now, "ttft_p90_s": obs.ttft_s, "itl_p90_s": obs.itl_s,
                                 "samples": obs.samples, "busy": obs.busy}
        entry = decision.to_dict()
        entry["mode"] = self.config.mode.value
        self.counters[f"decisions_{decision.action}"] += 1
        for guard in decision.guards:
            self.counters[f"guard_{guard}"] += 1
        if decision.convert:
            entry["applied"] = self._act(decision)
        else:
            self._log_hold(decision)
        self.decisions.append(entry)
        self._emit("decision", entry)
        return decision

    def _act(self, decision: Decision) -> str:
        worker = self.registry.find(decision.worker_id)
        if self.config.mode is RebalanceMode.ADVISORY:
            self.counters["would_convert"] += 1
            logger.info("rebalancer (advisory) would convert %s %s -> %s: %s", decision.worker_id,
                        decision.from_role, decision.to_role, decision.reason)
            return "advisory"
        if self.converter is None or worker is None:
            why = "no conversion flow is available" if self.converter is None else "the worker is gone"
            logger.warning("rebalancer cannot convert %s: %s", decision.worker_id, why)
            self.counters["conversions_failed"] += 1
            self.state = conversion_ended(self.state, self.clock(), ok=False)
            return f"not applied: {why}"
        self.counters["conversions_started"] += 1
        self.applying = {"worker_id": worker.id, "url": worker.url, "from_role": decision.from_role,
                         "to_role": decision.to_role, "started_at": self.clock(), "reason": decision.reason}
        logger.warning("rebalancer converts %s %s -> %s: %s", worker.id, decision.from_role, decision.to_role,
                       decision.reason)
        self._task = self.spawn(self._apply(worker, Role(decision.to_role), decision.reason))
        return "started"

    async def _apply(self, worker: Worker, to_role: Role, reason: str) -> None:
        record = dict(self.applying or {})
        try:
            result = await self.converter.convert(worker, to_role, reason=f"rebalancer: {reason}",
                                                  mode=self.config.conversion_mode)
        except asyncio.CancelledError:
            result = ConversionResult(False, "cancelled (router shutting down)")
            raise
        except Exception as exc:  # the flow failed unexpectedly: the rebalancer must survive it
            logger.exception("conversion of %s failed", worker.url)
            result = ConversionResult(False, f"{type(exc).__name__}: {exc}")
        finally:
            now = self.clock()
            self.applying = None
            self.state = conversion_ended(self.state, now, ok=result.ok)
            self.counters["conversions_succeeded" if result.ok else "conversions_failed"] += 1
            record.update(ended_at=now, ok=result.ok, detail=result.detail, conversion_id=result.conversion_id)
            self.conversions.append(record)
            self._emit("conversion", record)
            (logger.info if result.ok else logger.warning)("rebalancer conversion of %s to %s %s: %s", worker.id,
                                                           to_role, "succeeded" if result.ok else "failed",
                                                           result.detail or "-")

    def _log_hold(self, decision: Decision) -> None:
        previous = self.decisions[-1] if self.decisions else None
        changed = previous is None or tuple(previous["guards"]) != decision.guards
        quiet = decision.guards in (("deadband",), ("no_signal",))
        (logger.info if changed and not quiet else logger.debug)("rebalancer holds: %s", decision.reason)

    def _emit(self, event: str, details: dict) -> None:
        for listener in self.listeners:
            try:
                listener(event, details)
            except Exception:
                logger.exception("rebalancer listener failed on %s", event)

    # ---- control ---------------------------------------------------------------------------------------
    def reconfigure(self, changes: dict) -> RebalanceConfig:
        """Apply validated changes (raises UnknownFields / ValueError); the history is kept."""
        config = self.config.with_changes(changes)
        if config.history != self.config.history:
            self.decisions = deque(self.decisions, maxlen=config.history)
            self.conversions = deque(self.conversions, maxlen=config.history)
        self.window.window_secs = config.window_secs
        if self.config.mode is RebalanceMode.OFF and config.mode is not RebalanceMode.OFF:
            self.state = initial_state(self.clock())  # observing again: warm up again
        logger.info("rebalancer reconfigured: %s", changes)
        self.config = config
        return config

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.config.interval_secs)
            try:
                self.tick()
            except Exception:  # a bug in one tick must not stop the loop
                logger.exception("rebalancer tick failed")

    def snapshot(self, limit: int = 50) -> dict:
        return {
            "mode": self.config.mode.value,
            "config": self.config.to_dict(),
            "state": {
                "streak": self.state.streak,
                "streak_direction": self.state.streak_direction,
                "last_conversion_age_secs": _age(self.clock(), self.state.last_conversion_at),
                "last_failure_age_secs": _age(self.clock(), self.state.last_failure_at),
                "conversions_decided": self.state.conversions,
            },
            "counters": dict(self.counters),
            "applying": self.applying,
            "last_observation": self.last_observation,
            "decisions": list(self.decisions)[-limit:] if limit else [],
            "conversions": list(self.conversions)[-limit:] if limit else [],
        }


def _age(now: float, then: float | None) -> float | None:
    return None if then is None else round(now - then, 3)
