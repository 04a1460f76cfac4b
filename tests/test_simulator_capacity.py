"""The simulator's capacity model (simulator/capacity.py): one prefill forward at a time batching the requests that
waited, continuous-batching decode with a running cap, their counters in /v1/loads; and the prefix cache
(cached_tokens, cache_hit_rate)."""

from __future__ import annotations

import asyncio

import pytest

from simulator.config import WorkerConfig
from simulator.fleet import Fleet
from simulator.prefix_cache import PrefixCache
from simulator.tokens import encode
from tests.helpers import wait_for
from tests.sim_support import FAST, get, pd_generate

LONG = " ".join(f"word{i}" for i in range(200))  # ~200 tokens


async def load_of(session, handle) -> dict:
    status, body = await get(session, handle.url + "/v1/loads")
    assert status == 200
    return body["loads"][0]


async def state_of(fleet, handle) -> dict:
    return await fleet.state(handle)


async def test_one_forward_at_a_time_batches_the_requests_that_waited(session):
    """SGLang's prefill: one forward at a time; those that arrive meanwhile wait and go together in the next."""
    async with Fleet(1, 3, prefill_concurrency=1, prefill_per_token_s=0.004, **FAST) as fleet:
        body = {"text": LONG, "sampling_params": {"max_new_tokens": 2}}
        first = asyncio.ensure_future(pd_generate(session, fleet, {**body, "rid": "a"}, d=0))
        await fleet.wait_for(fleet.prefill[0], lambda s: "a" in s["rids_by_phase"].get("forward", []))
        rest = [asyncio.ensure_future(pd_generate(session, fleet, {**body, "rid": rid}, d=d))
                for d, rid in ((1, "b"), (2, "c"))]
        state = await fleet.wait_for(fleet.prefill[0], lambda s: sorted(s["rids_by_phase"].get("waiting", [])) == ["b", "c"])
        assert state["rids_by_phase"]["forward"] == ["a"]
        load = await load_of(session, fleet.prefill[0])
        # a prefill never reports a running batch; during a forward its row is the one published before it:
        # the forward's request still waiting, those that came since not there yet (0.5.23 publishes after
        # every forward)
        assert (load["num_running_reqs"], load["num_waiting_reqs"], load["queues"]["waiting"]) == (0, 1, 1)
        for result in await asyncio.gather(first, *rest):
            assert [status for status, _ in result] == [200, 200]
        state = await state_of(fleet, fleet.prefill[0])
        assert state["capacity"][0]["forwards"] == 2  # a alone, then b and c in one forward
        load = await load_of(session, fleet.prefill[0])
        assert (load["num_running_reqs"], load["num_waiting_reqs"]) == (0, 0)
        assert load["total_prefill_uncached_tokens"] == state["counters"]["prompt_tokens"]
        # three prompts of ~200 tokens at 4 ms each: two forwards, at least ~1.6 s of busy time
        assert load["total_prefill_busy_us"] >= 0.9 * 0.004 * state["counters"]["prompt_tokens"] * 1e6


async def test_max_prefill_tokens_bounds_a_forward(session):
    async with Fleet(1, 3, prefill_concurrency=1, prefill_per_token_s=0.003, max_prefill_tokens=250,
                     **FAST) as fleet:
        body = {"text": LONG, "sampling_params": {"max_new_tokens": 2}}
        first = asyncio.ensure_future(pd_generate(session, fleet, {**body, "rid": "a"}, d=0))
        await fleet.wait_for(fleet.prefill[0], lambda s: "a" in s["rids_by_phase"].get("forward", []))
        rest = [asyncio.ensure_future(pd_generate(session, fleet, {**body, "rid": rid}, d=d))
                for d, rid in ((1, "b"), (2, "c"))]
        await asyncio.gather(first, *rest)
        assert (await state_of(fleet, fleet.prefill[0]))["capacity"][0]["forwards"] == 3  # ~200 + 200 > 250


async def test_without_a_limit_forwards_overlap(session):
    async with Fleet(1, 2, prefill_per_token_s=0.004, **FAST) as fleet:
        body = {"text": LONG, "sampling_params": {"max_new_tokens": 2}}
        both = asyncio.gather(pd_generate(session, fleet, body, d=0), pd_generate(session, fleet, body, d=1))
        await fleet.wait_for(fleet.prefill[0], lambda s: len(s["rids_by_phase"].get("forward", [])) == 2)
        await both


async def test_decode_steps_give_every_request_of_the_batch_a_token(session):
    """Continuous batching: one step loop per server, each step one token for each request in the batch,
    accumulated in /v1/loads' decode_moments (steps, batch sizes, step time, squares, products, tokens)."""
    async with Fleet(1, 1, decode_step_s=0.01, decode_step_per_running_s=0.002, **FAST) as fleet:
        body = {"text": "short prompt", "sampling_params": {"max_new_tokens": 10}}
        results = await asyncio.gather(*(pd_generate(session, fleet, body) for _ in range(3)))
        assert all(len(d_out["output_ids"]) == 10 for _, (_, d_out) in results)
        steps, batch_sum, time_sum, squares, products, tokens = (await load_of(session, fleet.decode[0]))[
            "decode_moments"]
        assert tokens == batch_sum == 27  # the first token of each comes with the KV, nine steps each
        assert steps < 27 and squares > batch_sum  # the three shared steps
        assert time_sum >= steps * 0.012 * 1e6 * 0.9 and products > time_sum  # a step of n costs more
        assert (await load_of(session, fleet.prefill[0]))["decode_moments"] is None


async def test_a_full_batch_leaves_requests_in_the_decode_waiting_queue(session):
    async with Fleet(1, 1, decode_step_s=0.01, decode_overrides={"max_running_requests": 1}, **FAST) as fleet:
        first = asyncio.ensure_future(pd_generate(session, fleet, {"text": "a", "rid": "first",
                                                                   "sampling_params": {"max_new_tokens": 100}}))
        await fleet.wait_for(fleet.decode[0], lambda s: "first" in s["rids_by_phase"].get("decode", []))
        second = asyncio.ensure_future(pd_generate(session, fleet, {"text": "b", "rid": "second",
                                                                    "sampling_params": {"max_new_tokens": 2}}))
        await fleet.wait_for(fleet.decode[0], lambda s: "second" in s["rids_by_phase"].get("queued", []))
        load = await load_of(session, fleet.decode[0])
        assert load["num_waiting_reqs"] == 0  # the row published when the batch began: seen at its 15th step

        async def shown():
            nonlocal load
            load = await load_of(session, fleet.decode[0])
            return load["num_waiting_reqs"] == 1
        await wait_for(shown, timeout=10)
        assert (load["num_running_reqs"], load["num_waiting_reqs"], load["queues"]["waiting"]) == (1, 1, 1)
        assert load["disaggregation"]["decode_transfer_queue_reqs"] == 0  # its KV is there already
        for result in await asyncio.gather(first, second):
            assert [status for status, _ in result] == [200, 200]


async def test_an_abort_frees_a_request_waiting_for_a_prefill_slot(session):
    async with Fleet(1, 2, prefill_concurrency=1, prefill_per_token_s=0.01, **FAST) as fleet:
        first = asyncio.ensure_future(pd_generate(session, fleet, {"text": LONG, "rid": "first",
                                                                    "sampling_params": {"max_new_tokens": 2}}, d=0))
        second = asyncio.ensure_future(pd_generate(session, fleet, {"text": LONG, "rid": "second",
                                                                     "sampling_params": {"max_new_tokens": 2}}, d=1))

        async def second_waiting():
            state = await fleet.state(fleet.prefill[0])
            return "second" in state["rids_by_phase"].get("waiting", [])
        await wait_for(second_waiting, timeout=10)
        for handle in (fleet.prefill[0], fleet.decode[1]):
            async with session.post(handle.url + "/abort_request", json={"rid": "second"}) as resp:
                assert resp.status == 200
        (p_status, p_body), _ = await second
        assert p_status == 500 and "Aborted" in p_body["message"]  # as any abort before the KV went out
        (p1, _), (d1, _) = await first
        assert (p1, d1) == (200, 200)  # the slot went to nobody else: the first one finished normally
        state = await fleet.state(fleet.prefill[0])
        assert not any(state["rids_by_phase"].values())


async def test_prefix_cache_reports_cached_tokens_and_hit_rate(session):
    async with Fleet(1, 1, prefix_cache_tokens=10_000, **FAST) as fleet:
        shared = "You are a careful assistant. " * 10
        (_, first), _ = await pd_generate(session, fleet, {"text": shared + "first question",
                                                           "sampling_params": {"max_new_tokens": 2}})
        (_, second), _ = await pd_generate(session, fleet, {"text": shared + "second question",
                                                            "sampling_params": {"max_new_tokens": 2}})
        assert first["meta_info"]["cached_tokens"] == 0
        # the shared words (and BOS) are cached; the differing tail is not
        common = len(encode(shared))
        assert common - 1 <= second["meta_info"]["cached_tokens"] <= common + 1
        state = await fleet.state(fleet.prefill[0])
        counters = state["counters"]
        assert counters["cached_tokens"] == second["meta_info"]["cached_tokens"]
        assert counters["prefill_tokens"] == first["meta_info"]["prompt_tokens"] + second["meta_info"]["prompt_tokens"]
        load = await load_of(session, fleet.prefill[0])
        assert load["cache_hit_rate"] == round(counters["cached_tokens"] / counters["prefill_tokens"], 4) > 0


async def test_no_prefix_cache_by_default(session):
    async with Fleet(1, 1, **FAST) as fleet:
        for _ in range(2):
            (_, out), _ = await pd_generate(session, fleet, {"text": "same prompt again",
                                                             "sampling_params": {"max_new_tokens": 2}})
            assert out["meta_info"]["cached_tokens"] == 0


def test_prefix_cache_matches_evicts_deepest_first_and_keeps_one_token_to_compute():
    cache = PrefixCache(capacity_tokens=6)
    cache.insert([1, 2, 3, 4])
    assert cache.match([1, 2, 3, 4]) == 3  # the last token is always computed
    assert cache.match([1, 2, 9]) == 2 and cache.match([7]) == 0
    cache.insert([1, 2, 5, 6])  # 6 entries: 1, 12, 123, 1234, 125, 1256
    cache.insert([1, 2, 5, 6, 7])  # 7 > 6: the least recently used deepest prefix (1234) goes
    assert len(cache) == 6
    assert cache.match([1, 2, 3, 4, 0]) == 3 and cache.match([1, 2, 5, 6, 7, 0]) == 5


def test_capacity_knobs_are_validated():
    with pytest.raises(ValueError, match="prefill_concurrency"):
        WorkerConfig(prefill_concurrency=-1)
    with pytest.raises(ValueError, match="max_prefill_tokens, dp_size"):
        WorkerConfig(dp_size=0)
    with pytest.raises(ValueError, match="load_snapshot_publish_interval"):
        WorkerConfig(load_snapshot_publish_interval=0)


async def test_decode_batch_counts_requests_decoding_not_those_waiting_for_kv(session):
    """A decode server holds KV for a request whose prefill is still running, but that request is not in
    the decode batch: only decoding requests set the step time."""
    async with Fleet(1, 1, prefill_per_token_s=0.005, decode_step_s=0.05, **FAST) as fleet:
        engine = fleet.decode[0].worker.engine
        decoding = asyncio.ensure_future(pd_generate(session, fleet, {"text": "short",
                                                                      "sampling_params": {"max_new_tokens": 40}}))
        await wait_for(lambda: engine.decoding == 1, timeout=10)
        waiting = asyncio.ensure_future(pd_generate(session, fleet, {"text": LONG,  # ~1 s of prefill
                                                                     "sampling_params": {"max_new_tokens": 2}}))
        await wait_for(lambda: engine.running == 2, timeout=10)
        assert engine.decoding == 1
        for (p, _), (d, _) in await asyncio.gather(decoding, waiting):
            assert (p, d) == (200, 200)
        assert engine.decoding == 0 and engine.running == 0


async def test_a_released_hang_lets_the_generation_finish(session):
    """POST /_sim/faults replaces the faults object: a decode loop must see the release (it used to spin)."""
    async with Fleet(1, 1, **FAST) as fleet:
        await fleet.set_faults(fleet.decode[0], hang_after_tokens=2)
        engine = fleet.decode[0].worker.engine
        pending = asyncio.ensure_future(pd_generate(session, fleet, {"text": "stall me",
                                                                     "sampling_params": {"max_new_tokens": 6}}))
        await wait_for(lambda: any(len(r.output_ids) == 2 for r in engine.requests.values()), timeout=10)
        await fleet.set_faults(fleet.decode[0], hang_after_tokens=None)
        (p, _), (d, out) = await asyncio.wait_for(pending, 10)
        assert (p, d) == (200, 200) and len(out["output_ids"]) == 6
