"""consistent_hashing: requests that name the same routing key go to the same worker of the pool (SMG's).

In order (lightseekorg/smg policies/consistent_hashing.rs):
1. `X-SMG-Target-Worker: N`: the pool's N-th routable worker (0-based, pool order). Where SMG fails the
   request when there is no such worker, pd-router goes on to step 2 (a worker that left fails no request);
2. the routing key (the first of `--routing-key-headers` present, default `X-SMG-Routing-Key`): its owner on
   the hash ring;
3. no key: the first of `Authorization`, `X-Forwarded-For`, `Cookie` the client sent stands in for one (a
   client keeps its worker);
4. none of them: a random worker.
Each pool has its own policy, so a key pins one prefill and one decode, independently. The ring keeps a worker
that is out of routing for a while, so its keys come back to it; only a worker removed from the pool is
forgotten. Load is not looked at: affinity wins (use manual or cache_aware to mix in load).
"""

from __future__ import annotations

import random
from collections import Counter
from typing import Sequence

from .base import Candidate, Policy, RequestInfo
from .hash_ring import IMPLICIT_KEY_HEADERS, TARGET_WORKER_HEADER, HashRing, routing_key
from .params import PolicyParams


def target_index(info: RequestInfo) -> int | None:
    raw = info.headers.get(TARGET_WORKER_HEADER) if info.headers else None
    if raw is None or not raw.isdigit():
        return None
    return int(raw)


class ConsistentHashingPolicy(Policy):
    name = "consistent_hashing"

    def __init__(self, params: PolicyParams | None = None, rng: random.Random | None = None) -> None:
        params = params or PolicyParams()
        self._key_headers = params.routing_key_headers
        self._choice = (rng or random.Random()).choice
        self._ring = HashRing()
        self._on_ring: Sequence[Candidate] = ()  # the last candidates put on the ring (the registry's tuple)
        self.decisions: Counter[str] = Counter()  # target_worker, routing_key, implicit_key, random

    @classmethod
    def build(cls, params: PolicyParams, rng: random.Random | None = None) -> "ConsistentHashingPolicy":
        return cls(params, rng)

    def select(self, candidates: Sequence[Candidate], request: RequestInfo) -> Candidate:
        index = target_index(request)
        if index is not None and index < len(candidates):
            self.decisions["target_worker"] += 1
            return candidates[index]
        key = routing_key(request.headers, self._key_headers)
        branch = "routing_key"
        if key is None:
            key, branch = routing_key(request.headers, IMPLICIT_KEY_HEADERS), "implicit_key"
        if key is None:
            self.decisions["random"] += 1
            return self._choice(candidates)
        self.decisions[branch] += 1
        if candidates is not self._on_ring:
            self._ring.include(w.url for w in candidates)
            self._on_ring = candidates
        return self._ring.owner(key, candidates)

    def on_worker_removed(self, worker: Candidate) -> None:
        self._ring.discard(worker.url)
        self._on_ring = ()

    def state(self) -> dict:
        return {"name": self.name, "routing_key_headers": list(self._key_headers),
                "ring_workers": len(self._ring), "decisions": dict(self.decisions)}
