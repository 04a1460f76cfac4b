"""Policies inside the router (fake workers): every policy routes, cache_aware keeps prefixes together,
power_of_two reads the servers' reports, the admin API shows and changes policy and rebalancer state."""

from __future__ import annotations

import re

import pytest

from policies import ServerLoad
from policies.rebalance import RebalanceMode, RebalanceConfig
from router.server.cli import config_from_args
from router.core.config import ConfigError, LoadMonitorConfig
from router.dataplane.proxy import PROXY
from router.flows.rebalancer import REBALANCER
from router.core.registry import Role

from .rebalance_support import PREFILL_HEAVY, advance
from .helpers import wait_for

NO_POLL = {"load_monitor": LoadMonitorConfig(enabled=False)}


def received(workers) -> list[int]:
    return [len(w.bodies()) for w in workers]


@pytest.mark.parametrize("policy", ["random", "round_robin", "least_inflight", "power_of_two", "cache_aware"])
async def test_every_policy_routes_through_the_router(sim_workers, make_router, policy):
    p1, p2, d1, d2 = await sim_workers(2, 2)
    client = await make_router([p1, p2], [d1, d2], prefill_policy=policy, decode_policy=policy)
    for i in range(12):
        resp = await client.post("/generate", json={"text": f"prompt number {i} " * 3})
        assert resp.status == 200
    assert sum(received([p1, p2])) == 12 and sum(received([d1, d2])) == 12
    if policy in ("round_robin", "power_of_two"):  # sequential requests: both get some
        assert all(received([p1, p2])) and all(received([d1, d2]))
    await wait_for(lambda: all(w.inflight == 0 for w in client.registry.workers()))


async def test_cache_aware_keeps_each_shared_prefix_on_one_prefill(sim_workers, make_router):
    p1, p2, d = await sim_workers(2, 1)
    client = await make_router([p1, p2], [d], prefill_policy="cache_aware", **NO_POLL)
    systems = {"A": "You are a pirate. Always answer in pirate speech, with nautical metaphors. ",
               "B": "You are a lawyer. Answer formally, cite statutes, and add a disclaimer at the end. "}
    for i in range(10):
        for key, system in systems.items():
            resp = await client.post("/v1/chat/completions", json={
                "model": "m", "messages": [{"role": "system", "content": system},
                                           {"role": "user", "content": f"question {key}{i}"}]})
            assert resp.status == 200
    where = {key: set() for key in systems}
    for worker in (p1, p2):
        for body in worker.bodies("/v1/chat/completions"):
            where[body["messages"][1]["content"][9]].add(worker.url)
    assert all(len(urls) == 1 for urls in where.values()), where
    assert where["A"] != where["B"], "two prefixes, two idle prefills: they spread"
    state = client.app[PROXY].policies[Role.PREFILL].state()
    assert state["decisions"]["cache_hit"] == 18 and state["decisions"]["cache_miss"] == 2


async def test_power_of_two_avoids_a_server_that_reports_load(sim_workers, make_router):
    p, d1, d2 = await sim_workers(1, 2)
    client = await make_router([p], [d1, d2], decode_policy="power_of_two", **NO_POLL)
    busy = client.registry.find(d1.url)
    busy.server_load = ServerLoad(running=40, waiting=10)  # traffic the router did not send
    for i in range(6):
        assert (await client.post("/generate", json={"text": f"q{i}"})).status == 200
    assert received([d1, d2]) == [0, 6]


async def test_cache_aware_forgets_a_removed_worker(sim_workers, make_router):
    p1, p2, d = await sim_workers(2, 1)
    client = await make_router([p1, p2], [d], prefill_policy="cache_aware", **NO_POLL)
    assert (await client.post("/generate", json={"text": "some prompt text"})).status == 200
    policy = client.app[PROXY].policies[Role.PREFILL]
    (holder,) = policy.state()["trees"]
    assert (await client.delete(f"/workers/{holder}")).status == 200
    assert holder not in policy.state()["trees"]


async def test_admin_policies_shows_each_pool_with_the_servers_reports(sim_workers, make_router):
    p, d = await sim_workers(1, 1)
    client = await make_router([p], [d], prefill_policy="cache_aware", decode_policy="power_of_two",
                               load_monitor=LoadMonitorConfig(interval_secs=0.05))
    await wait_for(lambda: all(w.server_load is not None for w in client.registry.workers()))
    resp = await client.get("/admin/policies")
    assert resp.status == 200
    body = await resp.json()
    assert body["pools"]["prefill"]["policy"]["name"] == "cache_aware"
    assert body["pools"]["decode"]["policy"]["name"] == "power_of_two"
    (decode,) = body["pools"]["decode"]["workers"]
    assert decode["url"] == d.url and decode["server_load"]["running"] == 0
    assert body["params"]["cache_threshold"] == 0.3
    assert body["load_monitor"]["rounds"] >= 1 and body["load_monitor"]["failures"] == 0


async def test_admin_rebalancer_get_and_put(sim_workers, make_router):
    p, d = await sim_workers(1, 1)
    client = await make_router([p], [d])
    body = await (await client.get("/admin/rebalancer")).json()
    assert body["mode"] == "advisory" and body["config"]["horizon_secs"] == 120
    resp = await client.put("/admin/rebalancer", json={"mode": "enabled", "horizon_secs": 300})
    assert resp.status == 200
    body = await resp.json()
    assert (body["mode"], body["config"]["horizon_secs"]) == ("enabled", 300)
    assert client.app[REBALANCER].config.horizon_secs == 300
    assert body["refill"]["enabled"] is True  # refilling an empty pool comes with the rebalancer enabled
    body = await (await client.put("/admin/rebalancer", json={"mode": "off", "refill_empty_pool": True})).json()
    assert (body["mode"], body["refill"]["enabled"]) == ("off", True)  # recovery alone


@pytest.mark.parametrize("payload,status,fragment", [
    ({"bogus": 1}, 400, "bogus"),
    ({}, 400, "at least one field"),
    ([1, 2], 400, "JSON object"),
    ({"mode": "sometimes"}, 422, "mode"),
    ({"min_gain": 2}, 422, "min_gain"),
    ({"refill_empty_pool": "yes"}, 422, "refill_empty_pool"),
    ({"horizon_secs": -1}, 422, "horizon_secs"),
    ({"confirmations": 3}, 400, "confirmations"),  # the retired rules' knob: unknown
])
async def test_admin_rebalancer_rejects_bad_bodies(sim_workers, make_router, payload, status, fragment):
    p, d = await sim_workers(1, 1)
    client = await make_router([p], [d])
    resp = await client.put("/admin/rebalancer", json=payload)
    assert resp.status == status
    assert fragment in (await resp.json())["error"]["message"]
    assert client.app[REBALANCER].config.mode.value == "advisory"


async def test_admin_rebalancer_limit_is_validated(sim_workers, make_router):
    p, d = await sim_workers(1, 1)
    client = await make_router([p], [d])
    assert (await client.get("/admin/rebalancer?limit=x")).status == 400
    assert (await client.get("/admin/rebalancer?limit=0")).status == 200


async def test_the_rebalancer_sees_latencies_measured_by_the_router(sim_workers, make_router):
    p, d = await sim_workers(1, 1)
    client = await make_router([p], [d])
    for i in range(4):
        resp = await client.post("/generate", json={"text": f"q{i}", "stream": True})
        assert resp.status == 200
        await resp.read()
    summary = client.app[REBALANCER].window.summary(client.app[REBALANCER].clock(), 1)
    assert summary["samples"] == 4 and summary["ttft_s"] is not None and summary["itl_s"] is not None


def test_policy_and_rebalancer_flags():
    c = config_from_args("--prefill http://a:1 --decode http://c:3 --policy cache_aware --cache-threshold 0.5 "
                         "--balance-abs-threshold 32 --balance-rel-threshold 1.0001 --max-tree-size 1024 "
                         "--eviction-interval-secs 30 --rebalance enabled --rebalance-horizon-secs 90 "
                         "--rebalance-min-decode 2 --load-poll-interval-secs 0.5".split(), env={})
    p = c.policy_params
    assert (p.cache_threshold, p.balance_abs_threshold, p.balance_rel_threshold, p.max_tree_size,
            p.eviction_interval_secs) == (0.5, 32, 1.0001, 1024, 30)
    assert (c.rebalance.mode.value, c.rebalance.horizon_secs, c.rebalance.min_decode) == ("enabled", 90, 2)
    assert c.load_monitor.interval_secs == 0.5 and c.prefill_policy == "cache_aware"
    assert c.rebalance.refill_empty_pool is False and c.rebalance.refills  # enabled: refills come with it
    alone = config_from_args("--prefill http://a:1 --decode http://c:3 --rebalance off "
                             "--rebalance-refill-empty-pool --rebalance-attainment-target 0.95".split(), env={})
    assert (alone.rebalance.mode.value, alone.rebalance.refill_empty_pool, alone.rebalance.refills) == ("off", True, True)
    assert alone.rebalance.attainment_target == 0.95


def test_the_retired_rules_flags_still_start_and_are_named_in_one_warning():
    """The pressure-ratio rules' knobs are gone with them: a command line naming them starts, and says they do
    nothing (and what replaced them)."""
    c = config_from_args("--prefill http://a:1 --decode http://c:3 --rebalance enabled --rebalance-confirmations 2 "
                         "--rebalance-cooldown-secs 10 --rebalance-queue-target 1".split(), env={})
    (warning,) = [w for w in c.compat_warnings if "rebalance" in w]
    for flag in ("--rebalance-confirmations", "--rebalance-cooldown-secs", "--rebalance-queue-target"):
        assert flag in warning
    assert "--rebalance-horizon-secs" in warning
    plain = config_from_args("--prefill http://a:1 --decode http://c:3 --rebalance enabled".split(), env={})
    assert not [w for w in plain.compat_warnings if "rebalance" in w]


def test_bad_policy_flags_are_all_reported():
    with pytest.raises(ConfigError) as info:
        config_from_args("--prefill http://a:1 --decode http://c:3 --cache-threshold 2 "
                         "--balance-rel-threshold 0.5 --rebalance-min-gain 2 "
                         "--load-poll-interval-secs 0".split(), env={})
    text = str(info.value)
    for fragment in ("--cache-threshold", "--balance-rel-threshold", "min_gain", "--load-poll-interval"):
        assert fragment in text


async def test_least_inflight_routes_around_a_worker_still_holding_a_request(fake_fleet, make_router):
    p1, p2, d = await fake_fleet(2, 1)
    client = await make_router([p1, p2], [d], prefill_policy="least_inflight", **NO_POLL)
    p1.behaviour.hang = True  # the first prefill leg stays open after decode has answered
    assert (await client.post("/generate", json={"text": "first"})).status == 200
    await wait_for(lambda: p1.in_handler == 1)
    for i in range(3):
        assert (await client.post("/generate", json={"text": f"next {i}"})).status == 200
    assert received([p1, p2]) == [1, 3]
    p1.release.set()
    await wait_for(lambda: all(w.inflight == 0 for w in client.registry.workers()))


class _Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _prefill_heavy(client):
    """Looks at the fleet while its counters say 11 long prompts a second arrive (two prefills saturate):
    the first conversion the rebalancer decides, else its last decision."""
    rebalancer = client.app[REBALANCER]
    clock = _Clock(rebalancer.clock())
    rebalancer.clock = clock
    decision = rebalancer.tick()
    for _ in range(3):
        if decision.convert:
            break
        advance(client.registry, clock, 5, PREFILL_HEAVY)
        decision = rebalancer.tick()
    return decision


QUICK_REBALANCE = dict(warmup_secs=0, interval_secs=3600, ttft_target_secs=2.0, itl_target_secs=0.2)  # ticks: the test's


async def test_enabled_rebalancer_converts_through_the_conversion_flow(sim_workers, make_router):
    p1, p2, d1, d2 = await sim_workers(2, 2)
    client = await make_router([p1, p2], [d1, d2], **NO_POLL,
                               rebalance=RebalanceConfig(mode=RebalanceMode.ENABLED, **QUICK_REBALANCE))
    rebalancer = client.app[REBALANCER]
    decision = _prefill_heavy(client)
    assert decision.convert and decision.to_role == "prefill", decision.reason
    await wait_for(lambda: rebalancer.conversions, timeout=10)
    (done,) = rebalancer.conversions
    assert done["ok"] is True, done
    moved = client.registry.get(decision.worker_id)
    assert moved.role is Role.PREFILL and moved.routable
    fake = d1 if moved.url == d1.url else d2
    assert fake.role == "prefill" and fake.switch_calls[0]["new_role"] == "prefill"
    record = await (await client.get(f"/admin/conversions/{done['conversion_id']}")).json()
    assert record["worker_id"] == decision.worker_id and any("rebalancer" in note for note in record["notes"])
    body = await (await client.get("/admin/rebalancer")).json()
    assert body["counters"]["conversions_succeeded"] == 1 and body["conversions"][0]["ok"] is True
    # the requests keep flowing through the new shape of the fleet
    assert (await client.post("/generate", json={"text": "after"})).status == 200


async def test_advisory_rebalancer_only_records_what_it_would_do(sim_workers, make_router):
    p1, p2, d1, d2 = await sim_workers(2, 2)
    client = await make_router([p1, p2], [d1, d2], **NO_POLL, rebalance=RebalanceConfig(**QUICK_REBALANCE))
    decision = _prefill_heavy(client)
    assert decision.convert, decision.reason
    body = await (await client.get("/admin/rebalancer")).json()
    last = body["decisions"][-1]
    assert last["applied"] == "advisory" and last["worker_id"] == decision.worker_id and last["reason"]
    assert body["counters"]["would_convert"] == 1
    assert not d1.switch_calls and not d2.switch_calls
    assert [w.role for w in client.registry.workers()].count(Role.DECODE) == 2


async def test_rebalancer_and_policy_state_in_metrics(sim_workers, make_router):
    p1, p2, d1, d2 = await sim_workers(2, 2)
    client = await make_router([p1, p2], [d1, d2], prefill_policy="cache_aware", **NO_POLL,
                               rebalance=RebalanceConfig(**QUICK_REBALANCE))
    assert _prefill_heavy(client).convert
    assert (await client.post("/generate", json={"text": "counted"})).status == 200
    text = await (await client.get("/metrics")).text()
    assert 'pd_router_rebalancer_mode{mode="advisory"} 1.0' in text
    assert 'pd_router_rebalancer_conversions_total{outcome="advised"} 1.0' in text
    assert 'pd_router_rebalancer_decisions_total{action="convert"} 1.0' in text
    (load,) = re.findall(r'pd_router_pool_load\{role="prefill"\} ([0-9.]+)', text)
    assert float(load) == pytest.approx(11 * 0.2056 / 2, rel=0.05)  # 11/s x 0.2056 s on two prefills
    assert 'pd_router_rebalancer_predicted_attainment{split="current"} 0.0' in text
    assert 'pd_router_policy_decisions_total{decision="cache_miss",policy="cache_aware",role="prefill"} 1.0' in text
    assert f'pd_router_worker_reported_requests{{role="prefill",state="waiting",worker="{p1.url}"}} 12.0' in text
