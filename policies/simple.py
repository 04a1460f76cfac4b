"""Load-oblivious policies: random (mini_lb's), round robin, passthrough (SMG's)."""

from __future__ import annotations

import random
from typing import Sequence

from .base import Candidate, Policy, RequestInfo
from .params import PolicyParams


class RandomPolicy(Policy):
    name = "random"

    def __init__(self, rng: random.Random | None = None):
        self._choice = (rng or random.Random()).choice

    @classmethod
    def build(cls, params: PolicyParams, rng: random.Random | None = None) -> "RandomPolicy":
        return cls(rng)

    def select(self, candidates: Sequence[Candidate], request: RequestInfo) -> Candidate:
        return self._choice(candidates)


class RoundRobinPolicy(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def select(self, candidates: Sequence[Candidate], request: RequestInfo) -> Candidate:
        index = self._next % len(candidates)
        self._next = index + 1
        return candidates[index]


class PassthroughPolicy(Policy):
    """SMG's `passthrough`, for a pool of one: the first routable worker, in pool order (with more than one, the
    others get nothing while the first is routable)."""

    name = "passthrough"

    def select(self, candidates: Sequence[Candidate], request: RequestInfo) -> Candidate:
        return candidates[0]
