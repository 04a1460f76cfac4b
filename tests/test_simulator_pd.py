"""The PD bootstrap protocol: every way a leg can lose its partner ends in SGLang's failure, never a hang."""

from __future__ import annotations

import asyncio
import re

import pytest

from harness.processes import free_port
from simulator.fleet import Fleet
from tests.sim_support import FAST, get, pd_body, post

PROMPT = "Hello world, this is"
HANDSHAKE = re.compile(
    r"Decode handshake failed for request rank=0 decode_req\.req\.rid='(?P<rid>[^']+)' "
    r"decode_req\.req\.bootstrap_room=(?P<room>\d+) with exception KVTransferError\(bootstrap_room=(?P=room)\): "
    r"Aborted by AbortReq\.")


@pytest.fixture
async def fleet():
    async with Fleet(1, 1, kv_wait_timeout_s=0.5, bootstrap_timeout_s=0.5, **FAST) as f:
        yield f


async def _decode_only(session, fleet, *, port, rid="d1", room=77):
    body = pd_body({"text": PROMPT, "sampling_params": {"max_new_tokens": 4}, "rid": rid}, fleet.prefill[0],
                   port=port, room=room)
    return await post(session, fleet.decode[0].url + "/generate", body)


async def test_stale_bootstrap_port_fails_cleanly(fleet, session):
    status, out = await asyncio.wait_for(_decode_only(session, fleet, port=free_port()), 10)
    assert status == 500
    assert out["object"] == "error" and out["code"] == 500 and out["type"] == "500"
    match = HANDSHAKE.fullmatch(out["message"])
    assert match and match["rid"] == "d1" and match["room"] == "77"
    state = await fleet.state(fleet.decode[0])
    assert state["rids_by_phase"] == {} and state["counters"]["bootstrap_failures"] == 1


async def test_port_of_a_decode_listener_fails_like_a_stale_one(fleet, session):
    # with role switching every worker runs a listener; a decode's answers 503 "not registered"
    status, out = await _decode_only(session, fleet, port=fleet.decode[0].bootstrap_port)
    assert status == 500 and HANDSHAKE.fullmatch(out["message"])


async def test_null_bootstrap_port_uses_the_decode_workers_own_port(fleet, session):
    status, out = await _decode_only(session, fleet, port=None)
    assert status == 500 and HANDSHAKE.fullmatch(out["message"])
    # the port a null bootstrap_port falls back to is the decode worker's own launch bootstrap port
    async with Fleet(1, 1, base_port=0, **FAST) as f2:
        cfg_port = f2.decode[0].worker.launch_bootstrap_port
        assert cfg_port == f2.decode[0].bootstrap_port


async def test_missing_room_times_out_on_decode(fleet, session):
    status, out = await _decode_only(session, fleet, port=fleet.prefill[0].bootstrap_port, room=4242)
    assert status == 500
    assert out["message"].startswith("Decode transfer failed for request rank=0 decode_req.req.rid='d1' "
                                      "decode_req.req.bootstrap_room=4242 with exception")
    assert out["message"].endswith("Request 4242 timed out after 0.5s in KVPoll.WaitingForInput")
    assert (await fleet.state(fleet.prefill[0]))["rooms"]["open"] == []


async def test_prefill_without_decode_times_out(fleet, session):
    body = pd_body({"text": PROMPT, "rid": "p1"}, fleet.prefill[0], room=55)
    status, out = await post(session, fleet.prefill[0].url + "/generate", body)
    assert status == 500
    assert out["message"] == ("Prefill bootstrap failed for request rank=0 req.rid='p1' req.bootstrap_room=55 "
                              "with exception KVTransferError(bootstrap_room=55): "
                              "Request 55 timed out after 0.5s in KVPoll.Bootstrapping")


async def test_abort_prefill_waiting_for_decode(session):
    async with Fleet(1, 1, **FAST) as f:
        body = pd_body({"text": PROMPT, "rid": "lonely"}, f.prefill[0], room=9)
        task = asyncio.ensure_future(post(session, f.prefill[0].url + "/generate", body))
        await f.wait_for(f.prefill[0], lambda s: "lonely" in s["rids_by_phase"].get("bootstrap", []))
        status, text = await post(session, f.prefill[0].url + "/abort_request", {"rid": "lonely"})
        assert (status, text) == (200, "")
        status, out = await task
        assert status == 500
        assert out["message"] == ("Prefill bootstrap failed for request rank=0 req.rid='lonely' req.bootstrap_room=9 "
                                  "with exception KVTransferError(bootstrap_room=9): Aborted by AbortReq.")


async def test_abort_decode_waiting_for_kv_fails_its_prefill_too(session):
    async with Fleet(1, 1, prefill_overrides={"prefill_overhead_s": 30.0}, **FAST) as f:
        body = pd_body({"text": PROMPT, "rid": "pair"}, f.prefill[0], room=31)
        p_task = asyncio.ensure_future(post(session, f.prefill[0].url + "/generate", body))
        d_task = asyncio.ensure_future(post(session, f.decode[0].url + "/generate", body))
        await f.wait_for(f.decode[0], lambda s: "pair" in s["rids_by_phase"].get("transfer", []))
        await f.wait_for(f.prefill[0], lambda s: "pair" in s["rids_by_phase"].get("forward", []))
        await post(session, f.decode[0].url + "/abort_request", {"rid": "pair"})
        (ps, pout), (ds, dout) = await asyncio.wait_for(asyncio.gather(p_task, d_task), 10)
        assert ds == 500 and dout["message"].startswith("Decode transfer failed for request rank=0 "
                                                        "decode_req.req.rid='pair'")
        assert dout["message"].endswith("Aborted by AbortReq.")
        assert ps == 500 and pout["message"].startswith("Prefill transfer failed for request rank=0 req.rid='pair'")
        assert pout["message"].endswith("Failed due to an unknown reason from another rank")


async def test_failed_prefill_fails_its_decode_at_once(fleet, session):
    body = pd_body({"text": PROMPT, "rid": "pf"}, fleet.prefill[0], room=66)
    status, _ = await post(session, fleet.prefill[0].url + "/generate", body)  # times out, no decode came
    assert status == 500
    status, out = await asyncio.wait_for(post(session, fleet.decode[0].url + "/generate", body), 5)
    assert status == 500 and out["message"].endswith("Failed due to an unknown reason from another rank")


async def test_stream_failure_is_an_abort_chunk_with_status(fleet, session):
    body = pd_body({"text": PROMPT, "rid": "sf", "stream": True}, fleet.prefill[0], port=free_port(), room=5)
    status, events = await post(session, fleet.decode[0].url + "/generate", body)
    assert status == 200 and events[-1] == "[DONE]" and len(events) == 2
    reason = events[0]["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and reason["status_code"] == 500 and reason["err_type"] is None
    assert HANDSHAKE.fullmatch(reason["message"])
    assert events[0]["output_ids"] == [] and events[0]["meta_info"]["completion_tokens"] == 0


async def test_listener_answers_like_sglangs(fleet, session):
    p, d = fleet.prefill[0], fleet.decode[0]
    all_ranks = "/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1"
    status, text = await get(session, f"http://127.0.0.1:{p.bootstrap_port}/health")
    assert (status, text) == (200, "OK")
    status, text = await get(session, f"http://127.0.0.1:{p.bootstrap_port}/route")
    assert (status, text) == (400, "Missing inputs for bootstrap server.")
    status, info = await get(session, f"http://127.0.0.1:{p.bootstrap_port}{all_ranks}")
    assert status == 200 and info["prefill_http_port"] == p.port and info["dp_size"] == 1
    status, text = await get(session, f"http://127.0.0.1:{d.bootstrap_port}{all_ranks}")
    assert (status, text) == (503, "Prefill server not fully registered yet (0 workers registered).")


async def test_duplicate_room_is_reported(fleet, session):
    body = pd_body({"text": PROMPT, "sampling_params": {"max_new_tokens": 2}}, fleet.prefill[0], room=123)
    first = asyncio.ensure_future(post(session, fleet.prefill[0].url + "/generate", dict(body, rid="a")))
    await fleet.wait_for(fleet.prefill[0], lambda s: 123 in s["rooms"]["waiting_for_decode"])
    status, out = await post(session, fleet.prefill[0].url + "/generate", dict(body, rid="b"))
    assert status == 500 and out["message"].endswith("Duplicate bootstrap room")
    assert (await fleet.state(fleet.prefill[0]))["rooms"]["collisions"] == 1
    status, _ = await post(session, fleet.decode[0].url + "/generate", dict(body, rid="a"))
    assert status == 200 and (await first)[0] == 200


async def test_n_greater_than_one_on_decode_waits_like_sglang(fleet, session):
    """SGLang 0.5.23's decode leg of an n>1 request waits for a warm-up KV that never comes."""
    body = pd_body({"text": PROMPT, "sampling_params": {"max_new_tokens": 2, "n": 2}}, fleet.prefill[0], room=700)
    (ps, pout), (ds, dout) = await asyncio.gather(post(session, fleet.prefill[0].url + "/generate", body),
                                                  post(session, fleet.decode[0].url + "/generate", body))
    assert ps == 200 and len(pout) == 2
    assert ds == 500 and "timed out after 0.5s in KVPoll.WaitingForInput" in dout["message"]
