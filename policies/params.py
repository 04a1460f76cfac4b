"""Policy parameters: one validated object for every policy's knobs (the peers' flag names and defaults:
sgl-router 0.3.2's, and SMG 1.13's for the policies only SMG has)."""

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
    # power_of_two compares (SMG's --power-of-two-load-metric): requests (effective_load: the router's count and
    # the server's report; pd-router's and sgl-router's default), least_requests (the router's count alone),
    # expected_wait (least_load's score; SMG 1.13's default).
    power_of_two_load_metric: str = "requests"
    # least_load (SMG's): score = (queued + routed-since tokens) / throughput + weight x k / (1 - k), seconds.
    least_load_kv_pressure_weight: float = 0.15
    least_load_default_throughput: float = 2000.0  # tokens/s when a server reports none
    least_load_mean_prefill_tokens: int = 1024  # credited per sequence routed since a server's last report
    least_load_max_waiting_requests: int = 0  # leave out workers with this many waiting; 0: off
    # prefix_hash (SMG's): the first 4 x N characters of a prompt pick its worker on a hash ring, unless that
    # worker's load is over factor x mean and over the mean by more than abs.
    prefix_token_count: int = 256
    prefix_hash_load_factor: float = 1.25
    prefix_hash_balance_abs_threshold: int = 10
    # consistent_hashing, manual: the headers a routing key is read from, the first present wins (SMG's).
    routing_key_headers: tuple[str, ...] = ("X-SMG-Routing-Key",)
    # SMG's --routing-key-override / --sticky-sessions: a routing key sticks to its worker on any policy (sticky.py).
    routing_key_override: bool = False
    # manual: how a new routing key is assigned, and how long an unused key stays pinned.
    assignment_mode: str = "random"
    max_idle_secs: float = 14400.0
    # bucket (prefill): the period of the prompt-length ranges' adjustment (and of the window they are made from).
    bucket_adjust_interval_secs: float = 5.0

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
        if self.power_of_two_load_metric not in POWER_OF_TWO_METRICS:
            found.append(f"--power-of-two-load-metric must be one of {', '.join(POWER_OF_TWO_METRICS)}, "
                         f"got {self.power_of_two_load_metric!r}")
        if not self.least_load_kv_pressure_weight >= 0:
            found.append("--least-load-kv-pressure-weight must not be negative, "
                         f"got {self.least_load_kv_pressure_weight}")
        if not self.least_load_default_throughput > 0:
            found.append(f"--least-load-default-throughput must be positive, got {self.least_load_default_throughput}")
        if self.least_load_mean_prefill_tokens < 1:
            found.append("--least-load-mean-prefill-tokens must be at least 1, "
                         f"got {self.least_load_mean_prefill_tokens}")
        if self.least_load_max_waiting_requests < 0:
            found.append("--least-load-max-waiting-requests must not be negative (0: off), "
                         f"got {self.least_load_max_waiting_requests}")
        if self.prefix_token_count < 1:
            found.append(f"--prefix-token-count must be at least 1, got {self.prefix_token_count}")
        if not self.prefix_hash_load_factor >= 1.0 or self.prefix_hash_load_factor == float("inf"):
            found.append("--prefix-hash-load-factor must be finite and at least 1.0, "
                         f"got {self.prefix_hash_load_factor}")
        if self.prefix_hash_balance_abs_threshold < 0:
            found.append("--prefix-hash-balance-abs-threshold must not be negative, "
                         f"got {self.prefix_hash_balance_abs_threshold}")
        if not self.routing_key_headers or not all(_is_header_name(h) for h in self.routing_key_headers):
            found.append(f"--routing-key-headers must be HTTP header names, got {list(self.routing_key_headers)}")
        if self.assignment_mode not in ASSIGNMENT_MODES:
            found.append(f"--assignment-mode must be one of {', '.join(ASSIGNMENT_MODES)}, "
                         f"got {self.assignment_mode!r}")
        if not self.max_idle_secs > 0:
            found.append(f"--max-idle-secs must be positive, got {self.max_idle_secs}")
        if not self.bucket_adjust_interval_secs > 0:
            found.append(f"--bucket-adjust-interval-secs must be positive, got {self.bucket_adjust_interval_secs}")
        return found


POWER_OF_TWO_METRICS = ("requests", "least_requests", "expected_wait")
ASSIGNMENT_MODES = ("random", "min_load", "min_group", "delegate")
# RFC 9110 token characters
_TCHAR = frozenset("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")


def _is_header_name(name: str) -> bool:
    return bool(name) and all(c in _TCHAR for c in name)
