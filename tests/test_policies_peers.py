"""The peers' policies as plugins (issue 23): the hash ring, consistent_hashing and manual (routing keys),
prefix_hash, least_load and power_of_two's metrics, bucket. Pure selection: seeded RNGs, a fake clock."""

from __future__ import annotations

import random
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass

import pytest
from multidict import CIMultiDict

from policies import PolicyParams, RequestInfo, ServerLoad, make_policy
from policies import manual as manual_module
from policies.bucket import BucketPolicy
from policies.hash_ring import HashRing, routing_key, stable_hash
from policies.load_report import LoadReport
from policies.manual import ManualPolicy


@dataclass(eq=False)
class W:
    id: str
    inflight: int = 0
    server_load: ServerLoad | None = None

    @property
    def url(self) -> str:
        return f"http://{self.id}:30000"


def pool(n: int, **kw) -> list[W]:
    return [W(f"w{i}", **kw) for i in range(n)]


def req(text: str | None = None, headers: dict | None = None, batch: int = 1) -> RequestInfo:
    return RequestInfo(route="/generate", text=text, batch_size=batch,
                       headers=CIMultiDict(headers) if headers is not None else None)


def keyed(key: str) -> RequestInfo:
    return req(headers={"X-SMG-Routing-Key": key})


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# ---- the ring and the routing key -------------------------------------------------------------------------
def test_stable_hash_is_the_same_in_another_process():
    # Python's hash() of a str changes with PYTHONHASHSEED; the ring's must not (replicas agree on owners)
    code = "from policies.hash_ring import stable_hash; print(stable_hash('session-42'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30,
                         env={"PYTHONHASHSEED": "123", "PATH": ""}, cwd=str(__import__("pathlib").Path(
                             __file__).resolve().parent.parent))
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) == stable_hash("session-42")


def test_ring_spreads_keys_and_a_new_worker_takes_only_its_share():
    workers = pool(3)
    ring = HashRing()
    ring.include(w.url for w in workers)
    keys = [f"user-{i}" for i in range(3000)]
    before = {k: ring.owner(k, workers).id for k in keys}
    counts = Counter(before.values())
    assert all(700 < c < 1300 for c in counts.values()), counts
    grown = workers + [W("w3")]
    ring.include(w.url for w in grown)
    after = {k: ring.owner(k, grown).id for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert all(after[k] == "w3" for k in moved), "a key moves only to the new worker"
    assert 450 < len(moved) < 1050, len(moved)  # about a quarter


def test_ring_skips_a_worker_out_of_routing_and_gives_its_keys_back():
    workers = pool(3)
    ring = HashRing()
    ring.include(w.url for w in workers)
    keys = [f"k{i}" for i in range(300)]
    owners = {k: ring.owner(k, workers) for k in keys}
    lost = [k for k in keys if owners[k] is workers[1]]
    assert lost
    without = [workers[0], workers[2]]
    assert all(ring.owner(k, without) is not workers[1] for k in lost)
    assert all(ring.owner(k, without) is owners[k] for k in keys if k not in lost), "the others' keys stay"
    assert all(ring.owner(k, workers) is owners[k] for k in keys), "back in routing: its keys come back"


@pytest.mark.parametrize("headers,names,expected", [
    ({"X-SMG-Routing-Key": "a"}, ("X-SMG-Routing-Key",), "a"),
    ({"x-smg-routing-key": "a"}, ("X-SMG-Routing-Key",), "a"),  # header names are case-insensitive
    ({"X-SMG-Routing-Key": ""}, ("X-SMG-Routing-Key",), None),  # empty: no key
    ({"X-Session": "s", "X-User": "u"}, ("X-User", "X-Session"), "u"),  # the first listed that is present
    ({"X-Session": "s"}, ("X-User", "X-Session"), "s"),
    ({}, ("X-SMG-Routing-Key",), None),
])
def test_routing_key_is_the_first_listed_header_present(headers, names, expected):
    assert routing_key(CIMultiDict(headers), names) == expected
    assert routing_key(None, names) is None


# ---- consistent_hashing ------------------------------------------------------------------------------------
def test_consistent_hashing_sends_a_key_to_one_worker_and_spreads_keys():
    policy = make_policy("consistent_hashing", rng=random.Random(0))
    workers = pool(4)
    for key in ("alice", "bob", "carol"):
        assert len({policy.select(workers, keyed(key)).id for _ in range(20)}) == 1
    owners = Counter(policy.select(workers, keyed(f"user-{i}")).id for i in range(400))
    assert len(owners) == 4 and min(owners.values()) > 50, owners
    # the same key finds the same owner whatever order the pool lists its workers in
    assert policy.select(list(reversed(workers)), keyed("alice")) is policy.select(workers, keyed("alice"))


def test_consistent_hashing_target_worker_header_then_key_then_client_headers():
    policy = make_policy("consistent_hashing", rng=random.Random(0))
    workers = pool(3)
    assert policy.select(workers, req(headers={"X-SMG-Target-Worker": "2", "X-SMG-Routing-Key": "a"})) is workers[2]
    # no such index (the worker left): the key decides instead of failing the request
    by_key = policy.select(workers, keyed("a"))
    assert policy.select(workers, req(headers={"X-SMG-Target-Worker": "7", "X-SMG-Routing-Key": "a"})) is by_key
    assert policy.select(workers, req(headers={"X-SMG-Target-Worker": "-1", "X-SMG-Routing-Key": "a"})) is by_key
    # no key: the client's Authorization keeps it on one worker
    assert len({policy.select(workers, req(headers={"Authorization": "Bearer t1"})).id for _ in range(10)}) == 1
    # nothing to go by: random (seeded), every worker gets some
    assert len({policy.select(workers, req(headers={})).id for _ in range(60)}) == 3
    assert policy.state()["decisions"] == {"target_worker": 1, "routing_key": 3, "implicit_key": 10, "random": 60}


def test_consistent_hashing_reads_the_configured_headers():
    policy = make_policy("consistent_hashing", PolicyParams(routing_key_headers=("X-Session-Id",)),
                         rng=random.Random(0))
    workers = pool(4)
    owners = {policy.select(workers, req(headers={"X-Session-Id": f"s{i}"})).id for i in range(40)}
    assert len(owners) > 1
    # the default header is not read when others are configured: keyless requests are random
    assert len({policy.select(workers, keyed("same")).id for _ in range(40)}) > 1


def test_consistent_hashing_forgets_a_removed_worker():
    policy = make_policy("consistent_hashing", rng=random.Random(0))
    workers = pool(3)
    policy.select(workers, keyed("x"))
    assert policy.state()["ring_workers"] == 3
    policy.on_worker_removed(workers[0])
    policy.select(workers[1:], keyed("x"))
    assert policy.state()["ring_workers"] == 2


# ---- manual -----------------------------------------------------------------------------------------------
def test_manual_pins_a_key_and_a_new_worker_moves_no_key():
    policy = make_policy("manual", rng=random.Random(3))
    workers = pool(3)
    first = {k: policy.select(workers, keyed(k)) for k in (f"chat-{i}" for i in range(30))}
    assert len({w.id for w in first.values()}) == 3  # random assignment spreads the new keys
    grown = workers + [W("w3")]
    assert all(policy.select(grown, keyed(k)) is w for k, w in first.items()), "no key moves to the new worker"
    decisions = policy.state()["decisions"]
    assert decisions == {"new_key": 30, "hit": 30}


def test_manual_reassigns_a_key_only_while_its_worker_is_away_then_returns_it():
    policy = make_policy("manual", rng=random.Random(0))
    workers = pool(3)
    home = policy.select(workers, keyed("k"))
    others = [w for w in workers if w is not home]
    away = policy.select(others, keyed("k"))
    assert away is not home
    assert policy.select(others, keyed("k")) is away, "stays where it was re-assigned"
    assert policy.select(workers, keyed("k")) is home, "back to its first worker when that one returns"
    assert policy.pinned("k") == [home.url, away.url]


@pytest.mark.parametrize("mode,loads,keys_before,expected", [
    ("min_load", [5, 1, 3], {}, "w1"),
    ("min_load", [0, 0, 9], {}, None),  # a tie between w0 and w1: either
    ("min_group", [0, 0, 0], {"w0": 2, "w1": 0, "w2": 1}, "w1"),  # fewest keys pinned, whatever the load
])
def test_manual_assignment_modes(mode, loads, keys_before, expected):
    policy = make_policy("manual", PolicyParams(assignment_mode=mode), rng=random.Random(0))
    workers = [W(f"w{i}", inflight=n) for i, n in enumerate(loads)]
    for wid, count in keys_before.items():
        for j in range(count):
            target = next(w for w in workers if w.id == wid)
            policy._pins[f"old-{wid}-{j}"] = manual_module._Pin(target.url, 0)
            policy._keys_per_worker[target.url] += 1
    chosen = policy.select(workers, keyed("new"))
    if expected is None:
        assert chosen.id in ("w0", "w1")
    else:
        assert chosen.id == expected


def test_manual_min_group_spreads_new_keys_evenly():
    policy = make_policy("manual", PolicyParams(assignment_mode="min_group"), rng=random.Random(0))
    workers = pool(3)
    counts = Counter(policy.select(workers, keyed(f"k{i}")).id for i in range(30))
    assert counts == {"w0": 10, "w1": 10, "w2": 10}


def test_manual_forgets_idle_keys_and_bounds_their_number(monkeypatch):
    clock = Clock()
    policy = ManualPolicy(PolicyParams(max_idle_secs=60), random.Random(0), clock=clock)
    workers = pool(2)
    policy.select(workers, keyed("old"))
    clock.now += 30
    policy.select(workers, keyed("recent"))
    clock.now += 40  # "old" idle 70 s, "recent" 40 s
    policy.maintain()
    assert policy.pinned("old") == [] and policy.pinned("recent")
    assert policy.state()["evicted_keys"] == 1
    monkeypatch.setattr(manual_module, "MAX_KEYS", 3)
    for i in range(5):
        policy.select(workers, keyed(f"flood-{i}"))
    assert policy.state()["keys"] == 3 and policy.pinned("recent") == []  # least recently used go first


def test_manual_without_a_key_pins_nothing():
    policy = make_policy("manual", PolicyParams(assignment_mode="min_load"))
    workers = [W("w0", inflight=4), W("w1", inflight=1)]
    assert policy.select(workers, req(headers={})) is workers[1]
    assert policy.select(workers, req()) is workers[1]
    assert policy.state()["keys"] == 0 and policy.state()["decisions"] == {"no_key": 2}


def test_manual_refuses_bad_params():
    with pytest.raises(ValueError, match="--assignment-mode"):
        make_policy("manual", PolicyParams(assignment_mode="sticky"))
    with pytest.raises(ValueError, match="--max-idle-secs"):
        make_policy("manual", PolicyParams(max_idle_secs=0))


# ---- prefix_hash --------------------------------------------------------------------------------------------
def test_prefix_hash_keeps_a_shared_start_together_and_spreads_others():
    policy = make_policy("prefix_hash", PolicyParams(prefix_token_count=8))  # the first 32 characters
    workers = pool(4)
    system = "You are a helpful assistant.    "  # 32 characters
    assert len({policy.select(workers, req(system + f"question {i}")).id for i in range(20)}) == 1
    owners = Counter(policy.select(workers, req(f"{i:04d} another start, long enough")).id for i in range(200))
    assert len(owners) == 4, owners
    assert policy.state()["decisions"]["ring_hit"] == 220


@pytest.mark.parametrize("owner_load,others,expected_owner", [
    (3, [2, 2, 2], True),  # mean (9 + 1) / 4 = 2.5: 3 is not over 1.25 x 2.5
    (30, [0, 1, 0], False),  # over 1.25 x the mean (8) and over it by 22 (> 10): gives way
    (14, [2, 2, 2], True),  # over 1.25 x the mean (5) but over it by only 9 requests: stays
])
def test_prefix_hash_gives_way_only_when_the_owner_is_overloaded(owner_load, others, expected_owner):
    policy = make_policy("prefix_hash", PolicyParams(prefix_token_count=4))
    workers = pool(4)
    owner = policy.select(workers, req("same prompt"))
    rest = [w for w in workers if w is not owner]
    owner.inflight = owner_load
    for w, n in zip(rest, others):
        w.inflight = n
    chosen = policy.select(workers, req("same prompt"))
    if expected_owner:
        assert chosen is owner
    else:
        assert chosen is not owner and chosen.inflight == 0
        assert policy.state()["decisions"]["load_balance"] == 1


def test_prefix_hash_without_a_prompt_takes_the_least_loaded():
    policy = make_policy("prefix_hash")
    workers = [W("w0", inflight=3), W("w1", inflight=0), W("w2", inflight=2)]
    assert policy.select(workers, req(None)) is workers[1]
    assert policy.state()["decisions"] == {"no_text": 1}


def test_prefix_hash_counts_the_servers_reports():
    policy = make_policy("prefix_hash", PolicyParams(prefix_token_count=4))
    workers = pool(3)
    owner = policy.select(workers, req("prompt"))
    owner.server_load = ServerLoad(running=40, waiting=0)  # traffic the router did not send
    assert policy.select(workers, req("prompt")) is not owner


# ---- least_load and power_of_two's metrics ------------------------------------------------------------------
def loaded(wid: str, queued: int = 0, usage: float = 0.0, throughput: float = 0.0, waiting: int = 0,
           taken_at: float = 1.0, inflight: int = 0) -> W:
    report = LoadReport(running=0, waiting=waiting, waiting_uncached_tokens=queued, gen_throughput=throughput,
                        token_usage=usage)
    return W(wid, inflight=inflight, server_load=ServerLoad(running=0, waiting=waiting, token_usage=usage,
                                                            taken_at=taken_at, report=report))


@pytest.mark.parametrize("workers,expected", [
    ([loaded("a", queued=8000), loaded("b", queued=2000)], "b"),  # less queued prefill work
    # a faster server drains more work sooner: 8000 / 4000 tok/s beats 3000 / 1000 tok/s
    ([loaded("a", queued=8000, throughput=4000), loaded("b", queued=3000, throughput=1000)], "a"),
    # the KV barrier: an almost full KV loses to a queue of 2000 tokens (1 s at the default rate)
    ([loaded("a", usage=0.95), loaded("b", queued=2000, usage=0.1)], "b"),
    ([loaded("a", usage=0.5), loaded("b", usage=0.2)], "b"),
])
def test_least_load_scores_drain_time_plus_kv_pressure(workers, expected):
    assert make_policy("least_load").select(workers, req()).id == expected


def test_least_load_credits_what_it_routed_until_the_next_report():
    policy = make_policy("least_load")
    a, b = loaded("a"), loaded("b")
    picks = [policy.select([a, b], req()).id for _ in range(10)]
    assert Counter(picks) == {"a": 5, "b": 5}, "equal reports: arrivals between polls are spread, not piled"
    # a fresh report of b (idle) clears its credit: the next requests go to b until the credits even out again
    b.server_load = loaded("b", taken_at=2.0).server_load
    assert [policy.select([a, b], req()).id for _ in range(5)] == ["b"] * 5
    # a batch counts as its sequences
    policy2 = make_policy("least_load")
    c, d = loaded("c"), loaded("d")
    assert policy2.select([c, d], req(batch=4)).id == "c"
    assert [policy2.select([c, d], req()).id for _ in range(4)] == ["d"] * 4


def test_least_load_without_reports():
    policy = make_policy("least_load")
    # none reports: the router's count decides
    assert policy.select([W("a", inflight=3), W("b", inflight=1)], req()).id == "b"
    # one reports (idle), the other does not: the silent one is scored by its count at the pool's rate
    reported, silent = loaded("r", queued=0), W("s", inflight=2)
    assert policy.select([silent, reported], req()) is reported
    assert policy.state()["decisions"] == {"no_reports": 1, "reports": 1}


def test_least_load_leaves_out_workers_at_the_waiting_cap():
    policy = make_policy("least_load", PolicyParams(least_load_max_waiting_requests=4))
    full, free = loaded("full", waiting=4), loaded("free", waiting=0, queued=50_000)
    assert policy.select([full, free], req()) is free
    both_full = [loaded("x", waiting=5), loaded("y", waiting=9, queued=10)]
    assert policy.select(both_full, req()).id == "x", "all at the cap: none is left out"
    assert policy.state()["decisions"]["capped"] == 2


@pytest.mark.parametrize("metric,expected", [
    ("requests", "b"),  # effective_load: a reports 30 requests, b 5
    ("least_requests", "a"),  # the router's count alone: a 1, b 4
    ("expected_wait", "a"),  # the servers' drain time: a has nothing queued, b 8000 tokens
])
def test_power_of_two_load_metrics(metric, expected):
    a = W("a", inflight=1, server_load=ServerLoad(running=30, waiting=0, inflight_at=1, taken_at=1.0,
                                                   report=LoadReport(running=30, waiting=0)))
    b = W("b", inflight=4, server_load=ServerLoad(running=1, waiting=0, inflight_at=0, taken_at=1.0,
                                                   report=LoadReport(running=1, waiting=0,
                                                                     waiting_uncached_tokens=8000)))
    for seed in range(4):
        policy = make_policy("power_of_two", PolicyParams(power_of_two_load_metric=metric), rng=random.Random(seed))
        assert policy.select([a, b], req()).id == expected


def test_unknown_power_of_two_metric_is_a_problem():
    assert any("--power-of-two-load-metric" in p for p in PolicyParams(power_of_two_load_metric="tokens").problems())


# ---- bucket (prefill) ---------------------------------------------------------------------------------------
def test_bucket_starts_with_an_even_split_of_lengths():
    policy = BucketPolicy(PolicyParams(balance_abs_threshold=10**9), clock=Clock())
    workers = pool(2)
    assert policy.select(workers, req("x" * 100)) is workers[0]
    assert policy.select(workers, req("x" * 3000)) is workers[1]
    assert [(lo, hi) for _, lo, hi in policy.ranges()] == [(0, 2047), (2048, None)]


def test_bucket_moves_its_ranges_to_even_out_the_characters():
    clock = Clock()
    policy = BucketPolicy(PolicyParams(balance_abs_threshold=10**9), clock=clock)
    workers = pool(2)
    # the traffic is all short: the even split sends all of it to w0
    for i in range(100):
        policy.select(workers, req("x" * (100 + i)))
    assert {w.id for w in workers} - {policy.select(workers, req("x" * 150)).id} == {"w1"}
    policy.maintain()
    (_, _, cut), _ = policy.ranges()
    assert 100 < cut < 200, policy.ranges()
    short, longer = policy.select(workers, req("x" * 110)), policy.select(workers, req("x" * 190))
    assert (short.id, longer.id) == ("w0", "w1")
    assert policy.adjustments == 1
    policy.maintain()  # the same traffic: within a factor 2 of the share the ranges were made for
    assert policy.adjustments == 1


def test_bucket_balance_guard_and_window():
    clock = Clock()
    policy = BucketPolicy(PolicyParams(balance_abs_threshold=1400, balance_rel_threshold=1.5,
                                       bucket_adjust_interval_secs=5), clock=clock)
    workers = pool(2)
    for _ in range(5):
        assert policy.select(workers, req("x" * 300)) is workers[0]
    # w0 holds 1500 characters of the window, w1 none: imbalanced, the next goes to w1 whatever its length
    assert policy.select(workers, req("x" * 300)) is workers[1]
    assert policy.state()["decisions"] == {"bucket": 5, "balance": 1}
    clock.now += 6  # the window has moved on: balanced again, the ranges decide
    assert policy.select(workers, req("x" * 300)) is workers[0]


def test_bucket_a_missing_owner_and_a_removed_worker():
    policy = BucketPolicy(PolicyParams(balance_abs_threshold=10**9), clock=Clock())
    a, b, c = pool(3)
    policy.select([a, b, c], req("x"))
    # c's range (the longest prompts) while c is out of routing: the least loaded routable one
    assert policy.select([a, b], req("x" * 5000)) is b
    assert policy.state()["decisions"]["elsewhere"] == 1
    policy.on_worker_removed(c)
    assert [u for u, _, _ in policy.ranges()] == [a.url, b.url]
    assert [(lo, hi) for _, lo, hi in policy.ranges()] == [(0, 2047), (2048, None)]


def test_passthrough_takes_the_first_routable_worker():
    policy = make_policy("passthrough")
    workers = pool(3)
    assert [policy.select(workers, req()).id for _ in range(3)] == ["w0"] * 3
    assert policy.select(workers[1:], req()).id == "w1"


def test_bucket_asks_for_the_prompt_text():
    assert make_policy("bucket").needs_text and make_policy("prefix_hash").needs_text
    assert not make_policy("least_load").needs_text and not make_policy("manual").needs_text
