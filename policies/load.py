"""Load-aware policies on the router's own in-flight counts (O(candidates), never O(requests))."""

from __future__ import annotations

import random
from typing import Sequence

from .base import Candidate, Policy, RequestInfo


class LeastInflightPolicy(Policy):
    name = "least_inflight"

    def select(self, candidates: Sequence[Candidate], request: RequestInfo) -> Candidate:
        return min(candidates, key=lambda w: w.inflight)


class PowerOfTwoPolicy(Policy):
    """Two random candidates; the less loaded wins."""

    name = "power_of_two"

    def __init__(self, rng: random.Random | None = None):
        self._sample = (rng or random.Random()).sample

    def select(self, candidates: Sequence[Candidate], request: RequestInfo) -> Candidate:
        a, b = self._sample(candidates, 2)
        return a if a.inflight <= b.inflight else b
