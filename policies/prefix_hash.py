"""prefix_hash: prompts that start alike go to the same worker, unless it is overloaded (SMG's `prefix_hash`).

A light alternative to cache_aware: no index of what each worker holds, only a hash of the prompt's start on a
consistent hash ring (policies/hash_ring.py), so choosing costs one hash and a ring look-up and keeps no
per-prompt memory. pd-router routes text: it hashes the first 4 x `--prefix-token-count` characters of the
prompt (SMG's rule for untokenized requests; a prompt of token ids is hashed over its ids as written). Then,
as lightseekorg/smg policies/prefix_hash.rs does:
1. the ring's owner of the hash, unless it is overloaded: its load is over `--prefix-hash-load-factor` x the
   pool's mean (the mean counting this request) and over the mean by more than
   `--prefix-hash-balance-abs-threshold` requests;
2. an overloaded owner gives way to the least loaded worker that is not overloaded (the owner itself if all
   are);
3. a request without a prompt goes to the least loaded worker (SMG fails it).
Load is `effective_load` (the router's count and the server's own report); SMG counts the router's alone.
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence

from .base import Candidate, Policy, RequestInfo, effective_load
from .hash_ring import HashRing
from .params import PolicyParams

CHARS_PER_TOKEN = 4  # SMG: untokenized requests hash four times as many characters as tokens


class PrefixHashPolicy(Policy):
    name = "prefix_hash"
    reads_server_load = True
    needs_text = True

    def __init__(self, params: PolicyParams | None = None) -> None:
        params = params or PolicyParams()
        if problems := params.problems():
            raise ValueError("; ".join(problems))
        self._prefix_chars = params.prefix_token_count * CHARS_PER_TOKEN
        self._factor = params.prefix_hash_load_factor
        self._abs = params.prefix_hash_balance_abs_threshold
        self._ring = HashRing()
        self._on_ring: Sequence[Candidate] = ()
        self.decisions: Counter[str] = Counter()  # ring_hit, load_balance, no_text

    @classmethod
    def build(cls, params: PolicyParams, rng=None) -> "PrefixHashPolicy":
        return cls(params)

    def overloaded(self, load: int, total: int, count: int) -> bool:
        mean = (total + 1) / count
        return load > mean * self._factor and load - mean > self._abs

    def select(self, candidates: Sequence[Candidate], request: RequestInfo) -> Candidate:
        loads = [effective_load(w) for w in candidates]
        text = request.text
        if not text:
            self.decisions["no_text"] += 1
            return candidates[loads.index(min(loads))]
        if candidates is not self._on_ring:
            self._ring.include(w.url for w in candidates)
            self._on_ring = candidates
        owner = self._ring.owner(text[:self._prefix_chars], candidates)
        total, count = sum(loads), len(candidates)
        index = candidates.index(owner)
        if not self.overloaded(loads[index], total, count):
            self.decisions["ring_hit"] += 1
            return owner
        self.decisions["load_balance"] += 1
        fit = [i for i in range(count) if not self.overloaded(loads[i], total, count)]
        if not fit:
            return owner
        return candidates[min(fit, key=loads.__getitem__)]

    def on_worker_removed(self, worker: Candidate) -> None:
        self._ring.discard(worker.url)
        self._on_ring = ()

    def state(self) -> dict:
        return {"name": self.name, "prefix_chars": self._prefix_chars, "load_factor": self._factor,
                "balance_abs_threshold": self._abs, "ring_workers": len(self._ring),
                "decisions": dict(self.decisions)}
