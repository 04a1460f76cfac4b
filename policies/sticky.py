"""--routing-key-override / --sticky-sessions (SMG's): sticky sessions on any policy.

A request naming a routing key (the first of `--routing-key-headers` present, default `X-SMG-Routing-Key`)
goes where that key went before, while that worker is routable; a new key, or one whose workers are all out,
goes where the pool's own policy sends it, and is pinned there. A request without a key is the pool's policy's
alone. It is `manual` with SMG's `delegate` assignment in front of the configured policy: the same pins (a
key remembers its last two workers), idle keys forgotten after `--max-idle-secs` / `--sticky-key-idle-secs`,
at most `manual.MAX_KEYS` kept. SMG falls back to the request-id lineage (its stored responses) for requests
without a key; pd-router keeps no responses, so those are the policy's.
"""

from __future__ import annotations

import dataclasses
import random
import time
from typing import Sequence

from .base import Candidate, LegOutcome, Policy, RequestInfo
from .manual import ManualPolicy
from .params import PolicyParams


class RoutingKeyOverride(Policy):
    """`inner` with routing-key stickiness in front; its name, hooks and state are the inner policy's."""

    def __init__(self, inner: Policy, params: PolicyParams, rng: random.Random | None = None) -> None:
        self.inner = inner
        self.name = inner.name
        self.needs_text = inner.needs_text
        self.reads_server_load = inner.reads_server_load
        self.sticky = ManualPolicy(dataclasses.replace(params, assignment_mode="delegate"), rng, delegate=inner)
        intervals = [i for i in (inner.maintenance_interval, self.sticky.maintenance_interval) if i]
        self.maintenance_interval = min(intervals) if intervals else None
        self._inner_due = time.monotonic() + (inner.maintenance_interval or 0.0)

    def select(self, candidates: Sequence[Candidate], request: RequestInfo) -> Candidate:
        return self.sticky.select(candidates, request)

    def on_complete(self, worker: Candidate, outcome: LegOutcome) -> None:
        self.inner.on_complete(worker, outcome)

    def on_worker_removed(self, worker: Candidate) -> None:
        self.inner.on_worker_removed(worker)

    def maintain(self) -> None:
        """The stickiness's key eviction, and the inner policy's upkeep at its own interval (bucket's ranges)."""
        self.sticky.maintain()
        interval = self.inner.maintenance_interval
        if interval and time.monotonic() >= self._inner_due - 0.01 * interval:
            self._inner_due = time.monotonic() + interval
            self.inner.maintain()

    @property
    def decisions(self):  # the admin view and metrics count the pool's policy's own decisions
        return getattr(self.inner, "decisions", {})

    def state(self) -> dict:
        sticky = self.sticky.state()
        return {**self.inner.state(), "routing_key_override": {
            "routing_key_headers": sticky["routing_key_headers"], "keys": sticky["keys"],
            "max_idle_secs": sticky["max_idle_secs"], "evicted_keys": sticky["evicted_keys"],
            "decisions": sticky["decisions"]}}
