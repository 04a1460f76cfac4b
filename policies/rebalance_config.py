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
    interval_secs: float = 2.0  # one observation and decision per interval
    window_secs: float = 15.0  # the mix is fitted on the counters of this many last seconds
    warmup_secs: float = 30.0
    ttft_target_secs: float = 1.0  # the SLO: time to first token
    itl_target_secs: float = 0.05  # the SLO: time per output token (the mean gap between a request's tokens)
    # The share of requests meeting both SLO targets that is enough (a split predicted to reach it holds)
    attainment_target: float = 0.9
    # How far ahead a split is valued (the mix measured over window_secs is expected to last this long)
    horizon_secs: float = 120.0
    # The least predicted gain in attainment over the horizon worth a conversion (what the fit's noise
    # could make up)
    min_gain: float = 0.02
    # A conversion's duration (drain and switch) before any was measured; then the recent ones' mean
    conversion_secs: float = 10.0
    failure_cooldown_secs: float = 300.0
    min_prefill: int = 1
    min_decode: int = 1
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
        for name in ("horizon_secs", "conversion_secs", "interval_secs", "window_secs", "ttft_target_secs", "itl_target_secs"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                found.append(f"rebalance {name} must be a positive number, got {value!r}")
        for name in ("warmup_secs", "failure_cooldown_secs"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                found.append(f"rebalance {name} must not be negative, got {value!r}")
        for name, low in (("min_prefill", 1), ("min_decode", 1), ("min_samples", 1),
                          ("history", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                found.append(f"rebalance {name} must be an integer >= {low}, got {value!r}")
        if not isinstance(self.refill_empty_pool, bool):
            found.append(f"rebalance refill_empty_pool must be true or false, got {self.refill_empty_pool!r}")
        if self.conversion_mode not in ("drain", "abort"):
            found.append(f"rebalance conversion_mode must be drain or abort, got {self.conversion_mode!r}")
        for name in ("attainment_target", "min_gain"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value <= 1:
                found.append(f"rebalance {name} must be in [0, 1], got {value!r}")
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
