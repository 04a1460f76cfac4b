"""Abort, pause/continue, flush_cache, weight updates and the weight write lock."""

from __future__ import annotations

import asyncio

import pytest

from simulator.fleet import Fleet
from simulator.tokens import expected_generation
from tests.sim_support import FAST, get, pd_body, post

PROMPT = "Hello world, this is"
ABORTED = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}


@pytest.fixture
async def fleet():
    """One P + one D; the decode stalls after 3 tokens (hang_after_tokens) so requests stay in flight."""
    async with Fleet(1, 1, **FAST) as f:
        await f.set_faults(f.decode[0], hang_after_tokens=3)
        yield f


def start_pd(session, fleet, rid, *, stream=False, max_new_tokens=50, room=None):
    body = pd_body({"text": PROMPT, "rid": rid, "stream": stream,
                    "sampling_params": {"max_new_tokens": max_new_tokens}}, fleet.prefill[0], room=room)
    return asyncio.ensure_future(asyncio.gather(post(session, fleet.prefill[0].url + "/generate", body),
                                                post(session, fleet.decode[0].url + "/generate", body)))


async def decoding(fleet, *rids):
    await fleet.wait_for(fleet.decode[0], lambda s: all(r in s["rids_by_phase"].get("decode", []) for r in rids))


async def test_abort_by_rid_returns_partial_output(fleet, session):
    task = start_pd(session, fleet, "a1")
    await decoding(fleet, "a1")
    status, body = await post(session, fleet.decode[0].url + "/abort_request", {"rid": "a1"})
    assert (status, body) == (200, "")
    (_, _), (ds, dout) = await task
    assert ds == 200
    assert dout["meta_info"]["finish_reason"] == ABORTED
    assert dout["output_ids"] == expected_generation(PROMPT, max_new_tokens=3).output_ids
    counters = (await fleet.state(fleet.decode[0]))["counters"]
    assert counters["abort_requests"] == 1 and counters["aborts_matched"] == 1 and counters["items_aborted"] == 1


async def test_abort_needs_the_exact_rid_then_matches_its_prefix(fleet, session):
    t1 = start_pd(session, fleet, "job", room=1)
    t2 = start_pd(session, fleet, "job-2", room=2)
    await decoding(fleet, "job", "job-2")
    await post(session, fleet.decode[0].url + "/abort_request", {"rid": "jo"})  # no live rid "jo": nothing
    state = await fleet.state(fleet.decode[0])
    assert state["counters"]["aborts_matched"] == 0 and len(state["rids_by_phase"]["decode"]) == 2
    await post(session, fleet.decode[0].url + "/abort_request", {"rid": "job"})  # "job" and "job-2"
    results = await asyncio.gather(t1, t2)
    assert [r[1][1]["meta_info"]["finish_reason"]["type"] for r in results] == ["abort", "abort"]


async def test_abort_all_ends_a_stream_with_an_abort_chunk_and_done(fleet, session):
    task = start_pd(session, fleet, "s1", stream=True)
    await decoding(fleet, "s1")
    await post(session, fleet.decode[0].url + "/abort_request", {"abort_all": True})
    (_, _), (ds, events) = await task
    assert ds == 200 and events[-1] == "[DONE]"
    assert events[-2]["meta_info"]["finish_reason"] == ABORTED
    assert len(events[-2]["output_ids"]) == 3
    assert (await fleet.state(fleet.decode[0]))["counters"]["abort_all_requests"] == 1


async def test_abort_of_unknown_or_empty_rid_is_a_noop(fleet, session):
    assert await post(session, fleet.decode[0].url + "/abort_request", {"rid": "nope"}) == (200, "")
    assert await post(session, fleet.decode[0].url + "/abort_request", {}) == (200, "")
    assert (await fleet.state(fleet.decode[0]))["counters"]["aborts_matched"] == 0


async def test_abort_in_waiting_queue_shape(session):
    async with Fleet(0, 1, decode_overrides={"role": "null", "max_running_requests": 1}, **FAST) as f:
        w = f.decode[0]
        await f.set_faults(w, hang_after_tokens=1)
        first = asyncio.ensure_future(post(session, w.url + "/generate", {"text": "a", "rid": "first"}))
        await f.wait_for(w, lambda s: "first" in s["running_rids"])
        second = asyncio.ensure_future(post(session, w.url + "/generate", {"text": "b", "rid": "second"}))
        await f.wait_for(w, lambda s: "second" in s["waiting_rids"])
        await post(session, w.url + "/abort_request", {"rid": "second"})
        status, out = await second
        assert status == 200
        assert out["meta_info"]["finish_reason"] == {"type": "abort", "message": "Abort in waiting queue"}
        assert list(out["meta_info"]) == ["id", "finish_reason", "weight_version", "e2e_latency",
                                          "weight_versions", "completion_tokens"]
        await post(session, w.url + "/abort_request", {"abort_all": True})
        assert (await first)[0] == 200


async def test_client_disconnect_aborts_the_request(fleet, session):
    body = pd_body({"text": PROMPT, "rid": "gone", "sampling_params": {"max_new_tokens": 50}}, fleet.prefill[0])
    p = asyncio.ensure_future(post(session, fleet.prefill[0].url + "/generate", body))
    d = asyncio.ensure_future(post(session, fleet.decode[0].url + "/generate", body))
    await decoding(fleet, "gone")
    d.cancel()  # the client goes away
    await asyncio.gather(d, return_exceptions=True)
    state = await fleet.wait_for(fleet.decode[0], lambda s: not s["rids_by_phase"])
    assert state["counters"]["client_disconnects"] == 1 and state["counters"]["items_aborted"] == 1
    assert (await p)[0] == 200


async def test_pause_abort_returns_once_requests_are_gone_and_parks_new_ones(fleet, session):
    task = start_pd(session, fleet, "pa")
    await decoding(fleet, "pa")
    status, out = await post(session, fleet.decode[0].url + "/pause_generation", {"mode": "abort"})
    assert (status, out) == (200, {"message": "Generation paused successfully.", "status": "ok"})
    assert not (await fleet.state(fleet.decode[0]))["rids_by_phase"]
    (_, _), (ds, dout) = await task
    assert dout["meta_info"]["finish_reason"] == ABORTED
    await fleet.set_faults(fleet.decode[0], hang_after_tokens=None)
    parked = start_pd(session, fleet, "parked", max_new_tokens=4)
    await fleet.wait_for(fleet.decode[0], lambda s: s["undispatched_rids"] == ["parked"])
    assert not parked.done()
    status, out = await post(session, fleet.decode[0].url + "/continue_generation", {})
    assert (status, out) == (200, {"message": "Generation continued successfully.", "status": "ok"})
    (_, _), (ds, dout) = await parked
    assert ds == 200 and dout["output_ids"] == expected_generation(PROMPT, max_new_tokens=4).output_ids


async def test_pause_retract_requeues_and_finishes_identically(fleet, session):
    task = start_pd(session, fleet, "rt", max_new_tokens=6)
    await decoding(fleet, "rt")
    await post(session, fleet.decode[0].url + "/pause_generation", {"mode": "retract"})
    state = await fleet.wait_for(fleet.decode[0], lambda s: s["rids_by_phase"].get("retracted") == ["rt"])
    assert state["kv_reserved_tokens"] == 0
    status, text = await post(session, fleet.decode[0].url + "/flush_cache", None)
    assert status == 200 and text.startswith("Cache flushed.")
    _, loads = await get(session, fleet.decode[0].url + "/v1/loads")
    assert loads["loads"][0]["num_waiting_reqs"] == 1
    await fleet.set_faults(fleet.decode[0], hang_after_tokens=None)
    assert not task.done()
    await post(session, fleet.decode[0].url + "/continue_generation", {})
    (_, _), (ds, dout) = await task
    assert dout["output_ids"] == expected_generation(PROMPT, max_new_tokens=6).output_ids
    assert dout["meta_info"]["num_retractions"] == 1


async def test_pause_in_place_keeps_kv_and_blocks_flush(fleet, session):
    task = start_pd(session, fleet, "ip", max_new_tokens=6)
    await decoding(fleet, "ip")
    await post(session, fleet.decode[0].url + "/pause_generation", {"mode": "in_place"})
    status, text = await post(session, fleet.decode[0].url + "/flush_cache", None)
    assert (status, text) == (400, "Flush cache failed.\n")
    await fleet.set_faults(fleet.decode[0], hang_after_tokens=None)
    state = await fleet.state(fleet.decode[0])
    assert state["pause_mode"] == "in_place" and state["rids_by_phase"]["decode"] == ["ip"]
    await post(session, fleet.decode[0].url + "/continue_generation", {})
    (_, _), (ds, dout) = await task
    assert dout["meta_info"]["num_retractions"] == 0 and len(dout["output_ids"]) == 6


async def test_pause_body_is_required_and_mode_checked(fleet, session):
    url = fleet.decode[0].url
    status, out = await post(session, url + "/pause_generation", None)
    assert status == 400 and "Field required" in out["message"]
    status, out = await post(session, url + "/pause_generation", {"mode": "bogus"})
    assert status == 400 and "Input should be 'abort', 'retract' or 'in_place'" in out["message"]
    assert (await fleet.state(fleet.decode[0]))["paused"] is False


async def test_health_waits_while_paused(session):
    async with Fleet(0, 1, health_check_s=0.0, health_timeout_s=0.2) as f:
        url = f.decode[0].url
        assert (await get(session, url + "/health"))[0] == 200
        await post(session, url + "/pause_generation", {"mode": "in_place"})
        assert (await get(session, url + "/health"))[0] == 503
        await post(session, url + "/continue_generation", {})
        assert (await get(session, url + "/health_generate"))[0] == 200


async def test_a_paused_servers_health_passes_when_the_scheduler_answers_something_else(session):
    """0.5.23's probe takes any answer from the scheduler during it for progress (last_receive_tstamp), paused or
    not: measured on real 0.5.23 paused in place, /health answered 200 in 1 s while /server_info was read (its
    internal states are a scheduler reply), and 503 after its 20 s with /v1/loads, /model_info or nothing."""
    async with Fleet(0, 1, health_check_s=0.0, health_timeout_s=5.0) as f:
        url = f.decode[0].url
        await post(session, url + "/pause_generation", {"mode": "in_place"})
        probe = asyncio.ensure_future(get(session, url + "/health"))
        while not probe.done():  # the probe waits up to 5 s for progress: a reply during it is progress
            await get(session, url + "/server_info")
            await asyncio.wait([probe], timeout=0.05)
        assert probe.result()[0] == 200
        await post(session, url + "/continue_generation", {})


async def test_flush_cache_busy_and_timeout(fleet, session):
    url = fleet.decode[0].url
    assert (await post(session, url + "/flush_cache", None))[0] == 200
    task = start_pd(session, fleet, "fc")
    await decoding(fleet, "fc")
    assert await post(session, url + "/flush_cache", None) == (400, "Flush cache failed.\n")
    assert await post(session, url + "/flush_cache?timeout=0.1", None) == (400, "Timed out waiting for idle state.")
    waiting = asyncio.ensure_future(post(session, url + "/flush_cache?timeout=10", None))
    await post(session, url + "/abort_request", {"rid": "fc"})
    status, text = await waiting
    assert status == 200 and text.startswith("Cache flushed.")
    await task


async def test_weight_update_waits_for_in_flight_requests(fleet, session):
    url = fleet.decode[0].url
    task = start_pd(session, fleet, "inflight", max_new_tokens=5)
    await decoding(fleet, "inflight")
    update = asyncio.ensure_future(post(session, url + "/update_weights_from_disk",
                                        {"model_path": "sim/tiny-llama", "weight_version": "v2"}))
    await fleet.wait_for(fleet.decode[0], lambda s: s["weight_lock"]["waiting_writers"] == 1)
    queued = start_pd(session, fleet, "queued", max_new_tokens=2)
    await fleet.wait_for(fleet.decode[0], lambda s: s["undispatched_rids"] == ["queued"])
    assert not update.done()
    await fleet.set_faults(fleet.decode[0], hang_after_tokens=None)
    (_, _), (_, dout) = await task
    assert dout["meta_info"]["weight_version"] == "default" and len(dout["output_ids"]) == 5
    status, out = await update
    assert (status, out) == (200, {"success": True, "message": "Succeeded to update model weights. "
                                                               "Weight version updated to v2.",
                                   "num_paused_requests": 0})
    (_, _), (_, qout) = await queued
    assert qout["meta_info"]["weight_version"] == "v2"
    assert qout["meta_info"]["weight_versions"] == [{"version": "v2", "start": 0, "end": 2}]


async def test_weight_update_with_abort_all_requests(fleet, session):
    url = fleet.decode[0].url
    task = start_pd(session, fleet, "victim")
    await decoding(fleet, "victim")
    status, out = await post(session, url + "/update_weights_from_disk",
                             {"model_path": "sim/tiny-llama", "abort_all_requests": True, "weight_version": "v9"})
    assert status == 200 and out["success"]
    (_, _), (_, dout) = await task
    assert dout["meta_info"]["finish_reason"] == ABORTED
    _, info = await get(session, url + "/model_info")
    _, server = await get(session, url + "/server_info")
    assert info["weight_version"] == "v9"
    assert server["weight_version"] == "default" and server["internal_states"][0]["weight_version"] == "v9"


async def test_version_change_mid_request_is_a_new_span(fleet, session):
    task = start_pd(session, fleet, "span", max_new_tokens=6)
    await decoding(fleet, "span")
    status, out = await post(session, fleet.decode[0].url + "/update_weight_version",
                             {"new_version": "v3", "abort_all_requests": False})
    assert (status, out) == (200, {"success": True, "message": "Weight version updated to v3", "new_version": "v3"})
    await fleet.set_faults(fleet.decode[0], hang_after_tokens=None)
    (_, _), (_, dout) = await task
    assert dout["meta_info"]["weight_versions"] == [{"version": "default", "start": 0, "end": 3},
                                                    {"version": "v3", "start": 3, "end": 6}]
    assert dout["meta_info"]["weight_version"] == "v3"


async def test_update_weight_version_aborts_by_default(fleet, session):
    task = start_pd(session, fleet, "uv")
    await decoding(fleet, "uv")
    await post(session, fleet.decode[0].url + "/update_weight_version", {"new_version": "v4"})
    (_, _), (_, dout) = await task
    assert dout["meta_info"]["finish_reason"] == ABORTED


async def test_weight_sessions_and_group_updates(fleet, session):
    url = fleet.decode[0].url
    status, out = await post(session, url + "/update_weights_from_tensor", {"serialized_named_tensors": []})
    assert status == 400 and out["message"] == ("update_weights_from_tensor must run between begin_weight_update() "
                                                "and end_weight_update()")
    assert await post(session, url + "/begin_weight_update", {}) == (200, {"success": True, "message": "Success"})
    status, out = await post(session, url + "/begin_weight_update", {})
    assert status == 400 and "already open" in out["message"]
    dist = {"names": ["w"], "dtypes": ["bfloat16"], "shapes": [[1]], "weight_version": "v7"}
    status, out = await post(session, url + "/update_weights_from_distributed", dist)
    assert status == 400 and "not initialized" in out["message"]
    group = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2}
    assert (await post(session, url + "/init_weights_update_group", group))[0] == 200
    status, out = await post(session, url + "/update_weights_from_distributed", dist)
    assert (status, out["message"]) == (200, "Succeeded to update parameter online. Weight version updated to v7.")
    assert (await post(session, url + "/end_weight_update", {}))[0] == 200
    status, out = await post(session, url + "/end_weight_update", {})
    assert status == 400 and out["message"] == "no weight-update session is open; call begin_weight_update() first"
    assert (await post(session, url + "/destroy_weights_update_group", {}))[0] == 200
    status, out = await post(session, url + "/destroy_weights_update_group", {})
    assert (status, out["message"]) == (400, "The group to be destroyed does not exist.")


async def test_update_failure_fault_changes_nothing(fleet, session):
    url = fleet.decode[0].url
    await fleet.set_faults(fleet.decode[0], update_failure=True)
    status, out = await post(session, url + "/update_weights_from_disk", {"model_path": "sim/x", "weight_version": "v5"})
    assert status == 400 and out["success"] is False
    assert (await get(session, url + "/model_info"))[1]["weight_version"] == "default"
    status, out = await post(session, url + "/update_weights_from_disk", {"model_path": "/nonexistent/model"})
    assert status == 400


async def test_missing_model_path_is_a_validation_error(fleet, session):
    status, out = await post(session, fleet.decode[0].url + "/update_weights_from_disk", {})
    assert status == 400 and "'model_path'), 'msg': 'Field required'" in out["message"]


async def test_aborted_transfer_holds_kv_when_nobody_acks(session):
    """A live prefill acks a decode's abort at once; a stale registration (its server switched to decode)
    never does, so the decode keeps the KV until deferred_release_s (30 s on real servers)."""
    async with Fleet(1, 1, **{**FAST, "deferred_release_s": 0.3}) as f:
        p, d = f.prefill[0], f.decode[0]
        live = pd_body({"text": PROMPT, "rid": "live"}, p, room=807)
        task = asyncio.ensure_future(post(session, d.url + "/generate", live))
        await f.wait_for(d, lambda s: "live" in s["rids_by_phase"].get("transfer", []))
        await post(session, d.url + "/abort_request", {"rid": "live"})
        assert (await task)[0] == 500
        assert (await post(session, d.url + "/flush_cache", None))[0] == 200  # acked at once: no hold
        await post(session, p.url + "/pd_role_switch", {"new_role": "decode", "decode_cuda_graph_memory_gb": 0})
        stale = pd_body({"text": PROMPT, "rid": "orphan"}, p, room=808)  # p's listener: a stale registration
        task = asyncio.ensure_future(post(session, d.url + "/generate", stale))
        await f.wait_for(d, lambda s: "orphan" in s["rids_by_phase"].get("transfer", []))
        await post(session, d.url + "/abort_request", {"rid": "orphan"})
        status, out = await task
        assert status == 500 and out["message"].endswith("Aborted by AbortReq.")
        assert await post(session, d.url + "/flush_cache", None) == (400, "Flush cache failed.\n")
        status, out = await post(session, d.url + "/pd_role_switch", {"new_role": "prefill"})
        assert status == 400 and out["message"] == "instance is not idle; drain all requests before switching"
        await f.wait_for(d, lambda s: s["deferred_release_s"] == 0)
        assert (await post(session, d.url + "/flush_cache", None))[0] == 200
