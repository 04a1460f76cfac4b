"""The step record of every multi-step flow (a role conversion, a fleet-wide operation).

A flow records each step it takes, in order, with its deadline, how long it took, how it ended and why;
the admin API shows these records (`GET /admin/conversions/{id}`, `GET /weight_updates/{id}`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass(eq=False, slots=True)
class Step:
    name: str
    deadline_s: float | None = None  # None: the step has no deadline of its own
    started_at: float = field(default_factory=time.time)  # wall clock, for the record
    t0: float = field(default_factory=time.monotonic)
    duration_s: float | None = None
    outcome: str = "running"  # running | ok | failed | timeout | skipped | cancelled
    message: str = ""
    attempts: int = 0  # calls the step made to a server (switch calls, abort_all, role reads)
    details: dict = field(default_factory=dict)  # the step's own figures (idle waits, polls)

    @property
    def running(self) -> bool:
        return self.outcome == "running"

    def end(self, outcome: str, message: str | None = None) -> None:
        self.duration_s = time.monotonic() - self.t0
        self.outcome = outcome
        if message is not None:
            self.message = message

    def to_dict(self) -> dict:
        return {"name": self.name, "outcome": self.outcome, "started_at": self.started_at,
                "deadline_s": self.deadline_s,
                "duration_s": None if self.duration_s is None else round(self.duration_s, 6),
                "message": self.message, "attempts": self.attempts, "details": dict(self.details)}
