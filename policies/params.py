"""Policy parameters: one validated object for every policy's knobs (sgl-router's flag names and defaults)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PolicyParams:
    # cache_aware: route to the worker with the longest cached prefix when it covers at least this share
    # of the prompt, else to the least loaded worker.
    cache_threshold: float = 0.3
    # cache_aware: the pool is imbalanced (pick the least loaded, ignoring the cache) when
    # max load - min load > abs threshold AND max load > rel threshold * min load.
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    # cache_aware: characters of prompt prefixes remembered per worker, and how often the excess is evicted
    # (least recently used first). Inserts beyond twice the bound evict at once, so memory stays bounded.
    max_tree_size: int = 2**24
    eviction_interval_secs: float = 60.0
    # cache_aware: prompts are matched in chunks of this many characters (the tree's granularity).
    prefix_chunk_chars: int = 32

    def problems(self) -> list[str]:
        found = []
        if not 0.0 <= self.cache_threshold <= 1.0:
            found.append(f"--cache-threshold must be in [0, 1], got {self.cache_threshold}")
        if self.balance_abs_threshold < 0:
            found.append(f"--balance-abs-threshold must not be negative, got {self.balance_abs_threshold}")
        if self.balance_rel_threshold < 1.0:
            found.append(f"--balance-rel-threshold must be at least 1.0, got {self.balance_rel_threshold}")
        if self.prefix_chunk_chars < 1:
            found.append(f"--prefix-chunk-chars must be at least 1, got {self.prefix_chunk_chars}")
        if self.max_tree_size < max(self.prefix_chunk_chars, 1):
            found.append(f"--max-tree-size must be at least one chunk ({self.prefix_chunk_chars}), "
                         f"got {self.max_tree_size}")
        if not self.eviction_interval_secs > 0:
            found.append(f"--eviction-interval-secs must be positive, got {self.eviction_interval_secs}")
        return found
