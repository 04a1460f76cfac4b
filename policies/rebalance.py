"""The P/D rebalancer's decision core: `decide(observation, state, config) -> Decision`, with no I/O.

It compares the pressure on the prefill pool with the pressure on the decode pool and proposes converting
one server from the cold pool to the hot one. Pressure is a pool's worst ratio of a measured signal to its
target, so 1.0 means "at target":
- both pools: waiting requests per server (the servers' own reports) / queue target; KV usage / KV target;
- decode: inter-token latency measured by the router (p90) / ITL (TPOT) target;
- TTFT measured by the router (p90) / TTFT target, charged to the pool with the longer queue (in PD a
  request waits for its first token either on prefill compute or on decode KV room).

The same code runs live, in replay and in tests: time comes in the observation, and the state is a value
returned inside the decision. Every decision, a refusal included, names the guards that held it back:

  no_signal      a pool has no data at all (no reports, no latency samples)
  deadband       the hot pool is below `min_pressure`: nothing is worth a conversion
  margin         moving one server is predicted to improve the worst pressure by less than `min_improvement`
                 (it would only move the bottleneck); the streak restarts
  warmup         less than `warmup_secs` since the rebalancer started
  busy           a conversion is in progress (ours or an operator's): one at a time
  cooldown       less than `cooldown_secs` since the last conversion ended
  failure_cooldown  less than `failure_cooldown_secs` since a conversion failed
  floor          the donor pool would fall below its minimum size
  confirmations  the same proposal has not yet held for `confirmations` consecutive intervals
  no_candidate   the donor pool has no server that can be converted

The prediction assumes a pool's pressure is proportional to its load per server: moving one server from a
pool of n_cold to a pool of n_hot scales the hot pressure by n_hot / (n_hot + 1) and the cold one by
n_cold / (n_cold - 1).
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

# Guard names (a fixed catalogue, so that metrics and logs can count them).
NO_SIGNAL = "no_signal"
DEADBAND = "deadband"
MARGIN = "margin"
WARMUP = "warmup"
BUSY = "busy"
COOLDOWN = "cooldown"
FAILURE_COOLDOWN = "failure_cooldown"
FLOOR = "floor"
CONFIRMATIONS = "confirmations"
NO_CANDIDATE = "no_candidate"
GUARDS = (NO_SIGNAL, DEADBAND, MARGIN, WARMUP, BUSY, COOLDOWN, FAILURE_COOLDOWN, FLOOR, CONFIRMATIONS,
          NO_CANDIDATE)

PREFILL, DECODE = "prefill", "decode"


class RebalanceMode(str, enum.Enum):
    OFF = "off"  # not even observed
    ADVISORY = "advisory"  # decide and record "would convert X", change nothing
    ENABLED = "enabled"  # decide and convert

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class RebalanceConfig:
    mode: RebalanceMode = RebalanceMode.ADVISORY
    interval_secs: float = 5.0  # one observation and decision per interval
    window_secs: float = 15.0  # latency samples older than this are forgotten
    warmup_secs: float = 30.0
    confirmations: int = 3
    cooldown_secs: float = 60.0
    failure_cooldown_secs: float = 300.0
    min_prefill: int = 1
    min_decode: int = 1
    min_pressure: float = 1.0
    min_improvement: float = 0.2
    ttft_target_secs: float = 1.0
    itl_target_secs: float = 0.05
    queue_target: float = 4.0  # waiting requests per server that count as full pressure
    kv_target: float = 0.9  # KV cache usage that counts as full pressure
    min_samples: int = 5  # latency needs this many finished requests in the window to count
    history: int = 200  # decisions kept for the admin API
    # How a conversion empties the server: "drain" (in-flight requests finish) or "abort" (they are aborted and
    # re-sent elsewhere by the router, unseen by clients).
    conversion_mode: str = "drain"

    def __post_init__(self) -> None:
        if not isinstance(self.mode, RebalanceMode) and isinstance(self.mode, str):
            try:
                object.__setattr__(self, "mode", RebalanceMode(self.mode))
            except ValueError:
                pass  # reported by problems()

    def problems(self) -> list[str]:
        found = []
        if not isinstance(self.mode, RebalanceMode):
            found.append(f"rebalance mode must be one of {', '.join(m.value for m in RebalanceMode)}, "
                         f"got {self.mode!r}")
        for name in ("interval_secs", "window_secs", "ttft_target_secs", "itl_target_secs", "queue_target",
                     "kv_target", "min_pressure"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                found.append(f"rebalance {name} must be a positive number, got {value!r}")
        for name in ("warmup_secs", "cooldown_secs", "failure_cooldown_secs"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                found.append(f"rebalance {name} must not be negative, got {value!r}")
        for name, low in (("confirmations", 1), ("min_prefill", 1), ("min_decode", 1), ("min_samples", 1),
                          ("history", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                found.append(f"rebalance {name} must be an integer >= {low}, got {value!r}")
        if self.conversion_mode not in ("drain", "abort"):
            found.append(f"rebalance conversion_mode must be drain or abort, got {self.conversion_mode!r}")
        if not isinstance(self.min_improvement, (int, float)) or not 0 <= self.min_improvement < 1:
            found.append(f"rebalance min_improvement must be in [0, 1), got {self.min_improvement!r}")
        return found

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}

    def with_changes(self, changes: dict[str, Any]) -> "RebalanceConfig":
        """A copy with `changes` applied; unknown keys and invalid values raise ValueError (all at once)."""
        unknown = sorted(set(changes) - self.field_names())
        if unknown:
            raise UnknownFields(unknown)
        changed = replace(self, **changes)
        if problems := changed.problems():
            raise ValueError("; ".join(problems))
        return changed

    def to_dict(self) -> dict:
        out = asdict(self)
        out["mode"] = self.mode.value if isinstance(self.mode, RebalanceMode) else self.mode
        return out


class UnknownFields(ValueError):
    def __init__(self, names: list[str]):
        super().__init__(f"unknown field(s): {', '.join(names)}")
        self.names = names


# ---- observation ---------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class WorkerView:
    """One routable server as the rebalancer sees it; `running`/`waiting`/`kv_usage` are None when the
    server does not report them."""

    id: str
    inflight: int = 0
    running: int | None = None
    waiting: int | None = None
    kv_usage: float | None = None
    convertible: bool = True

    @property
    def busy(self) -> int:
        reported = (self.running or 0) + (self.waiting or 0)
        return max(self.inflight, reported)


@dataclass(frozen=True, slots=True)
class Observation:
    now: float
    prefill: tuple[WorkerView, ...]
    decode: tuple[WorkerView, ...]
    ttft_s: float | None = None  # p90 over the window, None under min_samples
    itl_s: float | None = None
    samples: int = 0
    busy: str | None = None  # what conversion is in progress, if any


@dataclass(frozen=True, slots=True)
class RebalanceState:
    started_at: float
    streak_direction: str | None = None  # "to_prefill" | "to_decode"
    streak: int = 0
    last_conversion_at: float | None = None
    last_failure_at: float | None = None
    conversions: int = 0


def initial_state(now: float) -> RebalanceState:
    return RebalanceState(started_at=now)


def conversion_ended(state: RebalanceState, now: float, ok: bool) -> RebalanceState:
    """After a conversion finished (or failed): cooldowns run from now, and what was seen during the
    transition does not count towards the next proposal."""
    if ok:
        return replace(state, last_conversion_at=now, streak=0, streak_direction=None)
    return replace(state, last_failure_at=now, streak=0, streak_direction=None)


# ---- decision ------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Decision:
    at: float
    action: str  # "convert" | "hold"
    reason: str
    guards: tuple[str, ...] = ()
    direction: str | None = None  # "to_prefill" | "to_decode"
    worker_id: str | None = None
    from_role: str | None = None
    to_role: str | None = None
    pressures: dict = field(default_factory=dict)
    predicted_worst: float | None = None
    improvement: float | None = None
    streak: int = 0
    state: RebalanceState | None = None

    @property
    def convert(self) -> bool:
        return self.action == "convert"

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "state"}
        out["guards"] = list(self.guards)
        return out


def load_terms(workers: tuple[WorkerView, ...], config: RebalanceConfig) -> dict[str, float]:
    """A pool's terms from the servers' own reports: waiting requests per server and mean KV usage."""
    terms: dict[str, float] = {}
    reported = [w for w in workers if w.waiting is not None]
    if reported:
        terms["queue"] = sum(w.waiting for w in reported) / len(reported) / config.queue_target
    usage = [w.kv_usage for w in workers if w.kv_usage is not None]
    if usage:
        terms["kv"] = sum(usage) / len(usage) / config.kv_target
    return terms


def pool_pressures(obs: Observation, config: RebalanceConfig) -> tuple[dict[str, float], dict[str, float]]:
    """Both pools' terms. ITL is the decode pool's. TTFT has two causes in PD, waiting for prefill compute
    or waiting for decode KV room, so it is charged to the pool whose servers report the longer queue
    (prefill on a tie): a decode-bound fleet must not look prefill-bound because its TTFT grew."""
    prefill, decode = load_terms(obs.prefill, config), load_terms(obs.decode, config)
    if obs.itl_s is not None:
        decode["itl"] = obs.itl_s / config.itl_target_secs
    if obs.ttft_s is not None:
        charged = prefill if prefill.get("queue", 0.0) >= decode.get("queue", 0.0) else decode
        charged["ttft"] = obs.ttft_s / config.ttft_target_secs
    return prefill, decode


def _pressure(terms: dict[str, float]) -> float | None:
    return max(terms.values()) if terms else None


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def _fmt(x: float | None) -> str:
    return "?" if x is None else f"{x:.2f}"


def decide(obs: Observation, state: RebalanceState, config: RebalanceConfig) -> Decision:
    now = obs.now
    p_terms, d_terms = pool_pressures(obs, config)
    p_pressure, d_pressure = _pressure(p_terms), _pressure(d_terms)
    pressures = {PREFILL: {"pressure": _round(p_pressure), "workers": len(obs.prefill),
                           **{k: round(v, 4) for k, v in p_terms.items()}},
                 DECODE: {"pressure": _round(d_pressure), "workers": len(obs.decode),
                          **{k: round(v, 4) for k, v in d_terms.items()}}}

    def hold(reason: str, guards: tuple[str, ...], new_state: RebalanceState, **extra) -> Decision:
        return Decision(at=now, action="hold", reason=reason, guards=guards, pressures=pressures,
                        streak=new_state.streak, state=new_state, **extra)

    reset = replace(state, streak=0, streak_direction=None)
    if p_pressure is None or d_pressure is None:
        missing = " and ".join(r for r, p in ((PREFILL, p_pressure), (DECODE, d_pressure)) if p is None)
        return hold(f"no load signal from the {missing} pool", (NO_SIGNAL,), reset)

    if p_pressure >= d_pressure:
        hot, cold, hot_p, cold_p, hot_pool, cold_pool = PREFILL, DECODE, p_pressure, d_pressure, obs.prefill, obs.decode
    else:
        hot, cold, hot_p, cold_p, hot_pool, cold_pool = DECODE, PREFILL, d_pressure, p_pressure, obs.decode, obs.prefill
    direction = f"to_{hot}"
    summary = f"{hot} pressure {_fmt(hot_p)} vs {cold} {_fmt(cold_p)}"
    if hot_p < config.min_pressure:
        return hold(f"{summary}: below {config.min_pressure:g}, nothing to relieve", (DEADBAND,), reset)

    n_hot, n_cold = len(hot_pool), len(cold_pool)
    prediction: dict = {"direction": direction, "from_role": cold, "to_role": hot}
    if n_cold > 1:  # with one server the floor guard holds anyway, and the cold pool would be empty
        predicted = max(hot_p * n_hot / (n_hot + 1), cold_p * n_cold / (n_cold - 1))
        improvement = 1 - predicted / hot_p
        prediction.update(predicted_worst=round(predicted, 4), improvement=round(improvement, 4))
        if improvement < config.min_improvement - 1e-9:  # "at least": n -> n+1 can gain exactly the margin
            return hold(f"{summary}: moving one {cold} server would leave the worst pressure at "
                        f"{_fmt(predicted)} (only {improvement * 100:.0f}% better, needs {config.min_improvement * 100:g}%)",
                        (MARGIN,), reset, **prediction)
        proposal = (f"convert a {cold} server to {hot} (predicted worst pressure {_fmt(predicted)}, "
                    f"{improvement * 100:.0f}% better)")
    else:
        proposal = f"convert a {cold} server to {hot}"

    streak = state.streak + 1 if state.streak_direction == direction else 1
    new_state = replace(state, streak=streak, streak_direction=direction)
    fired: list[str] = []
    notes: list[str] = []
    if now - state.started_at < config.warmup_secs:
        fired.append(WARMUP)
        notes.append(f"warming up ({config.warmup_secs - (now - state.started_at):.0f} s left)")
    if obs.busy:
        fired.append(BUSY)
        notes.append(f"a conversion is in progress ({obs.busy})")
    if state.last_conversion_at is not None and now - state.last_conversion_at < config.cooldown_secs:
        fired.append(COOLDOWN)
        notes.append(f"cooling down ({config.cooldown_secs - (now - state.last_conversion_at):.0f} s left)")
    if state.last_failure_at is not None and now - state.last_failure_at < config.failure_cooldown_secs:
        fired.append(FAILURE_COOLDOWN)
        notes.append(f"a conversion failed {now - state.last_failure_at:.0f} s ago")
    minimum = config.min_prefill if cold == PREFILL else config.min_decode
    if n_cold <= minimum:
        fired.append(FLOOR)
        notes.append(f"the {cold} pool has {n_cold} server(s), its minimum is {minimum}")
    if streak < config.confirmations:
        fired.append(CONFIRMATIONS)
        notes.append(f"signal seen {streak}/{config.confirmations} intervals")
    candidates = [w for w in cold_pool if w.convertible]
    if not candidates:
        fired.append(NO_CANDIDATE)
        notes.append(f"no convertible {cold} server")
    if fired:
        return hold(f"{summary}: would {proposal}, held: {'; '.join(notes)}", tuple(fired), new_state, **prediction)

    # The cheapest server to take out: the fewest requests on it (ties: the first by id).
    worker = min(candidates, key=lambda w: (w.busy, w.id))
    done = replace(state, streak=0, streak_direction=None, last_conversion_at=now,
                   conversions=state.conversions + 1)
    reason = f"{summary}: {proposal.replace(f'a {cold} server', f'{cold} {worker.id}', 1)}"
    return Decision(at=now, action="convert", reason=reason, worker_id=worker.id, pressures=pressures,
                    streak=streak, state=done, **prediction)
