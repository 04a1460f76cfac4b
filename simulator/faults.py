"""Fault injection: what a worker should get wrong, set by flag at start or at run time.

``POST /_sim/faults`` with any of the fields below merges them into the worker's faults
(``{"reset": true}`` clears everything first); ``GET /_sim/faults`` shows them.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import asdict, dataclass, field, fields
from typing import Any

CONVERSION_FAILURES = (None, "safe", "unsafe")


@dataclass
class Faults:
    error_rate: float = 0.0  # fraction of generate calls (native and OpenAI) answered with an error
    error_status: int = 500
    fail_next: int = 0  # the next N generate calls fail (deterministic form of error_rate)
    hang: bool = False  # generate calls are accepted and never progress (until aborted or abandoned)
    hang_after_tokens: int | None = None  # generation stalls after this many tokens
    crash_after_tokens: int | None = None  # the connection drops after this many streamed tokens
    exit_after_tokens: int | None = None  # the whole process exits after this many tokens (real crash)
    unhealthy: bool = False  # /health and /health_generate answer 503
    # the health probes (/health, /health_generate) are held without an answer until this is cleared; each
    # answer is decided on arrival, as a server's probe that got stuck behind its scheduler
    health_hang: bool = False
    health_script: list[int] = field(default_factory=list)  # statuses of the next probes, in order (flapping)
    conversion_failure: str | None = None  # role switch fails: "safe" (unchanged) or "unsafe" (broken)
    update_failure: bool = False  # weight updates answer 400 and change nothing
    update_delay_s: float = 0.0  # weight updates take this long once they hold the lock (read again meanwhile)
    # the next /pd_role_switch call (one) waits this long before the server looks at it (a slow network, a
    # busy HTTP front); dropped if its client leaves meanwhile: it never reached the scheduler
    switch_arrival_delay_s: float = 0.0
    bootstrap_unreachable: bool = False  # the bootstrap listener answers 503 to KV pulls

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        problems = []
        if not 0.0 <= self.error_rate <= 1.0:
            problems.append("error_rate must be within [0, 1]")
        if not 400 <= self.error_status < 600:
            problems.append("error_status must be an HTTP error status")
        if not all(isinstance(s, int) and 200 <= s < 600 for s in self.health_script):
            problems.append("health_script must list HTTP statuses")
        if self.conversion_failure not in CONVERSION_FAILURES:
            problems.append(f"conversion_failure must be one of {CONVERSION_FAILURES}")
        for name in ("fail_next", "hang_after_tokens", "crash_after_tokens", "exit_after_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                problems.append(f"{name} must be a non-negative integer")
        if problems:
            raise ValueError("; ".join(problems))

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class FaultInjector:
    """Holds the live faults of one worker and answers "should this call fail?"."""

    def __init__(self, faults: Faults | None = None, seed: int = 0) -> None:
        self.faults = faults or Faults()
        self._rng = random.Random(seed)
        self.injected = 0  # how many generate calls were failed on purpose

    def update(self, changes: dict[str, Any]) -> Faults:
        """Merge ``changes`` (unknown keys or bad values raise ValueError, leaving faults as they were)."""
        changes = dict(changes)
        base = Faults() if changes.pop("reset", False) else self.faults
        known = {f.name for f in fields(Faults)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise ValueError(f"unknown fault fields: {', '.join(unknown)}")
        merged = Faults(**{**asdict(base), **changes})
        self.faults = merged
        return merged

    def should_fail(self) -> bool:
        f = self.faults
        if f.fail_next > 0:
            f.fail_next -= 1
            self.injected += 1
            return True
        if f.error_rate and self._rng.random() < f.error_rate:
            self.injected += 1
            return True
        return False


def add_fault_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("fault injection (also settable at run time: POST /_sim/faults)")
    group.add_argument("--fault-error-rate", type=float, default=0.0)
    group.add_argument("--fault-error-status", type=int, default=500)
    group.add_argument("--fault-hang", action="store_true")
    group.add_argument("--fault-hang-after-tokens", type=int)
    group.add_argument("--fault-crash-after-tokens", type=int)
    group.add_argument("--fault-exit-after-tokens", type=int)
    group.add_argument("--fault-unhealthy", action="store_true")
    group.add_argument("--fault-health-hang", action="store_true")
    group.add_argument("--fault-conversion-failure", choices=("safe", "unsafe"))
    group.add_argument("--fault-update-failure", action="store_true")


def faults_from_args(args: argparse.Namespace) -> Faults:
    return Faults(
        error_rate=args.fault_error_rate,
        error_status=args.fault_error_status,
        hang=args.fault_hang,
        hang_after_tokens=args.fault_hang_after_tokens,
        crash_after_tokens=args.fault_crash_after_tokens,
        exit_after_tokens=args.fault_exit_after_tokens,
        unhealthy=args.fault_unhealthy,
        health_hang=args.fault_health_hang,
        conversion_failure=args.fault_conversion_failure,
        update_failure=args.fault_update_failure,
    )
