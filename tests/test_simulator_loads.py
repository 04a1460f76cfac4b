"""The simulator's /v1/loads is SGLang 0.5.23's (docs/SGLANG_LOADS.md): which queue holds a request in each role
and phase, what num_waiting_reqs adds up, the token counts, the query parameters, one row per DP rank, and no
/get_load. tests/real/test_loads_vs_real.py checks the same states against a real 0.5.23 server."""

from __future__ import annotations

import asyncio

from simulator.fleet import Fleet
from tests.sim_support import FAST, get, pd_body, post

PROMPT_IDS = [1, 393, 390, 15, 88, 41, 77]  # seven tokens: token counts below are exact


async def loads(session, handle, query: str = "") -> dict:
    status, body = await get(session, handle.url + "/v1/loads" + query)
    assert status == 200, body
    return body


async def row(session, handle) -> dict:
    return (await loads(session, handle))["loads"][0]


async def row_when(session, handle, predicate, timeout: float = 10.0) -> dict:
    """The first row that `predicate` accepts (a row is what the server last published)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        r = await row(session, handle)
        if predicate(r):
            return r
        assert asyncio.get_running_loop().time() < deadline, f"no such row within {timeout} s: {r}"
        await asyncio.sleep(0.01)


def queues(r: dict) -> dict:
    d, q = r["disaggregation"], r["queues"]
    return {"running": r["num_running_reqs"], "waiting": r["num_waiting_reqs"],
            "bootstrap": d["prefill_bootstrap_queue_reqs"], "inflight": d["prefill_inflight_queue_reqs"],
            "prealloc": d["decode_prealloc_queue_reqs"], "transfer": d["decode_transfer_queue_reqs"],
            "retracted": d["decode_retracted_queue_reqs"], "q_waiting": q["waiting"],
            "prealloc_ready": q["prealloc_ready"]}


IDLE = dict(running=0, waiting=0, bootstrap=0, inflight=0, prealloc=0, transfer=0, retracted=0, q_waiting=0,
            prealloc_ready=0)


async def test_a_prefill_leg_alone_waits_in_the_bootstrap_queue(session):
    async with Fleet(1, 1, **FAST) as fleet:
        p = fleet.prefill[0]
        body = pd_body({"input_ids": PROMPT_IDS, "rid": "lonely", "sampling_params": {"max_new_tokens": 4}}, p)
        leg = asyncio.ensure_future(post(session, p.url + "/generate", body))
        await fleet.wait_for(p, lambda s: s["rids_by_phase"].get("bootstrap") == ["lonely"])
        r = await row(session, p)
        assert queues(r) == {**IDLE, "waiting": 1, "bootstrap": 1}
        assert (r["num_used_tokens"], r["num_total_tokens"], r["num_active_tokens"]) == (0, 7, 7)
        assert r["disaggregation"]["mode"] == "prefill"
        await post(session, p.url + "/abort_request", {"rid": "lonely"})
        status, _ = await leg
        assert status == 500
        assert queues(await row(session, p)) == IDLE


async def test_a_decode_leg_alone_holds_kv_in_the_transfer_queue(session):
    async with Fleet(1, 1, **FAST) as fleet:
        p, d = fleet.prefill[0], fleet.decode[0]
        body = pd_body({"input_ids": PROMPT_IDS, "rid": "lonely", "sampling_params": {"max_new_tokens": 4}}, p)
        leg = asyncio.ensure_future(post(session, d.url + "/generate", body))
        await fleet.wait_for(d, lambda s: s["rids_by_phase"].get("transfer") == ["lonely"])
        r = await row(session, d)
        # its KV room is taken (used), but its KV has not come: counted as waiting, not active
        assert queues(r) == {**IDLE, "waiting": 1, "transfer": 1}
        assert (r["num_used_tokens"], r["num_total_tokens"], r["num_active_tokens"]) == (7, 7, 0)
        assert r["num_waiting_uncached_tokens"] == 0
        await post(session, d.url + "/abort_request", {"rid": "lonely"})
        assert (await leg)[0] == 500


async def test_a_decode_short_of_kv_keeps_requests_in_the_prealloc_queue(session):
    """The decode's KV room is the bottleneck: a request whose handshake could be done waits in prealloc
    (queues.prealloc_ready), and its prefill partner waits in the prefill's bootstrap queue."""
    async with Fleet(1, 1, decode_step_s=0.01, decode_overrides={"max_total_tokens": 60}, **FAST) as fleet:
        p, d = fleet.prefill[0], fleet.decode[0]
        first = pd_body({"input_ids": PROMPT_IDS, "rid": "first", "sampling_params": {"max_new_tokens": 50}}, p)
        legs = [asyncio.ensure_future(post(session, w.url + "/generate", first)) for w in (p, d)]
        await fleet.wait_for(d, lambda s: s["rids_by_phase"].get("decode") == ["first"])
        second = pd_body({"input_ids": PROMPT_IDS, "rid": "second", "sampling_params": {"max_new_tokens": 50}}, p)
        legs += [asyncio.ensure_future(post(session, w.url + "/generate", second)) for w in (p, d)]
        await fleet.wait_for(d, lambda s: "second" in s["rids_by_phase"].get("waiting", []))
        await fleet.wait_for(p, lambda s: s["rids_by_phase"].get("bootstrap") == ["second"])
        # a decode running a batch publishes its row every 15 steps (0.5.23's --load-snapshot-publish-interval)
        r = await row_when(session, d, lambda r: r["num_waiting_reqs"] == 1)
        assert queues(r) == {**IDLE, "running": 1, "waiting": 1, "prealloc": 1, "prealloc_ready": 1}
        assert r["num_prealloc_ready_tokens"] == 7
        assert queues(await row(session, p)) == {**IDLE, "waiting": 1, "bootstrap": 1}
        assert [status for status, _ in await asyncio.gather(*legs)] == [200] * 4


async def test_a_prefill_sending_its_kv_counts_it_inflight_not_waiting(session):
    async with Fleet(1, 1, kv_transfer_s=0.5, **FAST) as fleet:
        p, d = fleet.prefill[0], fleet.decode[0]
        body = pd_body({"input_ids": PROMPT_IDS, "rid": "slow", "sampling_params": {"max_new_tokens": 2}}, p)
        legs = [asyncio.ensure_future(post(session, w.url + "/generate", body)) for w in (p, d)]
        await fleet.wait_for(p, lambda s: s["rids_by_phase"].get("transfer") == ["slow"])
        r = await row(session, p)
        assert queues(r) == {**IDLE, "inflight": 1}
        assert r["num_used_tokens"] == 8  # the prompt and the first token
        assert queues(await row(session, d)) == {**IDLE, "waiting": 1, "transfer": 1}
        assert [status for status, _ in await asyncio.gather(*legs)] == [200, 200]


async def test_include_dp_rank_and_prometheus_query_parameters(session):
    async with Fleet(1, 1, **FAST) as fleet:
        p = fleet.prefill[0]
        full = await loads(session, p)
        assert set(full) == {"timestamp", "version", "accelerator", "num_accelerators", "loads"}
        core = (await loads(session, p, "?include=core"))["loads"][0]
        assert not any(isinstance(v, dict) for v in core.values()) and "num_waiting_reqs" in core
        some = (await loads(session, p, "?include=disagg,queues"))["loads"][0]
        assert "disaggregation" in some and "queues" in some and "memory" not in some
        assert (await loads(session, p, "?include=all"))["loads"][0].keys() == full["loads"][0].keys()
        async with session.get(p.url + "/v1/loads?include=bogus") as resp:  # 0.5.23 raises outside its handler
            assert (resp.status, await resp.text()) == (500, "Internal Server Error")
        assert (await loads(session, p, "?dp_rank=0"))["loads"][0]["dp_rank"] == 0
        assert (await loads(session, p, "?dp_rank=1"))["loads"] == []
        status, body = await get(session, p.url + "/v1/loads?dp_rank=x")
        assert status == 400 and body["object"] == "error" and "dp_rank" in body["message"]
        async with session.get(p.url + "/v1/loads?format=prometheus") as resp:
            text = await resp.text()
        assert resp.status == 200 and resp.content_type == "text/plain"
        assert 'sglang_num_waiting_reqs{dp_rank="0"} 0' in text
        assert 'sglang_disagg_prefill_bootstrap_queue_reqs{dp_rank="0"} 0' in text
        assert "sglang_disagg_mode" not in text  # strings are not gauges


async def test_one_row_per_dp_rank_each_with_its_own_requests(session):
    async with Fleet(1, 1, dp_size=2, **FAST) as fleet:
        p = fleet.prefill[0]
        body = pd_body({"input_ids": PROMPT_IDS, "rid": "odd", "sampling_params": {"max_new_tokens": 2}}, p,
                       room=7)  # room 7 -> rank 1 (SGLang follows the bootstrap room)
        leg = asyncio.ensure_future(post(session, p.url + "/generate", body))
        await fleet.wait_for(p, lambda s: s["rids_by_phase"].get("bootstrap") == ["odd"])
        ranks = (await loads(session, p))["loads"]
        assert [r["dp_rank"] for r in ranks] == [0, 1]
        assert [r["num_waiting_reqs"] for r in ranks] == [0, 1]
        await post(session, p.url + "/abort_request", {"rid": "odd"})
        assert (await leg)[0] == 500


async def test_0_5_23_has_no_get_load_but_older_versions_do(session):
    async with Fleet(1, 1, **FAST) as fleet:
        status, body = await get(session, fleet.prefill[0].url + "/get_load")
        assert (status, body) == (404, {"detail": "Not Found"})
    async with Fleet(1, 1, sglang_version="0.5.6", **FAST) as fleet:
        status, body = await get(session, fleet.prefill[0].url + "/get_load")
        assert status == 200 and body[0]["num_waiting_reqs"] == 0
