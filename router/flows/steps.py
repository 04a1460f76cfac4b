"""The step record of every multi-step flow (a role conversion, a fleet-wide operation), and how a flow runs
one step under its deadline.

A flow records each step it takes, in order, with its deadline, how long it took, how it ended and why;
the admin API shows these records (`GET /admin/conversions/{id}`, `GET /weight_updates/{id}`).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, TypeVar

T = TypeVar("T")


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


class StepFailed(Exception):
    """A step could not complete. `safe`: True → what it acted on is unchanged (the flow can go back to where
    it started); False → it may be broken; None → unknown (the flow finds out). `status`: the HTTP status
    that reports the failure."""

    def __init__(self, message: str, *, safe: bool | None, status: int = 502):
        super().__init__(message)
        self.message = message
        self.safe = safe
        self.status = status


async def run_step(step: Step, body: Callable[[Step], Awaitable[T]],
                   on_timeout: Callable[[Step], StepFailed]) -> T:
    """Run `body` within the step's deadline and end the step: ok; timeout (raising on_timeout's failure);
    failed (the body's StepFailed, raised again); cancelled (the router is shutting down)."""
    try:
        async with asyncio.timeout(step.deadline_s):
            result = await body(step)
    except TimeoutError:
        failure = on_timeout(step)
        step.end("timeout", failure.message)
        raise failure from None
    except StepFailed as failure:
        step.end("failed", failure.message)
        raise
    except asyncio.CancelledError:
        step.end("cancelled", "the router is shutting down")
        raise
    step.end("ok")
    return result
