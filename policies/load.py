"""Load-aware policies (O(candidates), never O(requests))."""

from __future__ import annotations

import random
from typing import Sequence

from .base import Candidate, Policy, RequestInfo, effective_load
from .params import PolicyParams


class LeastInflightPolicy(Policy):
    """The fewest requests by the router's own count (ties: the first in pool order)."""

    name = "least_inflight"

    def select(self, candidates: Sequence[Candidate], request: RequestInfo) -> Candidate:
        return min(candidates, key=lambda w: w.inflight)


class PowerOfTwoPolicy(Policy):
    """Two random candidates; the less loaded wins, by the router's count and the server's own report
    (`effective_load`). Two samples avoid the herding of "least loaded" when reports are stale."""

    name = "power_of_two"

    def __init__(self, rng: random.Random | None = None):
        self._sample = (rng or random.Random()).sample

    @classmethod
    def build(cls, params: PolicyParams, rng: random.Random | None = None) -> "PowerOfTwoPolicy":
        return cls(rng)

    def select(self, candidates: Sequence[Candidate], request: RequestInfo) -> Candidate:
        if len(candidates) == 1:
            return candidates[0]
        a, b = self._sample(candidates, 2)
        return a if effective_load(a) <= effective_load(b) else b
