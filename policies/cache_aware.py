"""cache_aware: send a prompt where its prefix is most likely cached, unless that would unbalance the pool.

Each worker has an approximate index of the prompt prefixes recently routed to it (its KV cache holds
roughly those). A prompt is cut into fixed-size character chunks and each prefix is named by a chained
hash of its chunks, so "worker W has seen the first k chunks" is k set look-ups. Choosing costs
O(candidates x prompt length / chunk size) and does not depend on how many requests are in flight.

Choice, in order (sgl-router's cache-aware rules, re-derived):
1. balance guard: if the pool is imbalanced (max load - min load > abs threshold and max load > rel threshold
   x min load) the least loaded worker wins, whatever the cache says: a hot prefix cannot pile onto one server;
2. the worker with the longest matching prefix, if that match covers at least `cache_threshold` of the prompt;
3. else the least loaded worker (ties: the one remembering least, so new prefixes spread out).
The chosen worker then remembers the prompt's prefixes.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Sequence

from .base import Candidate, Policy, RequestInfo, effective_load
from .params import PolicyParams


def prefix_hashes(text: str, chunk_chars: int) -> list[int]:
    """Hash of every chunk-aligned prefix of `text`: element i names text[: (i + 1) * chunk_chars]."""
    hashes = []
    h = 0
    for start in range(0, len(text), chunk_chars):
        h = hash((h, text[start:start + chunk_chars]))
        hashes.append(h)
    return hashes


class PrefixIndex:
    """The prefixes one worker has seen, least recently used first.

    A prompt's prefixes are touched longest first, so a shorter prefix is always more recent than any longer
    one that extends it: evicting from the old end drops the deepest prefixes first (like a radix tree's
    leaves), and "the first k chunks are present" stays true for every k below the longest match.
    """

    __slots__ = ("_entries",)

    def __init__(self) -> None:
        self._entries: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def matched_chunks(self, hashes: list[int]) -> int:
        entries = self._entries
        matched = 0
        for h in hashes:
            if h not in entries:
                break
            matched += 1
        return matched

    def insert(self, hashes: list[int]) -> None:
        entries = self._entries
        for h in reversed(hashes):
            if h in entries:
                entries.move_to_end(h)
            else:
                entries[h] = None

    def trim(self, max_entries: int) -> int:
        """Evict the least recently used prefixes beyond `max_entries`; returns how many went."""
        entries = self._entries
        evicted = 0
        while len(entries) > max_entries:
            entries.popitem(last=False)
            evicted += 1
        return evicted


_EMPTY = PrefixIndex()


class CacheAwarePolicy(Policy):
    name = "cache_aware"
    reads_server_load = True
    needs_text = True

    def __init__(self, params: PolicyParams | None = None) -> None:
        params = params or PolicyParams()
        if problems := params.problems():
            raise ValueError("; ".join(problems))
        self.params = params
        self._chunk = params.prefix_chunk_chars
        self._max_entries = max(1, params.max_tree_size // self._chunk)
        self.maintenance_interval = params.eviction_interval_secs
        self._indexes: dict[str, PrefixIndex] = {}
        self.decisions: Counter[str] = Counter()  # cache_hit, cache_miss, balance, no_text
        self.evicted = 0
        self.prompt_chars = 0
        self.matched_chars = 0  # of the chosen worker: the router's estimate of the prefix-cache hits

    @classmethod
    def build(cls, params: PolicyParams, rng=None) -> "CacheAwarePolicy":
        return cls(params)

    def _index(self, worker: Candidate) -> PrefixIndex:
        """The worker's index; a shared empty one (never written) for a worker that has none yet."""
        return self._indexes.get(worker.id, _EMPTY)

    def imbalanced(self, loads: list[int]) -> bool:
        low, high = min(loads), max(loads)
        p = self.params
        return high - low > p.balance_abs_threshold and high > p.balance_rel_threshold * low

    def select(self, candidates: Sequence[Candidate], request: RequestInfo) -> Candidate:
        loads = [effective_load(w) for w in candidates]
        least = min(range(len(candidates)), key=lambda i: (loads[i], len(self._index(candidates[i]))))
        text = request.text
        if not text:
            self.decisions["no_text"] += 1
            return candidates[least]
        hashes = prefix_hashes(text, self._chunk)
        matched = [self._index(w).matched_chunks(hashes) for w in candidates]
        if self.imbalanced(loads):
            chosen, reason = least, "balance"
        else:
            best = max(range(len(candidates)), key=lambda i: (matched[i], -loads[i]))
            ratio = min(matched[best] * self._chunk, len(text)) / len(text)
            if matched[best] and ratio >= self.params.cache_threshold:
                chosen, reason = best, "cache_hit"
            else:
                chosen, reason = least, "cache_miss"
        self.decisions[reason] += 1
        self.prompt_chars += len(text)
        self.matched_chars += min(matched[chosen] * self._chunk, len(text))
        worker = candidates[chosen]
        index = self._indexes.get(worker.id)
        if index is None:
            index = self._indexes[worker.id] = PrefixIndex()
        index.insert(hashes)
        if len(index) > 2 * self._max_entries:  # the sweep is late: bound memory now
            self.evicted += index.trim(self._max_entries)
        return worker

    def maintain(self) -> None:
        for index in self._indexes.values():
            self.evicted += index.trim(self._max_entries)

    def on_worker_removed(self, worker: Candidate) -> None:
        self._indexes.pop(worker.id, None)

    def state(self) -> dict:
        return {
            "name": self.name,
            "params": {
                "cache_threshold": self.params.cache_threshold,
                "balance_abs_threshold": self.params.balance_abs_threshold,
                "balance_rel_threshold": self.params.balance_rel_threshold,
                "max_tree_size": self.params.max_tree_size,
                "eviction_interval_secs": self.params.eviction_interval_secs,
                "prefix_chunk_chars": self._chunk,
            },
            "decisions": dict(self.decisions),
            "estimated_hit_ratio": round(self.matched_chars / self.prompt_chars, 4) if self.prompt_chars else None,
            "evicted_chunks": self.evicted,
            "trees": {wid: {"chunks": len(ix), "chars": len(ix) * self._chunk} for wid, ix in self._indexes.items()},
        }
