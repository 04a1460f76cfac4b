"""manual: sticky sessions by routing key (sgl-router's and SMG's `manual`).

A request naming a routing key (the first of `--routing-key-headers` present, default `X-SMG-Routing-Key`)
goes where that key went before; a new key is assigned by `--assignment-mode` and pinned. Unlike
consistent_hashing, adding workers moves no key: a key is re-assigned only when none of its workers is
routable. Each key remembers its last two workers (lightseekorg/smg policies/manual.rs): when its first comes
back, the key returns to it. A request without a key is assigned by the mode and pins nothing.

Assignment modes: `random`; `min_load` (the least loaded by `effective_load`: the router's count and the
server's report, where the peers use the router's count alone); `min_group` (the fewest keys pinned to it;
the peers count keys with a request in flight); SMG's `delegate` asks the pool's own policy when a `delegate`
is given (the routing-key override, `sticky.py`), else it means `random`. Ties are broken at random (seeded in
tests).

Keys unused for `--max-idle-secs` (4 h) are forgotten every `--eviction-interval-secs`; at most
`MAX_KEYS` are kept (the least recently used go first), so a client inventing keys cannot grow it without
bound. Each pool has its own policy: a key pins one prefill and one decode, independently (SMG namespaces the
key per leg to the same effect).
"""

from __future__ import annotations

import random
import time
from collections import Counter, OrderedDict
from typing import Callable, Sequence

from .base import Candidate, Policy, RequestInfo, effective_load
from .hash_ring import routing_key
from .params import PolicyParams

MAX_CANDIDATES = 2  # workers a key remembers (SMG's)
MAX_KEYS = 1 << 20


class _Pin:
    __slots__ = ("urls", "last_used")

    def __init__(self, url: str, now: float) -> None:
        self.urls = [url]
        self.last_used = now


class ManualPolicy(Policy):
    name = "manual"
    reads_server_load = True

    def __init__(self, params: PolicyParams | None = None, rng: random.Random | None = None, *,
                 clock: Callable[[], float] = time.monotonic, delegate: Policy | None = None) -> None:
        params = params or PolicyParams()
        if problems := params.problems():
            raise ValueError("; ".join(problems))
        self._key_headers = params.routing_key_headers
        self._mode = params.assignment_mode
        self._delegate = delegate  # assignment_mode "delegate": new keys and keyless requests go where it says
        self._max_idle = params.max_idle_secs
        self.maintenance_interval = params.eviction_interval_secs
        self._rng = rng or random.Random()
        self._clock = clock
        self._pins: OrderedDict[str, _Pin] = OrderedDict()  # least recently used first
        self._keys_per_worker: Counter[str] = Counter()  # url -> keys whose newest worker it is
        self.decisions: Counter[str] = Counter()  # hit, reassigned, new_key, no_key
        self.evicted = 0

    @classmethod
    def build(cls, params: PolicyParams, rng: random.Random | None = None) -> "ManualPolicy":
        return cls(params, rng)

    def _assign(self, candidates: Sequence[Candidate], request: RequestInfo) -> Candidate:
        if self._delegate is not None and self._mode == "delegate":
            return self._delegate.select(candidates, request)
        if self._mode == "min_load":
            measure = effective_load
        elif self._mode == "min_group":
            def measure(w: Candidate) -> int:
                return self._keys_per_worker[w.url]
        else:  # random, delegate
            return self._rng.choice(candidates)
        values = [measure(w) for w in candidates]
        low = min(values)
        tied = [w for w, v in zip(candidates, values) if v == low]
        return tied[0] if len(tied) == 1 else self._rng.choice(tied)

    def _pin(self, pin: _Pin, url: str) -> None:
        self._keys_per_worker[pin.urls[-1]] -= 1
        if url in pin.urls:
            pin.urls.remove(url)
        pin.urls.append(url)
        del pin.urls[:-MAX_CANDIDATES]
        self._keys_per_worker[url] += 1

    def select(self, candidates: Sequence[Candidate], request: RequestInfo) -> Candidate:
        key = routing_key(request.headers, self._key_headers)
        if key is None:
            self.decisions["no_key"] += 1
            return self._assign(candidates, request)
        now = self._clock()
        pin = self._pins.get(key)
        if pin is not None:
            pin.last_used = now
            self._pins.move_to_end(key)
            for url in pin.urls:
                for worker in candidates:
                    if worker.url == url:
                        self.decisions["hit"] += 1
                        return worker
            worker = self._assign(candidates, request)
            self._pin(pin, worker.url)
            self.decisions["reassigned"] += 1
            return worker
        worker = self._assign(candidates, request)
        self._pins[key] = _Pin(worker.url, now)
        self._keys_per_worker[worker.url] += 1
        self.decisions["new_key"] += 1
        if len(self._pins) > MAX_KEYS:
            self._forget(self._pins.popitem(last=False)[1])
        return worker

    def _forget(self, pin: _Pin) -> None:
        self._keys_per_worker[pin.urls[-1]] -= 1
        self.evicted += 1

    def maintain(self) -> None:
        """Forget the keys idle longer than --max-idle-secs (the oldest are first)."""
        deadline = self._clock() - self._max_idle
        while self._pins:
            key, pin = next(iter(self._pins.items()))
            if pin.last_used > deadline:
                break
            del self._pins[key]
            self._forget(pin)

    # A worker leaving the pool changes nothing here: its keys go to their other worker, or are re-assigned on
    # their next request, and come back to it if it returns (the peers keep them the same way).

    def pinned(self, key: str) -> list[str]:
        """The workers a key is pinned to, first choice first (the admin view, tests)."""
        pin = self._pins.get(key)
        return list(pin.urls) if pin else []

    def state(self) -> dict:
        return {"name": self.name, "assignment_mode": self._mode, "routing_key_headers": list(self._key_headers),
                "keys": len(self._pins), "max_idle_secs": self._max_idle, "evicted_keys": self.evicted,
                "decisions": dict(self.decisions)}
