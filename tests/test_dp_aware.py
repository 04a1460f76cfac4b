"""`--dp-aware` in front of simulated DP servers that follow 0.5.23's rank rules (docs/DP_RANKS.md): the ranks
are read from /server_info, each leg gets its rank and the prefill rank is named on both (no conflict, the
decode pulls the right KV), a busy rank gets fewer requests, in-flight is counted per rank and released, the
admin view and metrics show the ranks; without --dp-aware a DP fleet serves as before; a client's rank out of
range is a 400 JSON that leaves nothing counted."""

from __future__ import annotations

import asyncio

import pytest

from router.core.config import DpRanksConfig, LoadMonitorConfig
from simulator import expected_generation
from simulator.fleet import Fleet
from tests.sim_support import FAST, get, pd_body, post

from .helpers import wait_for

DP2 = dict(FAST, dp_size=2, enable_dp_attention=True, bootstrap_timeout_s=5.0, kv_wait_timeout_s=5.0)
AWARE = DpRanksConfig(aware=True)
FAST_POLL = LoadMonitorConfig(interval_secs=0.05, timeout_secs=1.0)


async def prefilled_per_rank(session, handle) -> list[int]:
    status, body = await get(session, handle.url + "/v1/loads")
    assert status == 200
    return [r["total_prefill_uncached_tokens"] for r in body["loads"]]


async def generate(client, i: int):
    prompt = f"Tell me about topic {i}, please."
    resp = await client.post("/generate", json={"text": prompt, "sampling_params": {"max_new_tokens": 3}})
    body = await resp.json()
    assert resp.status == 200, body
    assert body["text"] == expected_generation(prompt, max_new_tokens=3).text
    return body


async def test_dp_aware_reads_ranks_and_serves_every_request_on_both_ranks(make_router, session):
    async with Fleet(1, 1, **DP2) as fleet:
        client = await make_router(fleet.prefill, fleet.decode, dp_ranks=AWARE, load_monitor=FAST_POLL)
        p, d = client.registry.workers()
        assert (p.dp_ranks, p.attention_dp, d.dp_ranks) == (2, True, 2)
        for i in range(8):
            await generate(client, i)
        per_rank = await prefilled_per_rank(session, fleet.prefill[0])
        assert all(tokens > 0 for tokens in per_rank), per_rank  # both prefill ranks served (not room % 2 luck)
        await wait_for(lambda: p.rank_inflight == [0, 0] and d.rank_inflight == [0, 0] and p.inflight == 0)
        state = (await fleet.state(fleet.prefill[0]))["counters"]
        assert state["bootstrap_failures"] == 0 and state["kv_pulls_served"] == 8


async def test_a_busy_prefill_rank_gets_clearly_fewer_requests(make_router, session):
    async with Fleet(1, 1, **DP2) as fleet:
        prefill = fleet.prefill[0]
        # six requests parked on prefill rank 1 (no decode partner: they wait in its bootstrap queue)
        parked = [asyncio.ensure_future(post(session, prefill.url + "/generate", pd_body(
            {"text": f"parked {k}", "rid": f"parked-{k}", "routed_dp_rank": 1, "disagg_prefill_dp_rank": 1,
             "sampling_params": {"max_new_tokens": 2}}, prefill))) for k in range(6)]
        await fleet.wait_for(prefill, lambda s: len(s["rids_by_phase"].get("bootstrap", [])) == 6)
        client = await make_router(fleet.prefill, fleet.decode, dp_ranks=AWARE, load_monitor=FAST_POLL)
        p = client.registry.workers()[0]
        await wait_for(lambda: p.server_load is not None and p.server_load.report.ranks[1].waiting == 6)
        before = await prefilled_per_rank(session, prefill)
        for i in range(10):
            await generate(client, i)
        after = await prefilled_per_rank(session, prefill)
        served = [after[r] - before[r] for r in (0, 1)]
        assert served[0] > 0 and served[1] == 0, served  # the idle rank took them all
        status, workers = await get(session, str(client.make_url("/workers")))
        row = next(w for w in workers["workers"] if w["url"] == prefill.url)
        assert row["dp_ranks"] == 2 and [r["waiting"] for r in row["ranks"]][1] == 6
        metrics = await (await client.get("/metrics")).text()
        labels = f'role="prefill",worker="{prefill.url}"'
        assert f'pd_router_worker_dp_ranks{{{labels}}} 2.0' in metrics
        assert f'pd_router_worker_rank_requests{{dp_rank="1",{labels}}} 6.0' in metrics
        assert f'pd_router_worker_rank_inflight{{dp_rank="0",{labels}}} 0.0' in metrics
        for k in range(6):
            await post(session, prefill.url + "/abort_request", {"rid": f"parked-{k}"})
        await asyncio.gather(*parked)


async def test_without_dp_aware_a_dp_fleet_serves_as_before_ranks_following_the_room(make_router):
    async with Fleet(1, 1, **DP2) as fleet:
        client = await make_router(fleet.prefill, fleet.decode)
        for i in range(6):
            await generate(client, i)
        counters = (await fleet.state(fleet.prefill[0]))["counters"]
        assert counters["bootstrap_failures"] == 0 and counters["kv_pulls_served"] == 6
        assert client.registry.workers()[0].rank_inflight == []  # nothing counted per rank


@pytest.mark.parametrize("aware", [True, False])
async def test_client_ranks_are_checked_and_honoured_on_both_legs(make_router, session, aware):
    async with Fleet(1, 1, **DP2) as fleet:
        client = await make_router(fleet.prefill, fleet.decode, **({"dp_ranks": AWARE} if aware else {}))
        for bad in ({"routed_dp_rank": 2}, {"data_parallel_rank": -1}, {"routed_dp_rank": "1"},
                    {"disagg_prefill_dp_rank": 7}):
            resp = await client.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2},
                                                        **bad})
            body = await resp.json()
            assert resp.status == 400, body
            assert "dp_rank" in body["error"]["message"]
        # a client's own rank: both legs on it, the prefill's conflict check passes whatever the room
        before = await prefilled_per_rank(session, fleet.prefill[0])
        for i in range(4):
            resp = await client.post("/generate", json={"text": f"pinned {i}", "routed_dp_rank": 1,
                                                        "sampling_params": {"max_new_tokens": 2}})
            assert resp.status == 200, await resp.text()
        after = await prefilled_per_rank(session, fleet.prefill[0])
        assert after[0] == before[0] and after[1] > before[1]
        await wait_for(lambda: all(w.inflight == 0 and not any(w.rank_inflight)
                                   for w in client.registry.workers()))


def test_what_0_5_23_refuses_to_switch_on_an_attention_dp_server():
    from router.core.dp_ranks import rank_count, switch_refusal
    assert rank_count({"dp_size": 1, "attn_dp_size": 4}) == 4 and rank_count({"dp_size": 3}) == 3
    assert rank_count({}) == 1 and rank_count(None) == 1
    plain = {"dp_size": 2, "attn_dp_size": 1, "enable_pd_role_switch": False}
    assert switch_refusal(plain) is None  # DP replicas: 0.5.23's own answer decides
    dpa = {"dp_size": 1, "attn_dp_size": 2, "enable_dp_attention": True, "enable_pd_role_switch": True}
    assert switch_refusal(dpa) is None
    assert "--enable-pd-role-switch is not set" in switch_refusal({**dpa, "enable_pd_role_switch": False})
    message = switch_refusal({**dpa, "ep_size": 2, "moe_a2a_backend": "deepep"})
    assert message.startswith("--enable-pd-role-switch does not rebuild role-specific state for the following "
                              "features: expert parallelism (--ep-size 2), MoE all-to-all (--moe-a2a-backend "
                              "deepep)")


@pytest.mark.parametrize("switchable", [False, True])
async def test_converting_an_attention_dp_server_is_refused_up_front_unless_0_5_23_would_switch_it(
        make_router, switchable):
    async with Fleet(2, 2, enable_pd_role_switch=switchable, **DP2) as fleet:
        client = await make_router(fleet.prefill, fleet.decode, dp_ranks=AWARE)
        handle = fleet.decode[1]
        resp = await client.post("/pd_role_switch", json={"worker_url": handle.url, "new_role": "prefill"})
        body = await resp.json()
        worker = next(w for w in client.registry.workers() if w.url == handle.url)
        if not switchable:
            assert resp.status == 409, body
            assert "--enable-pd-role-switch is not set on this server" in body["error"]["message"]
            assert (await fleet.state(handle))["counters"]["role_switches"] == 0  # never asked, never drained
            assert worker.routable and worker.role.value == "decode"
            return
        assert resp.status == 200, body
        await wait_for(lambda: worker.role.value == "prefill" and worker.routable, timeout=10)
        for i in range(4):
            await generate(client, i)


async def test_a_dp_prefill_sigkilled_mid_request_leaves_no_rank_counted_and_requests_retry(make_router):
    async with Fleet(2, 1, processes=True, prefill_overhead_s=0.2, **DP2) as fleet:
        client = await make_router(fleet.prefill, fleet.decode, dp_ranks=AWARE, load_monitor=FAST_POLL,
                                   prefill_policy="round_robin")
        victim = next(w for w in client.registry.workers() if w.url == fleet.prefill[0].url)
        requests = [asyncio.ensure_future(generate(client, i)) for i in range(8)]
        await wait_for(lambda: sum(victim.rank_inflight) >= 2, timeout=10)
        fleet.kill(fleet.prefill[0])  # mid-forward: its legs fail, the requests go to the other prefill
        await asyncio.gather(*requests)  # every one answered in full (generate checks the text)
        await wait_for(lambda: all(not any(w.rank_inflight) and w.inflight == 0
                                   for w in client.registry.workers()), timeout=10)
