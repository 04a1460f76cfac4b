"""Each policy routes through the simulated fleet (the real PD bootstrap protocol), cache_aware raises the
prefix-cache hits the servers report, and the load monitor reads the simulator's /v1/loads."""

from __future__ import annotations

import pytest

from router.core.config import LoadMonitorConfig
from router.control.load_monitor import LOAD_MONITOR
from simulator import expected_generation
from simulator.fleet import Fleet
from tests.sim_support import FAST

from .helpers import wait_for


@pytest.mark.parametrize("policy", ["random", "round_robin", "least_inflight", "power_of_two", "cache_aware"])
async def test_each_policy_routes_through_the_simulated_fleet(make_router, policy):
    async with Fleet(2, 2, **FAST) as fleet:
        client = await make_router(fleet.prefill, fleet.decode, prefill_policy=policy, decode_policy=policy)
        for i in range(6):
            prompt = f"Tell me about topic {i}, please."
            resp = await client.post("/generate", json={"text": prompt, "sampling_params": {"max_new_tokens": 4}})
            assert resp.status == 200
            assert (await resp.json())["text"] == expected_generation(prompt, max_new_tokens=4).text
        served = [(await fleet.state(h))["counters"]["kv_pulls_served"] for h in fleet.prefill]
        pulled = [(await fleet.state(h))["counters"]["kv_pulls_made"] for h in fleet.decode]
        assert sum(served) == 6 and sum(pulled) == 6
        await wait_for(lambda: all(w.inflight == 0 for w in client.registry.workers()))


async def cached_share(fleet) -> float:
    cached = prefilled = 0
    for handle in fleet.prefill:
        counters = (await fleet.state(handle))["counters"]
        cached += counters["cached_tokens"]
        prefilled += counters["prefill_tokens"]
    return cached / prefilled


@pytest.mark.parametrize("policy", ["cache_aware", "round_robin"])
async def test_cache_aware_turns_shared_prefixes_into_cache_hits(make_router, policy):
    """7 system prompts of ~85 tokens; each server caches 400 tokens (4 prompts), so spreading every prompt
    over both servers thrashes their caches while keeping each prompt on one server fits them."""
    systems = [f"System prompt number {k}: " + "be precise and kind. " * 20 for k in range(7)]
    async with Fleet(2, 1, prefix_cache_tokens=400, **FAST) as fleet:
        client = await make_router(fleet.prefill, fleet.decode, prefill_policy=policy)
        for i in range(4):
            for system in systems:
                resp = await client.post("/generate", json={"text": system + f"question {i}",
                                                            "sampling_params": {"max_new_tokens": 2}})
                assert resp.status == 200
        share = await cached_share(fleet)
        if policy == "cache_aware":  # every prompt is computed once, then hits: about 3/4 of all tokens
            assert share > 0.6, share
        else:  # round robin alternates each prompt between the servers: LRU thrash
            assert share < 0.2, share


async def test_the_load_monitor_reads_the_simulators_reports(make_router):
    async with Fleet(1, 1, **FAST) as fleet:
        client = await make_router(fleet.prefill, fleet.decode, load_monitor=LoadMonitorConfig(interval_secs=0.05))
        monitor = client.app[LOAD_MONITOR]
        await wait_for(lambda: monitor.rounds >= 2)
        assert monitor.failures == 0
        assert all(w.server_load is not None and w.server_load.token_usage == 0.0
                   for w in client.registry.workers())
