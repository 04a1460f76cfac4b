"""Where the router process is in its life: starting (its fleet not read yet), serving, or shutting down (and
in which phase).

Set by the composition root's start step (`fleet_read`) and the server layer's shutdown sequence
(`router/server/shutdown.py`); read by `/health` (503 while shutting down, so a balancer stops sending), by
the flows (no new operation starts) and by the rebalancer (no decision on a fleet not read yet).
"""

from __future__ import annotations

import time

SERVING = "serving"
GRACE = "grace"  # not accepting; requests in flight finish, running flows end
ABORTING = "aborting"  # the grace is over: what is left is aborted on its servers and answered
CLOSING = "closing"  # connections and background tasks are being closed


class Lifecycle:
    __slots__ = ("fleet_read", "phase", "signal", "started", "deadline")

    def __init__(self) -> None:
        # The start step has read the fleet's servers: before, a pool looks empty only because its servers are
        # still being read.
        self.fleet_read = False
        self.phase = SERVING
        self.signal: str | None = None  # the signal that started the shutdown
        self.started: float | None = None  # monotonic
        self.deadline: float | None = None  # monotonic: the end of the grace period

    @property
    def shutting_down(self) -> bool:
        return self.phase != SERVING

    def begin_shutdown(self, signal: str, grace_s: float) -> None:
        self.phase = GRACE
        self.signal = signal
        self.started = time.monotonic()
        self.deadline = self.started + grace_s

    def enter(self, phase: str) -> None:
        self.phase = phase

    def refusal(self) -> str | None:
        """Why new work is refused now, or None while serving."""
        return None if self.phase == SERVING else f"the router is shutting down ({self.signal})"

    def to_dict(self) -> dict:
        if self.started is None:
            return {"phase": self.phase}
        now = time.monotonic()
        return {"phase": self.phase, "signal": self.signal, "shutting_down_for_s": round(now - self.started, 3),
                "grace_left_s": round(max(self.deadline - now, 0.0), 3)}
