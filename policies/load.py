"""Load-aware policies (O(candidates), never O(requests))."""

from __future__ import annotations

import random
from typing import Sequence

from .base import Candidate, Policy, RequestInfo, effective_load
from .least_load import ExpectedWait
from .params import PolicyParams


class LeastInflightPolicy(Policy):
    """The fewest requests by the router's own count (ties: the first in pool order)."""

    name = "least_inflight"

    def select(self, candidates: Sequence[Candidate], request: RequestInfo) -> Candidate:
        return min(candidates, key=lambda w: w.inflight)


class PowerOfTwoPolicy(Policy):
    """Two random candidates; the less loaded wins. Two samples avoid the herding of "least loaded" when reports
    are stale. What "loaded" means is `--power-of-two-load-metric` (SMG's): `requests` (pd-router's and
    sgl-router's: `effective_load`, the router's count and the server's own report), `least_requests` (the
    router's count alone), `expected_wait` (least_load's score from the servers' reports, SMG 1.13's default).
    Ties: the first sampled."""

    name = "power_of_two"
    reads_server_load = True

    def __init__(self, rng: random.Random | None = None, params: PolicyParams | None = None):
        params = params or PolicyParams()
        self._sample = (rng or random.Random()).sample
        self.metric = params.power_of_two_load_metric
        self._wait = ExpectedWait(params) if self.metric == "expected_wait" else None

    @classmethod
    def build(cls, params: PolicyParams, rng: random.Random | None = None) -> "PowerOfTwoPolicy":
        return cls(rng, params)

    def select(self, candidates: Sequence[Candidate], request: RequestInfo) -> Candidate:
        if len(candidates) == 1:
            return candidates[0]
        a, b = self._sample(candidates, 2)
        if self._wait is not None:
            score_a, score_b = self._wait.scores((a, b))
            chosen = a if score_a <= score_b else b
            self._wait.routed(chosen, max(1, request.batch_size))
            return chosen
        if self.metric == "least_requests":
            return a if a.inflight <= b.inflight else b
        return a if effective_load(a) <= effective_load(b) else b

    def on_worker_removed(self, worker: Candidate) -> None:
        if self._wait is not None:
            self._wait.forget(worker)

    def state(self) -> dict:
        return {"name": self.name, "load_metric": self.metric}
