"""The two enumerations every layer names: a worker's role and its lifecycle state (re-exported by registry)."""

from __future__ import annotations

import enum


class Role(str, enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"

    @property
    def opposite(self) -> "Role":
        return Role.DECODE if self is Role.PREFILL else Role.PREFILL

    def __str__(self) -> str:
        return self.value


class WorkerState(str, enum.Enum):
    PENDING = "pending"  # registered, its live state (role, bootstrap port, weights) not read yet: not routed
    ACTIVE = "active"  # routable when healthy, on the fleet's weights and not held out
    DRAINING = "draining"  # no new requests; in-flight ones finish
    ABORTING = "aborting"  # in-flight requests being aborted
    CONVERTING = "converting"  # the server is switching role
    VERIFYING = "verifying"  # checking the live role after a switch
    # No "paused": a fleet-wide hold (weight update, pause_generation) is the router's, in admission, and
    # leaves each worker routable, so /health stays ready and requests wait in the queue instead of failing.
    FAILED = "failed"  # left out: unsafe after a failed operation (an operator acts), or held out (Worker.hold)

    def __str__(self) -> str:
        return self.value
