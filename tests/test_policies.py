"""Each policy's choice (table-driven) and balance (seeded RNG); cache_aware's prefix index and guard."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

import pytest

from policies import PolicyParams, RequestInfo, ServerLoad, available_policies, effective_load, make_policy
from policies.cache_aware import CacheAwarePolicy, PrefixIndex, prefix_hashes


@dataclass(eq=False)
class W:
    id: str
    inflight: int = 0
    server_load: ServerLoad | None = None
    url: str = ""


def pool(*loads: int) -> list[W]:
    return [W(f"w{i}", inflight=n) for i, n in enumerate(loads)]


def req(text: str | None = None) -> RequestInfo:
    return RequestInfo(route="/generate", text=text)


# ---- effective load -----------------------------------------------------------------------------------
@pytest.mark.parametrize("inflight,snapshot,expected", [
    (3, None, 3),  # no report: router count
    (3, ServerLoad(running=1, waiting=0, inflight_at=1), 3),  # server saw only ours; 2 more routed since
    (3, ServerLoad(running=10, waiting=5, inflight_at=3), 15),  # others' traffic shows in the report
    (5, ServerLoad(running=10, waiting=0, inflight_at=3), 12),  # report + the 2 routed since
    (0, ServerLoad(running=4, waiting=0, inflight_at=6), 0),  # ours finished since: not below zero
    (7, ServerLoad(running=0, waiting=0, inflight_at=0), 7),  # requests not yet arrived: never below ours
])
def test_effective_load(inflight, snapshot, expected):
    assert effective_load(W("w", inflight, snapshot)) == expected


def test_every_policy_is_registered_and_unknown_names_fail():
    assert {"random", "round_robin", "least_inflight", "power_of_two", "cache_aware"} <= available_policies()
    for name in available_policies():
        policy = make_policy(name, rng=random.Random(0))
        assert policy.name == name
        assert policy.select(pool(0, 0), req("x")).id in ("w0", "w1")
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("nope")


# ---- random, round robin, least in-flight -------------------------------------------------------------
def test_random_is_seeded_and_uniform():
    workers = pool(0, 0, 0, 0)
    picks = [make_policy("random", rng=random.Random(7)).select(workers, req()).id for _ in range(3)]
    again = [make_policy("random", rng=random.Random(7)).select(workers, req()).id for _ in range(3)]
    assert picks == again
    policy = make_policy("random", rng=random.Random(1))
    counts = Counter(policy.select(workers, req()).id for _ in range(4000))
    assert set(counts) == {"w0", "w1", "w2", "w3"}
    assert all(850 < c < 1150 for c in counts.values()), counts


def test_round_robin_cycles_in_pool_order():
    policy = make_policy("round_robin")
    workers = pool(0, 0, 0)
    assert [policy.select(workers, req()).id for _ in range(7)] == ["w0", "w1", "w2", "w0", "w1", "w2", "w0"]
    # the pool shrinks (a worker left): the cursor wraps instead of failing
    assert policy.select(workers[:1], req()).id == "w0"


@pytest.mark.parametrize("loads,expected", [
    ((0, 1, 2), "w0"),
    ((5, 1, 2), "w1"),
    ((3, 3, 1), "w2"),
    ((2, 2, 2), "w0"),  # ties: pool order
])
def test_least_inflight_picks_the_fewest(loads, expected):
    assert make_policy("least_inflight").select(pool(*loads), req()).id == expected


# ---- power of two -------------------------------------------------------------------------------------
@pytest.mark.parametrize("a,b,expected", [
    (W("a", 1), W("b", 4), "a"),
    (W("a", 4), W("b", 1), "b"),
    # same router counts; the server reports traffic the router did not send
    (W("a", 2, ServerLoad(running=9, waiting=3, inflight_at=2)), W("b", 2, ServerLoad(2, 0, inflight_at=2)), "b"),
    # a stale low report cannot hide the router's own requests
    (W("a", 8, ServerLoad(running=0, waiting=0, inflight_at=0)), W("b", 3, ServerLoad(3, 0, inflight_at=3)), "b"),
])
def test_power_of_two_prefers_the_less_loaded_of_two(a, b, expected):
    for seed in range(5):  # with two candidates both are always sampled: the choice is the load's
        assert make_policy("power_of_two", rng=random.Random(seed)).select([a, b], req()).id == expected


def _spread(policy_name: str, seed: int) -> int:
    """Route 4000 requests into 8 workers whose requests each last a random while; worst max-min spread."""
    rng = random.Random(seed)
    policy = make_policy(policy_name, rng=random.Random(seed))
    workers = pool(*[0] * 8)
    active: list[tuple[int, W]] = []
    worst = 0
    for t in range(4000):
        still = []
        for end, w in active:
            if end <= t:
                w.inflight -= 1
            else:
                still.append((end, w))
        active = still
        w = policy.select(workers, req())
        w.inflight += 1
        active.append((t + rng.randint(10, 60), w))
        loads = [x.inflight for x in workers]
        worst = max(worst, max(loads) - min(loads))
    return worst


def test_power_of_two_balances_better_than_random():
    po2 = max(_spread("power_of_two", s) for s in range(3))
    rnd = min(_spread("random", s) for s in range(3))
    assert po2 < rnd, (po2, rnd)


# ---- cache_aware: the prefix index ---------------------------------------------------------------------
def test_prefix_hashes_name_chunk_aligned_prefixes():
    a = prefix_hashes("abcdefgh", 3)  # abc, abcdef, abcdefgh
    b = prefix_hashes("abcdXYgh", 3)
    assert len(a) == 3 and a[:1] == b[:1] and a[1] != b[1]
    assert prefix_hashes("", 3) == []


def test_prefix_index_evicts_deepest_prefixes_first_and_keeps_matches_consistent():
    index = PrefixIndex()
    old = prefix_hashes("system prompt A: question one", 4)
    new = prefix_hashes("system prompt B: question two", 4)
    index.insert(old)
    index.insert(new)
    assert index.matched_chunks(old) == len(old) and index.matched_chunks(new) == len(new)
    shared = 3  # "syst", "em p", "romp" are common to both
    assert len(index) == len(old) + len(new) - shared
    index.trim(len(new) + 2)
    # the old prompt lost its deepest chunks only: its match shrank from the end, the new one is whole
    assert index.matched_chunks(new) == len(new)
    assert index.matched_chunks(old) == shared + 2
    assert index.trim(0) == len(new) + 2 and index.matched_chunks(new) == 0


# ---- cache_aware: choice ---------------------------------------------------------------------------------
PROMPT = "You are a helpful assistant. Answer briefly and cite sources. " * 4


def cache_aware(**params) -> CacheAwarePolicy:
    return make_policy("cache_aware", PolicyParams(**params))


def test_cache_aware_sticks_to_the_worker_holding_the_prefix():
    policy = cache_aware(prefix_chunk_chars=8)
    workers = pool(0, 0, 0, 0)
    first = policy.select(workers, req(PROMPT + "Q1"))
    first.inflight += 1  # a small load difference does not break affinity
    for i in range(2, 10):
        assert policy.select(workers, req(PROMPT + f"Q{i}")) is first
    assert policy.decisions["cache_hit"] == 8 and policy.decisions["cache_miss"] == 1
    assert policy.state()["estimated_hit_ratio"] > 0.8


def test_cache_aware_spreads_unrelated_prompts_to_the_least_loaded():
    policy = cache_aware(prefix_chunk_chars=8)
    workers = pool(3, 0, 2)
    assert policy.select(workers, req("completely different text")).id == "w1"
    assert policy.decisions == {"cache_miss": 1}
    # equal loads: the worker remembering least gets a new prefix
    policy = cache_aware(prefix_chunk_chars=8)
    workers = pool(0, 0)
    policy.select(workers, req("first topic, some words"))  # w0 (ties: first)
    assert policy.select(workers, req("second topic, other words")).id == "w1"


@pytest.mark.parametrize("threshold,suffix_len,expected_reason", [
    (0.3, 20, "cache_hit"),    # match covers most of the prompt
    (0.9, 600, "cache_miss"),  # a long new suffix: the match ratio falls under the threshold
    (0.0, 600, "cache_hit"),   # threshold 0: any match wins
])
def test_cache_aware_threshold(threshold, suffix_len, expected_reason):
    policy = cache_aware(cache_threshold=threshold, prefix_chunk_chars=8)
    workers = pool(0, 0)
    holder = policy.select(workers, req(PROMPT))
    holder.inflight += 1  # so that a miss goes to the other worker
    chosen = policy.select(workers, req(PROMPT + "z" * suffix_len))
    assert policy.decisions[expected_reason] == (1 if expected_reason == "cache_hit" else 2)
    assert (chosen is holder) == (expected_reason == "cache_hit")


@pytest.mark.parametrize("holder_load,other_load,abs_t,rel_t,balanced_away", [
    (10, 0, 4, 1.5, True),    # 10 - 0 > 4 and 10 > 1.5 * 0: guard fires
    (10, 8, 1, 1.5, False),   # 10 > 8 * 1.5 is false: still cache
    (10, 8, 4, 1.1, False),   # 10 - 8 > 4 is false: still cache
    (20, 10, 4, 1.5, True),   # both exceeded
    (64, 0, 64, 1.5, False),  # at the abs threshold exactly: not imbalanced
])
def test_cache_aware_balance_guard(holder_load, other_load, abs_t, rel_t, balanced_away):
    policy = cache_aware(balance_abs_threshold=abs_t, balance_rel_threshold=rel_t, prefix_chunk_chars=8)
    holder, other = W("h"), W("o")
    assert policy.select([holder, other], req(PROMPT)) is holder
    holder.inflight, other.inflight = holder_load, other_load
    chosen = policy.select([holder, other], req(PROMPT + "next question"))
    assert (chosen is other) == balanced_away
    assert policy.decisions["balance"] == int(balanced_away)


def test_cache_aware_hot_prefix_cannot_overload_one_server():
    """Every request shares one prefix and none finishes: the guard caps the spread at the abs threshold."""
    policy = cache_aware(balance_abs_threshold=8, balance_rel_threshold=1.5, prefix_chunk_chars=8)
    workers = pool(0, 0, 0)
    for i in range(300):
        policy.select(workers, req(PROMPT + str(i))).inflight += 1
    loads = [w.inflight for w in workers]
    assert max(loads) - min(loads) <= 8 + 1, loads
    assert policy.decisions["cache_hit"] > 0 and policy.decisions["balance"] > 0


def test_cache_aware_uses_server_reported_load_in_the_guard():
    policy = cache_aware(balance_abs_threshold=4, prefix_chunk_chars=8)
    holder, other = W("h"), W("o")
    policy.select([holder, other], req(PROMPT))
    holder.server_load = ServerLoad(running=30, waiting=10)  # busy with traffic the router did not send
    assert policy.select([holder, other], req(PROMPT)) is other


def test_cache_aware_eviction_bounds_memory_and_forgets_removed_workers():
    policy = cache_aware(prefix_chunk_chars=4, max_tree_size=40, eviction_interval_secs=5)  # 10 chunks
    assert policy.maintenance_interval == 5
    w = W("w")
    policy.select([w], req("a" * 80))  # 20 chunks: within the 2x hard bound, trimmed by the sweep
    assert policy.state()["trees"]["w"]["chunks"] == 20
    policy.maintain()
    assert policy.state()["trees"]["w"] == {"chunks": 10, "chars": 40} and policy.evicted == 10
    policy.select([w], req("b" * 200))  # 50 new chunks: beyond 2x, trimmed at once
    assert policy.state()["trees"]["w"]["chunks"] == 10
    policy.on_worker_removed(w)
    assert policy.state()["trees"] == {}


def test_cache_aware_without_text_goes_to_the_least_loaded():
    policy = cache_aware()
    assert policy.select(pool(2, 1), req(None)).id == "w1"
    assert policy.decisions == {"no_text": 1}


@pytest.mark.parametrize("params,fragment", [
    ({"cache_threshold": 1.5}, "--cache-threshold"),
    ({"cache_threshold": -0.1}, "--cache-threshold"),
    ({"balance_abs_threshold": -1}, "--balance-abs-threshold"),
    ({"balance_rel_threshold": 0.5}, "--balance-rel-threshold"),
    ({"max_tree_size": 0}, "--max-tree-size"),
    ({"eviction_interval_secs": 0}, "--eviction-interval-secs"),
    ({"prefix_chunk_chars": 0}, "--prefix-chunk-chars"),
])
def test_policy_params_are_validated(params, fragment):
    problems = PolicyParams(**params).problems()
    assert any(fragment in p for p in problems), problems
    with pytest.raises(ValueError, match=fragment):
        CacheAwarePolicy(PolicyParams(**params))


def test_all_param_problems_are_reported_at_once():
    assert len(PolicyParams(cache_threshold=2, balance_rel_threshold=0, eviction_interval_secs=-1).problems()) == 3
