"""The model core's guards: what holds a move the model chose, for reasons that are not the model's job.

Each guard is one small function with the case it prevents in its docstring; `GUARDS` lists them in the order
they are checked, and the docs' guard table is generated from it (`guard_table`). Hysteresis, pace and
"is it worth it" are the model's (policies/fleet_model.py: a move is charged its conversion's duration, and
must gain `min_gain` over holding); none of them is here.
"""

from __future__ import annotations

from typing import Callable

from .rebalance_config import RebalanceConfig
from .rebalance_signals import Observation, WorkerView

# Guard names shared with the rules core (a fixed catalogue: metrics and logs count them).
NO_SIGNAL = "no_signal"
WARMUP = "warmup"
BUSY = "busy"
FAILURE_COOLDOWN = "failure_cooldown"
NO_CANDIDATE = "no_candidate"


def warming_up(obs: Observation, state, config: RebalanceConfig, to_role: str) -> str | None:
    """Less than `warmup_secs` since the rebalancer started: the servers' counters and fitted step lines
    describe the start-up (first compilations, empty caches), not the workload."""
    left = config.warmup_secs - (obs.now - state.started_at)
    return f"warming up ({left:.0f} s left)" if left > 0 else None


def operator_converting(obs: Observation, state, config: RebalanceConfig, to_role: str) -> str | None:
    """A conversion that is not the rebalancer's is under way (an operator's): one operation on the fleet at a
    time; the split it leaves is read once it ends."""
    return f"a conversion is in progress ({obs.others_busy})" if obs.others_busy else None


def undoing_in_flight(obs: Observation, state, config: RebalanceConfig, to_role: str) -> str | None:
    """Ours are still on their way into the other pool: a move back now undoes them before they served
    (the model values splits with those arriving counted; it never proposes this, but a look can race one)."""
    other = [role for role in obs.joining if role != to_role]
    return f"{len(other)} of ours are still converting to {other[0]}" if other else None


def failed_lately(obs: Observation, state, config: RebalanceConfig, to_role: str) -> str | None:
    """A conversion failed less than `failure_cooldown_secs` ago: whatever made it fail (a server refusing its
    role switch, a network fault) is likely still there."""
    if state.last_failure_at is None:
        return None
    since = obs.now - state.last_failure_at
    return f"a conversion failed {since:.0f} s ago" if since < config.failure_cooldown_secs else None


GUARDS: tuple[tuple[str, Callable], ...] = (
    (WARMUP, warming_up),
    (BUSY, operator_converting),
    (BUSY, undoing_in_flight),
    (FAILURE_COOLDOWN, failed_lately),
)


def check(obs: Observation, state, config: RebalanceConfig, to_role: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The guards that hold a move into `to_role`, and why."""
    fired, notes = [], []
    for name, guard in GUARDS:
        why = guard(obs, state, config, to_role)
        if why:
            if name not in fired:
                fired.append(name)
            notes.append(why)
    return tuple(fired), tuple(notes)


def donors(obs: Observation, role: str, count: int) -> tuple[WorkerView, ...]:
    """The `count` cheapest servers of `role` that can be converted (`WorkerView.cost`: the quickest drains;
    never one a health verdict or a breaker doubts, nor one whose conversion failed lately)."""
    candidates = sorted((w for w in obs.pool(role) if w.convertible), key=lambda w: w.cost)
    return tuple(candidates[:count])


def guard_table() -> str:
    """The docs' table of the model core's guards, from the guards themselves."""
    rows = ["| guard | holds a move when |", "|---|---|"]
    for name, guard in GUARDS:
        text = " ".join((guard.__doc__ or "").split())
        rows.append(f"| `{name}` ({guard.__name__}) | {text} |")
    return "\n".join(rows)
