"""The rebalancer's knobs: one validated, frozen config (`problems()` lists every problem at once), changed at
run time only through `with_changes` (unknown keys and invalid values refused)."""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, fields, replace
from typing import Any


class RebalanceMode(str, enum.Enum):
    OFF = "off"  # not even observed
    ADVISORY = "advisory"  # decide and record "would convert X", change nothing
    ENABLED = "enabled"  # decide and convert

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class RebalanceConfig:
    mode: RebalanceMode = RebalanceMode.ADVISORY
    # The decision core: "model" chooses the split a fitted fleet model predicts serves the SLOs best
    # (policies/rebalance_model.py); "rules" is the pressure-ratio core (policies/rebalance.py).
    core: str = "rules"
    # model: the share of requests meeting both SLO targets that is enough (a split predicted to reach it holds)
    attainment_target: float = 0.9
    # model: how far ahead a split is valued (the mix measured over window_secs is expected to last this long)
    horizon_secs: float = 120.0
    # model: the least predicted gain in attainment over the horizon worth a conversion (what the fit's noise
    # could make up)
    min_gain: float = 0.02
    # model: a conversion's duration (drain and switch) before any was measured; then the recent ones' mean
    conversion_secs: float = 10.0
    interval_secs: float = 5.0  # one observation and decision per interval
    window_secs: float = 15.0  # latency samples older than this are forgotten
    warmup_secs: float = 30.0
    confirmations: int = 3
    # A proposal whose hot pool is at least this pressured needs one sighting: an overload that large grows
    # while it is confirmed (0: always `confirmations`).
    urgent_pressure: float = 3.0
    cooldown_secs: float = 60.0  # after a conversion, none the other way for this long (no flapping)
    # After a conversion, none the same way for this long (let it act first); None: a quarter of cooldown_secs.
    step_cooldown_secs: float | None = None
    failure_cooldown_secs: float = 300.0
    min_prefill: int = 1
    min_decode: int = 1
    min_pressure: float = 1.0
    min_improvement: float = 0.2
    ttft_target_secs: float = 1.0
    itl_target_secs: float = 0.05
    queue_target: float = 4.0  # waiting requests per server that count as full pressure
    kv_target: float = 0.9  # KV cache usage that counts as full pressure
    busy_target: float = 0.95  # a prefill's share of time in forwards that counts as full pressure
    # Latency needs this many requests (finished, failed or abandoned) to count; with fewer in the window the
    # newest ones up to this many count, from as far back as four windows (an overload finishes few).
    min_samples: int = 5
    history: int = 200  # decisions kept for the admin API
    # How a conversion empties the server: "drain" (in-flight requests finish) or "abort" (they are aborted and
    # re-sent elsewhere by the router, unseen by clients).
    conversion_mode: str = "drain"
    # Refill a pool left without a routable server from the other pool at once (on whenever mode is enabled;
    # this alone turns it on in advisory and off mode: recovery without ratio changes).
    refill_empty_pool: bool = False

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
        if self.core not in ("rules", "model"):
            found.append(f"rebalance core must be rules or model, got {self.core!r}")
        for name in ("horizon_secs", "conversion_secs", "interval_secs", "window_secs", "ttft_target_secs", "itl_target_secs", "queue_target",
                     "kv_target", "busy_target", "min_pressure"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                found.append(f"rebalance {name} must be a positive number, got {value!r}")
        for name in ("warmup_secs", "cooldown_secs", "step_cooldown_secs", "failure_cooldown_secs"):
            value = getattr(self, name)
            if name == "step_cooldown_secs" and value is None:
                continue
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                found.append(f"rebalance {name} must not be negative, got {value!r}")
        for name, low in (("confirmations", 1), ("min_prefill", 1), ("min_decode", 1), ("min_samples", 1),
                          ("history", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                found.append(f"rebalance {name} must be an integer >= {low}, got {value!r}")
        if not isinstance(self.urgent_pressure, (int, float)) or isinstance(self.urgent_pressure, bool) \
                or self.urgent_pressure < 0:
            found.append(f"rebalance urgent_pressure must be a number >= 0, got {self.urgent_pressure!r}")
        if not isinstance(self.refill_empty_pool, bool):
            found.append(f"rebalance refill_empty_pool must be true or false, got {self.refill_empty_pool!r}")
        if self.conversion_mode not in ("drain", "abort"):
            found.append(f"rebalance conversion_mode must be drain or abort, got {self.conversion_mode!r}")
        for name in ("attainment_target", "min_gain"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value <= 1:
                found.append(f"rebalance {name} must be in [0, 1], got {value!r}")
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

    @property
    def step_cooldown(self) -> float:
        """The same-direction cooldown in force: step_cooldown_secs, or a quarter of cooldown_secs."""
        if self.step_cooldown_secs is None:
            return self.cooldown_secs / 4 if isinstance(self.cooldown_secs, (int, float)) else 0.0
        return self.step_cooldown_secs

    @property
    def refills(self) -> bool:
        """Whether an empty pool is refilled: always with the rebalancer enabled, else by its own switch."""
        return self.mode is RebalanceMode.ENABLED or self.refill_empty_pool is True

    def to_dict(self) -> dict:
        out = asdict(self)
        out["mode"] = self.mode.value if isinstance(self.mode, RebalanceMode) else self.mode
        return out


class UnknownFields(ValueError):
    def __init__(self, names: list[str]):
        super().__init__(f"unknown field(s): {', '.join(names)}")
        self.names = names
