"""The rebalancer's outer loop: observe the fleet, ask `policies.rebalance.decide`, then apply or advise.

Every interval it builds an observation from the registry (routable workers per pool, the router's counts of
requests sent to and open on each, the servers' last load reports: their PD queues, forward time, decode
tokens and step lines) and from what the router read of the requests that ended (`latency_window.py`: their
sizes, and the TTFT and inter-token latency shown), and calls the pure decision core, which fits its fleet
model and chooses a split. In advisory mode (the default) a proposal is only recorded and logged as "would
convert X"; in enabled mode each server it names (several at once when the model says so) is handed to the
conversion flow through the `Converter` interface; a server of ours in progress is out of its pool for the
decision from the moment it is handed over, and counted as arriving in its new one. Every decision, refusals
included, is kept (the last `history`) with its reason, the guards that fired and the model's reading (each
candidate split's predicted attainment and cost), for `GET /admin/rebalancer`.

Refilling an empty pool (`decide`'s first rule) is on whenever the rebalancer is enabled, and alone with
`refill_empty_pool` (`--rebalance-refill-empty-pool`): then the loop runs in any mode, and acts on refills only.
It does not wait for the interval: a registry change that leaves a pool without a routable server runs a
refill decision at once.

The conversion flow owns its deadlines (drain, switch, verify): the loop never cancels a conversion half
way, it waits for the flow's outcome, and tells the decision core its duration (what the next move that way is
charged) or its failure (the failure cooldown runs from its end). Router
replicas of one fleet: only the leader decides.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Awaitable, Callable, Protocol

from aiohttp import web

from policies.rebalance import (
    Decision,
    Observation,
    RebalanceConfig,
    RebalanceMode,
    WorkerView,
    conversion_ended,
    decide,
    initial_state,
    refill,
)
from router.core.errors import Conflict, ServiceUnavailable
from router.core.registry import Registry, Role, Worker, WorkerState
from router.flows.conversion import Conversions
from router.flows.conversion_record import DrainMode, Plan
from router.flows.latency_window import LatencyWindow, p90

logger = logging.getLogger(__name__)

__all__ = ["CONVERTING_STATES", "ConversionResult", "Converter", "FlowConverter", "LatencyWindow", "Rebalancer",
           "p90"]

# Worker states that mean "a conversion (ours or an operator's) is under way".
CONVERTING_STATES = frozenset({WorkerState.DRAINING, WorkerState.ABORTING, WorkerState.CONVERTING,
                               WorkerState.VERIFYING})
# Registry events after which a pool may have lost its last routable server.
_POOL_EVENTS = frozenset({"routable", "removed", "moved", "added"})


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

    def target_of(self, worker: Worker) -> Role | None:
        """The role a conversion in progress moves `worker` into (None: none runs)."""
        conversion = self.conversions.of_worker(worker)
        return conversion.new_role if conversion is not None else None

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
        self.convertible = convertible  # an extra say on top of health, breaker and recent failures
        self.clock = clock
        self.spawn = spawn
        self.window = LatencyWindow(config.window_secs, clock)
        self.state = initial_state(clock())
        self.decisions: deque[dict] = deque(maxlen=config.history)
        self.conversions: deque[dict] = deque(maxlen=config.history)
        # every observation a decision was made on, the last `history` of them: replayed through the decision
        # core with the conversions' ends (bench/replay.py), they give the same decisions (`recording`)
        self.observations: deque[Observation] = deque(maxlen=config.history)
        self.counters: Counter[str] = Counter()
        self.last_observation: dict | None = None
        self.last_refill: dict | None = None
        self._applying: dict[str, dict] = {}  # worker id -> our conversion in progress (in the order started)
        self._failed_at: dict[str, float] = {}  # worker id -> when a conversion of it failed
        self._refill_pending = False
        # Called with (event, details) for every decision and conversion outcome (metrics, audit).
        self.listeners: list[Callable[[str, dict], None]] = []
        registry.subscribe(self._on_registry_event)

    # ---- observe -------------------------------------------------------------------------------------
    def can_convert(self, worker: Worker) -> bool:
        """Never a server a health verdict or a breaker doubts, nor one whose conversion failed lately."""
        if not worker.healthy or worker.breaker != "closed":
            return False
        failed_at = self._failed_at.get(worker.id)
        if failed_at is not None and self.clock() - failed_at < self.config.failure_cooldown_secs:
            return False
        return self.convertible(worker)

    def _view(self, worker: Worker) -> WorkerView:
        load = worker.server_load
        if load is None:
            return WorkerView(id=worker.id, inflight=worker.inflight, convertible=self.can_convert(worker),
                              started=worker.requests_total)
        r = load.report
        return WorkerView(
            id=worker.id, inflight=worker.inflight, started=worker.requests_total, running=load.running,
            max_running=r.running_window if r else None,
            waiting=load.waiting,
            convertible=self.can_convert(worker),
            waiting_queue=r.waiting_queue if r else None, bootstrap=r.bootstrap if r else None,
            inflight_queue=r.inflight if r else None, prealloc=r.prealloc if r else None,
            prealloc_ready=r.prealloc_ready if r else None, transfer=r.transfer if r else None,
            retracted=r.retracted if r else None,
            used_tokens=r.used_tokens if r else None,
            row_age_s=r.age_s if r else None,
            decode_step_s=load.decode_step_s,
            decode_step_fixed_s=load.decode_step_fixed_s, decode_step_per_request_s=load.decode_step_per_request_s,
            busy_total_s=r.prefill_busy_us / 1e6 if r is not None and r.prefill_busy_us is not None else None,
            tokens_total=_tokens_decoded(r))

    @property
    def applying(self) -> dict | None:
        """The oldest of our conversions in progress (None: none runs)."""
        return next(iter(self._applying.values()), None)

    def _moving(self) -> tuple[str | None, tuple[str, ...], tuple[str, ...], str | None]:
        """What conversions are under way, into which roles, the roles ours move servers into (one per
        conversion), and the ones that are not ours (an operator's)."""
        into: set[str] = set()
        described, others = [], []
        for record in self._applying.values():
            into.add(record["to_role"])
            described.append(f"{record['worker_id']} converting to {record['to_role']}")
        target_of = getattr(self.converter, "target_of", None)
        for worker in self.registry.workers():
            if worker.state in CONVERTING_STATES:
                target = target_of(worker) if target_of is not None else None
                into.add((target or worker.role.opposite).value)
                if worker.id not in self._applying:
                    described.append(f"{worker.id} {worker.state}")
                    others.append(f"{worker.id} {worker.state}")
        joining = tuple(record["to_role"] for record in self._applying.values())
        return (", ".join(described) or None), tuple(sorted(into)), joining, (", ".join(others) or None)

    def observe(self, now: float | None = None) -> Observation:
        now = self.clock() if now is None else now
        # Latency of requests started since the last conversion ended (when none runs now): the new split's.
        since = self.state.last_conversion_at if not self._applying else None
        latency = self.window.summary(now, self.config.min_samples, since=since)
        busy, converting_into, joining, others = self._moving()
        pending = tuple(sorted({w.role.value for w in self.registry.workers() if w.state is WorkerState.PENDING}))
        # ours in progress have left their pool, even before the flow took them out of routing
        pools = {role: tuple(self._view(w) for w in self.registry.routable(role) if w.id not in self._applying)
                 for role in (Role.PREFILL, Role.DECODE)}
        arrived, ended = self.window.sizes(now)
        return Observation(now=now, prefill=pools[Role.PREFILL], decode=pools[Role.DECODE],
                           ttft_s=latency["ttft_s"], itl_s=latency["itl_s"], samples=latency["samples"],
                           busy=busy, converting_into=converting_into, pending=pending, joining=joining,
                           others_busy=others, request_sizes=arrived, finished_sizes=ended)

    # ---- decide ----------------------------------------------------------------------------------------
    def tick(self) -> Decision | None:
        """One observation and decision; applies or records it. None when the rebalancer is off (and refills
        are off), or when off with refills on and no pool is empty."""
        config = self.config
        if config.mode is RebalanceMode.OFF and not config.refills:
            return None
        if not self.leading():
            self.counters["ticks_not_leading"] += 1
            return None
        obs = self.observe()
        if config.mode is RebalanceMode.OFF:
            decision = refill(obs, self.state)
            if decision is None:
                return None
        else:
            decision = decide(obs, self.state, config)
        self._record(obs, decision)
        return decision

    def refill_now(self) -> Decision | None:
        """A refill decision outside the interval (a pool just lost its last routable server)."""
        if not self.config.refills or not self.leading() or self.applying is not None:
            return None
        obs = self.observe()
        decision = refill(obs, self.state)
        if decision is None:
            return None
        if not decision.convert and self.last_refill is not None and self.last_refill.get("reason") == decision.reason:
            return decision  # the same refusal as a moment ago: nothing new to record
        self._record(obs, decision)
        return decision

    def _on_registry_event(self, event: str, worker: Worker | None, details: dict) -> None:
        if event not in _POOL_EVENTS or self._refill_pending or not self.config.refills:
            return
        if self.registry.routable(Role.PREFILL) and self.registry.routable(Role.DECODE):
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop (a test building a registry by hand): the interval will see it
        self._refill_pending = True
        loop.call_soon(self._refill_soon)

    def _refill_soon(self) -> None:
        self._refill_pending = False
        try:
            self.refill_now()
        except Exception:
            logger.exception("rebalancer refill check failed")

    def _record(self, obs: Observation, decision: Decision) -> None:
        self.state = decision.state
        self.observations.append(obs)
        self.last_observation = {"at": obs.now, "ttft_p90_s": obs.ttft_s, "itl_p90_s": obs.itl_s,
                                 "samples": obs.samples, "busy": obs.busy}
        entry = decision.to_dict()
        entry["mode"] = self.config.mode.value
        self.counters[f"decisions_{decision.action}"] += 1
        for guard in decision.guards:
            self.counters[f"guard_{guard}"] += 1
        if decision.refill:
            self.last_refill = {"at": decision.at, "reason": decision.reason, "action": decision.action,
                                "guards": list(decision.guards), "to_role": decision.to_role,
                                "worker_id": decision.worker_id}
        if decision.convert:
            applied = [self._act(decision, worker_id) for worker_id in decision.workers or (decision.worker_id,)]
            entry["applied"] = applied[0] if len(set(applied)) == 1 else applied
            if decision.refill:
                self.last_refill["applied"] = entry["applied"]
        else:
            self._log_hold(decision)
        self.decisions.append(entry)
        self._emit("decision", entry)

    def _act(self, decision: Decision, worker_id: str) -> str:
        worker = self.registry.find(worker_id)
        acts = self.config.mode is RebalanceMode.ENABLED or (decision.refill and self.config.refills)
        what = "refill" if decision.refill else "convert"
        if not acts:
            self.counters["would_refill" if decision.refill else "would_convert"] += 1
            logger.info("rebalancer (%s) would %s %s %s -> %s: %s", self.config.mode, what, worker_id,
                        decision.from_role, decision.to_role, decision.reason)
            return "advisory"
        if self.converter is None or worker is None:
            why = "no conversion flow is available" if self.converter is None else "the worker is gone"
            logger.warning("rebalancer cannot convert %s: %s", worker_id, why)
            self.counters["conversions_failed"] += 1
            self.state = conversion_ended(self.state, self.clock(), ok=False)
            return f"not applied: {why}"
        if decision.refill and self._applying:  # a refill while one of ours runs: tried again once it ends
            return f"not applied: {self.applying['worker_id']} is being converted by the rebalancer"
        if worker.id in self._applying:
            return f"not applied: {worker.id} is being converted by the rebalancer"
        mode = decision.conversion_mode or self.config.conversion_mode
        self.counters["conversions_started"] += 1
        if decision.refill:
            self.counters["refills_started"] += 1
        self._applying[worker.id] = {"worker_id": worker.id, "url": worker.url, "from_role": decision.from_role,
                                     "to_role": decision.to_role, "started_at": self.clock(),
                                     "reason": decision.reason, "mode": mode, "refill": decision.refill}
        logger.warning("rebalancer %s %s %s -> %s (%s mode): %s", "refills with" if decision.refill else "converts",
                       worker.id, decision.from_role, decision.to_role, mode, decision.reason)
        self.spawn(self._apply(worker, Role(decision.to_role), decision.reason, mode))
        return "started"

    async def _apply(self, worker: Worker, to_role: Role, reason: str, mode: str) -> None:
        record = dict(self._applying.get(worker.id) or {})
        try:
            result = await self.converter.convert(worker, to_role, reason=f"rebalancer: {reason}", mode=mode)
        except asyncio.CancelledError:
            result = ConversionResult(False, "cancelled (router shutting down)")
            raise
        except Exception as exc:  # the flow failed unexpectedly: the rebalancer must survive it
            logger.exception("conversion of %s failed", worker.url)
            result = ConversionResult(False, f"{type(exc).__name__}: {exc}")
        finally:
            now = self.clock()
            self._applying.pop(worker.id, None)
            self.state = conversion_ended(self.state, now, ok=result.ok, to_role=to_role.value,
                                          secs=now - record["started_at"] if "started_at" in record else None)
            if not result.ok:
                self._failed_at[worker.id] = now
            self.counters["conversions_succeeded" if result.ok else "conversions_failed"] += 1
            if record.get("refill"):
                self.counters["refills_succeeded" if result.ok else "refills_failed"] += 1
            record.update(ended_at=now, ok=result.ok, detail=result.detail, conversion_id=result.conversion_id)
            self.conversions.append(record)
            self._emit("conversion", record)
            (logger.info if result.ok else logger.warning)("rebalancer conversion of %s to %s %s: %s", worker.id,
                                                           to_role, "succeeded" if result.ok else "failed",
                                                           result.detail or "-")
        if self.config.refills:  # a pool may have emptied meanwhile, or a refill failed: look again now
            self._on_registry_event("routable", worker, {})

    def _log_hold(self, decision: Decision) -> None:
        previous = self.decisions[-1] if self.decisions else None
        changed = previous is None or tuple(previous["guards"]) != decision.guards
        quiet = decision.guards in (("deadband",), ("no_signal",))
        if decision.refill:
            (logger.warning if changed else logger.debug)("rebalancer cannot refill: %s", decision.reason)
            return
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
            self.observations = deque(self.observations, maxlen=config.history)
        self.window.window_secs = config.window_secs
        if self.config.mode is RebalanceMode.OFF and config.mode is not RebalanceMode.OFF:
            self.state = initial_state(self.clock())  # observing again: warm up again
        logger.info("rebalancer reconfigured: %s", changes)
        self.config = config
        if config.refills:
            self._on_registry_event("routable", None, {})  # refills just turned on: a pool may be empty now
        return config

    async def run(self) -> None:
        while True:  # a look as it starts (the counters the first interval is measured from), then every interval
            try:
                self.tick()
            except Exception:  # a bug in one tick must not stop the loop
                logger.exception("rebalancer tick failed")
            await asyncio.sleep(self.config.interval_secs)

    def recording(self) -> dict:
        """What replays the last decisions offline (`python -m bench.replay FILE`): the configuration, when the
        rebalancer started (its warm-up), each observation decided on, the decisions made and the conversions'
        ends. A decision whose observation has left the journal is left out, and so are those before it."""
        decisions = list(self.decisions)[-len(self.observations):] if self.observations else []
        return {"config": self.config.to_dict(), "started_at": self.state.started_at,
                "observations": [obs.to_dict() for obs in self.observations], "decisions": decisions,
                "conversions": list(self.conversions)}

    def snapshot(self, limit: int = 50) -> dict:
        now = self.clock()
        return {
            "mode": self.config.mode.value,
            "config": self.config.to_dict(),
            "state": {
                "last_conversion_age_secs": _age(now, self.state.last_conversion_at),
                "last_direction": self.state.last_direction,
                "last_failure_age_secs": _age(now, self.state.last_failure_at),
                "conversions_decided": self.state.conversions,
            },
            "refill": {"enabled": self.config.refills, "refills_decided": self.state.refills,
                       "last": self.last_refill},
            "counters": dict(self.counters),
            "applying": self.applying,
            "applying_all": list(self._applying.values()),
            "last_observation": self.last_observation,
            "decisions": list(self.decisions)[-limit:] if limit else [],
            "conversions": list(self.conversions)[-limit:] if limit else [],
        }


def _tokens_decoded(report) -> float | None:
    """A decode's tokens decoded since it started (`decode_moments`); 0 for a 0.5.23 server that has not run a
    decode step yet (it reports no moments before the first: answers of one token never make one), None for a
    server that does not say."""
    if report is None:
        return None
    if report.decode_moments and len(report.decode_moments) > 5:
        return report.decode_moments[5]
    return 0.0 if report.prefill_busy_us is not None else None


def _age(now: float, then: float | None) -> float | None:
    return None if then is None else round(now - then, 3)


REBALANCER = web.AppKey("rebalancer", Rebalancer)
