"""/generate on simulated workers: PD legs, answer shapes, batches, rids, streaming, validation."""

from __future__ import annotations

import asyncio

import pytest

from simulator.fleet import Fleet
from simulator.tokens import encode, expected_generation
from tests.sim_support import FAST, get, pd_body, pd_generate, post

PROMPT = "Hello world, this is"


async def test_pd_answer_is_the_expected_generation(fleet, session):
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 8}, "rid": "r-1"}
    (ps, pout), (ds, dout) = await pd_generate(session, fleet, body)
    want = expected_generation(PROMPT, max_new_tokens=8)
    assert (ps, ds) == (200, 200)
    assert dout["output_ids"] == want.output_ids and dout["text"] == want.text
    assert dout["meta_info"]["finish_reason"] == {"type": "length", "length": 8}
    assert dout["meta_info"]["prompt_tokens"] == len(encode(PROMPT)) == want.prompt_tokens
    assert dout["meta_info"]["id"] == "r-1" and dout["meta_info"]["weight_version"] == "default"
    assert dout["meta_info"]["weight_versions"] == [{"version": "default", "start": 0, "end": 8}]
    # the prefill leg: one token, finish length 0
    assert pout["output_ids"] == want.output_ids[:1]
    assert pout["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert pout["meta_info"]["completion_tokens"] == 1
    d_state = await fleet.state(fleet.decode[0])
    p_state = await fleet.state(fleet.prefill[0])
    assert d_state["counters"]["kv_pulls_made"] == 1 and d_state["counters"]["kv_mismatches"] == 0
    assert p_state["counters"]["kv_pulls_served"] == 1


async def test_meta_info_keys_in_sglang_order(fleet, session):
    (_, pout), (_, dout) = await pd_generate(session, fleet, {"text": PROMPT, "sampling_params": {"max_new_tokens": 2}})
    keys = ["id", "finish_reason", "prompt_tokens", "weight_version", "num_retractions", "reasoning_tokens",
            "completion_tokens", "cached_tokens", "weight_versions", "cached_tokens_details", "dp_rank",
            "e2e_latency", "response_sent_to_client_ts"]
    assert list(dout["meta_info"]) == keys and list(pout["meta_info"]) == keys
    assert list(dout) == ["text", "output_ids", "meta_info"]


async def test_legs_arrive_in_any_order(fleet, session):
    body = pd_body({"text": "order", "sampling_params": {"max_new_tokens": 3}, "rid": "o1"}, fleet.prefill[0])
    decode = asyncio.ensure_future(post(session, fleet.decode[0].url + "/generate", body))
    await fleet.wait_for(fleet.prefill[0], lambda s: s["rooms"]["waiting_for_prefill"] == [body["bootstrap_room"]])
    assert not decode.done()
    p_status, _ = await post(session, fleet.prefill[0].url + "/generate", body)
    d_status, dout = await decode
    assert (p_status, d_status) == (200, 200)
    assert dout["output_ids"] == expected_generation("order", max_new_tokens=3).output_ids


async def test_input_ids_and_logprobs(fleet, session):
    body = {"input_ids": [1, 20, 30, 40], "sampling_params": {"max_new_tokens": 3}, "return_logprob": True,
            "top_logprobs_num": 2, "logprob_start_len": 0}
    (ps, pout), (ds, dout) = await pd_generate(session, fleet, body)
    assert (ps, ds) == (200, 200)
    want = expected_generation(input_ids=[1, 20, 30, 40], max_new_tokens=3)
    meta = dout["meta_info"]
    assert dout["output_ids"] == want.output_ids
    assert [t for _, t, _ in meta["output_token_logprobs"]] == want.output_ids
    assert meta["output_token_logprobs_length"] == 3
    assert len(meta["output_top_logprobs"]) == 3 and len(meta["output_top_logprobs"][0]) == 2
    # decode has no input logprobs; prefill has them from logprob_start_len (a router merges them)
    assert meta["input_token_logprobs"] == []
    assert [t for _, t, _ in pout["meta_info"]["input_token_logprobs"]] == [1, 20, 30, 40]
    assert pout["meta_info"]["input_token_logprobs"][0][0] is None


async def test_stream_chunks_are_cumulative_and_end_with_done(fleet, session):
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 4}, "stream": True, "rid": "s1"}
    (ps, pev), (ds, dev) = await pd_generate(session, fleet, body)
    assert (ps, ds) == (200, 200)
    assert dev[-1] == "[DONE]" and pev[-1] == "[DONE]"
    chunks = dev[:-1]
    assert [len(c["output_ids"]) for c in chunks] == [1, 2, 3, 4]
    assert [c["meta_info"]["finish_reason"] for c in chunks[:-1]] == [None] * 3
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
    assert chunks[-1]["text"] == expected_generation(PROMPT, max_new_tokens=4).text
    assert "response_sent_to_client_ts" in chunks[0]["meta_info"]
    assert "response_sent_to_client_ts" not in chunks[1]["meta_info"]
    assert "weight_versions" in chunks[-1]["meta_info"] and "weight_versions" not in chunks[0]["meta_info"]
    assert len(pev) == 2 and pev[0]["meta_info"]["finish_reason"] == {"type": "length", "length": 0}


async def test_batch_has_a_room_per_item(fleet, session):
    p = fleet.prefill[0]
    body = {"text": [PROMPT, "The quick brown fox"], "sampling_params": {"max_new_tokens": 2},
            "rid": ["b0", "b1"], "bootstrap_host": ["127.0.0.1"] * 2, "bootstrap_port": [p.bootstrap_port] * 2,
            "bootstrap_room": [11, 17]}
    (ps, pout), (ds, dout) = await asyncio.gather(post(session, p.url + "/generate", body),
                                                  post(session, fleet.decode[0].url + "/generate", body))
    assert (ps, ds) == (200, 200)
    assert [o["meta_info"]["id"] for o in dout] == ["b0", "b1"]
    assert dout[1]["output_ids"] == expected_generation("The quick brown fox", max_new_tokens=2).output_ids
    assert (await fleet.state(p))["rooms"]["opened"] == 2


async def test_scalar_room_with_batch_expands_to_room_plus_i(fleet, session):
    body = {"text": ["a b", "c d", "e f"], "sampling_params": {"max_new_tokens": 1}, "rid": "base"}
    (ps, pout), (ds, dout) = await pd_generate(session, fleet, body, room=1000)
    assert (ps, ds) == (200, 200)
    assert [o["meta_info"]["id"] for o in dout] == ["base_0", "base_1", "base_2"]


async def test_batch_stream_chunks_carry_index(fleet, session):
    body = {"text": ["one", "two"], "sampling_params": {"max_new_tokens": 2}, "stream": True}
    _, (ds, dev) = await pd_generate(session, fleet, body, room=5000)
    assert ds == 200 and dev[-1] == "[DONE]"
    finals = {c["index"]: c for c in dev[:-1] if c["meta_info"]["finish_reason"]}
    assert sorted(finals) == [0, 1]
    assert finals[1]["output_ids"] == expected_generation("two", max_new_tokens=2).output_ids


async def test_default_max_new_tokens_is_128(fleet, session):
    _, (ds, dout) = await pd_generate(session, fleet, {"text": PROMPT})
    assert ds == 200 and dout["meta_info"]["completion_tokens"] == 128


async def test_stop_string_trims_and_reports_matched(fleet, session):
    want = expected_generation(PROMPT, max_new_tokens=6)
    stop = want.text.split()[3]  # the 4th generated word
    _, (ds, dout) = await pd_generate(session, fleet, {"text": PROMPT, "sampling_params": {
        "max_new_tokens": 6, "stop": [stop]}})
    assert ds == 200
    assert dout["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert dout["text"] == want.text[: want.text.index(stop)]


@pytest.mark.parametrize("body,message", [
    ({"sampling_params": {"max_new_tokens": 2}}, "Either text, input_ids or input_embeds should be provided."),
    ({"text": PROMPT, "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens must be at least 0, got -1."),
    ({"text": PROMPT}, "Invalid request: Disaggregated request received without bootstrap room id."),
    ({"text": ["a", "b"], "rid": ["x"]}, "The specified rids length mismatch with the batch_size"),
    ({"text": ["a", "b"], "rid": ["x", "x"]}, "Duplicate request IDs detected within the request: ['x']"),
])
async def test_bad_input_is_a_400_with_sglang_message(fleet, session, body, message):
    status, out = await post(session, fleet.decode[0].url + "/generate", body)
    assert status == 400
    assert out["error"]["message"].startswith(message)


async def test_invalid_stream_is_an_error_event_after_200(fleet, session):
    status, events = await post(session, fleet.decode[0].url + "/generate",
                                {"text": PROMPT, "stream": True, "sampling_params": {"max_new_tokens": -1}})
    assert status == 200 and events[-1] == "[DONE]"
    assert events[0] == {"error": {"message": "max_new_tokens must be at least 0, got -1.",
                                   "type": "invalid_request_error", "code": 400, "retryable": False}}


async def test_context_length_exceeded(session):
    async with Fleet(0, 1, context_length=64, **FAST) as f:
        status, out = await post(session, f.decode[0].url + "/generate",
                                 {"text": PROMPT, "sampling_params": {"max_new_tokens": 100}, "bootstrap_room": 1})
    assert status == 400
    assert "maximum context length of 64 tokens" in out["error"]["message"]


async def test_schema_errors_use_the_validation_shape(fleet, session):
    status, out = await post(session, fleet.decode[0].url + "/generate", {"text": 5})
    assert status == 400 and out["object"] == "error" and out["code"] == 400 and out["type"] == "Bad Request"
    async with session.post(fleet.decode[0].url + "/generate", data=b"{not json",
                            headers={"Content-Type": "application/json"}) as r:
        assert r.status == 400
        assert "JSON decode error" in (await r.json())["message"]


async def test_live_rid_cannot_be_reused(fleet, session):
    await fleet.set_faults(fleet.decode[0], hang=True)
    body = pd_body({"text": PROMPT, "rid": "dup"}, fleet.prefill[0])
    first = asyncio.ensure_future(post(session, fleet.decode[0].url + "/generate", body))
    await fleet.wait_for(fleet.decode[0], lambda s: "dup" in s["rids_by_phase"].get("waiting", []))
    status, out = await post(session, fleet.decode[0].url + "/generate", body)
    assert status == 400 and out["error"]["message"] == "Duplicate request ID detected: dup"
    await post(session, fleet.decode[0].url + "/abort_request", {"rid": "dup"})
    status, out = await first
    assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "abort"


async def test_regular_worker_without_pd(session):
    async with Fleet(0, 1, decode_overrides={"role": "null"}, **FAST) as f:
        status, out = await post(session, f.decode[0].url + "/generate",
                                 {"text": PROMPT, "sampling_params": {"max_new_tokens": 5}})
        assert status == 200
        assert out["output_ids"] == expected_generation(PROMPT, max_new_tokens=5).output_ids
        status, info = await get(session, f.decode[0].url + "/model_info")
        assert info["disaggregation_mode"] == "null"


async def test_auto_rids_differ_between_legs(fleet, session):
    (_, pout), (_, dout) = await pd_generate(session, fleet, {"text": PROMPT, "sampling_params": {"max_new_tokens": 1}})
    assert len(pout["meta_info"]["id"]) == 32 and pout["meta_info"]["id"] != dout["meta_info"]["id"]


async def test_timing_model_admission_cap(session):
    """With a cap of one running request, the second waits (visible as waiting) until the first ends."""
    async with Fleet(0, 1, decode_overrides={"role": "null", "max_running_requests": 1}, decode_step_s=0.002,
                     **FAST) as f:
        w = f.decode[0]
        first = asyncio.ensure_future(post(session, w.url + "/generate", {"text": "a", "rid": "first",
                                                                          "sampling_params": {"max_new_tokens": 200}}))
        await f.wait_for(w, lambda s: "first" in s["running_rids"])
        second = asyncio.ensure_future(post(session, w.url + "/generate", {"text": "b", "rid": "second",
                                                                           "sampling_params": {"max_new_tokens": 1}}))
        state = await f.wait_for(w, lambda s: "second" in s["waiting_rids"])
        assert "first" in state["running_rids"]
        _, loads = await get(session, w.url + "/v1/loads")
        assert loads["loads"][0]["num_running_reqs"] == 1 and loads["loads"][0]["num_waiting_reqs"] == 1
        (s1, _), (s2, _) = await asyncio.gather(first, second)
        assert (s1, s2) == (200, 200)
