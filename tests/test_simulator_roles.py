"""Role switching: 0.5.23's /pd_role_switch and the earlier /convert_pd_role."""

from __future__ import annotations

import asyncio

import pytest

from harness.processes import free_port
from simulator.fleet import Fleet
from simulator.tokens import expected_generation
from tests.sim_support import FAST, get, pd_body, post

PROMPT = "Hello world, this is"
TO_DECODE = {"new_role": "decode", "decode_cuda_graph_memory_gb": 0}


@pytest.fixture
async def fleet():
    async with Fleet(1, 1, kv_wait_timeout_s=0.5, **FAST) as f:
        yield f


def answer(success, message, old, new, safe):
    return {"rid": None, "http_worker_ipc": None, "success": success, "message": message, "old_role": old,
            "new_role": new, "safe_to_restore": safe}


async def switch(session, handle, body):
    return await post(session, handle.url + "/pd_role_switch", body)


async def test_refusals_and_no_ops(fleet, session):
    p = fleet.prefill[0]
    assert await switch(session, p, {"new_role": "decode"}) == (400, answer(
        False, "decode_cuda_graph_memory_gb is required before capturing decode graphs", "prefill", "decode", True))
    assert await switch(session, p, {"new_role": "prefill"}) == (200, answer(True, "ok", "prefill", "prefill", False))
    assert await switch(session, p, {}) == (400, answer(False, "invalid new_role=''", "prefill", "", True))
    status, out = await switch(session, p, {"new_role": "bogus"})
    assert status == 400 and "Input should be 'prefill', 'decode' or ''" in out["message"]
    assert await switch(session, p, dict(TO_DECODE, prepare_only=True)) == (
        200, answer(True, "ready", "prefill", "decode", True))
    assert (await get(session, p.url + "/model_info"))[1]["disaggregation_mode"] == "prefill"


async def test_busy_worker_refuses(fleet, session):
    p = fleet.prefill[0]
    body = pd_body({"text": PROMPT, "rid": "lonely"}, p)
    task = asyncio.ensure_future(post(session, p.url + "/generate", body))
    await fleet.wait_for(p, lambda s: s["rids_by_phase"].get("bootstrap") == ["lonely"])
    assert await switch(session, p, TO_DECODE) == (400, answer(
        False, "instance is not idle; drain all requests before switching", "prefill", "decode", True))
    await post(session, p.url + "/abort_request", {"abort_all": True})
    assert (await task)[0] == 500


async def test_not_enabled(session):
    async with Fleet(1, 0, enable_pd_role_switch=False, **FAST) as f:
        assert await switch(session, f.prefill[0], TO_DECODE) == (400, answer(
            False, "--enable-pd-role-switch is not set on this server", "prefill", "decode", True))


async def test_swap_roles_and_generate_through_the_new_pairing(fleet, session):
    p, d = fleet.prefill[0], fleet.decode[0]
    assert await switch(session, p, TO_DECODE) == (200, answer(True, "ok", "prefill", "decode", False))
    assert await switch(session, d, {"new_role": "prefill"}) == (200, answer(True, "ok", "decode", "prefill", False))
    # live role in /model_info, internal_states and /v1/loads; /server_info's top level is the launch config
    for handle, live, launch in ((p, "decode", "prefill"), (d, "prefill", "decode")):
        assert (await get(session, handle.url + "/model_info"))[1]["disaggregation_mode"] == live
        server = (await get(session, handle.url + "/server_info"))[1]
        assert server["disaggregation_mode"] == launch
        assert server["internal_states"][0]["disaggregation_mode"] == live
        assert (await get(session, handle.url + "/v1/loads"))[1]["loads"][0]["disaggregation"]["mode"] == live
    body = pd_body({"text": PROMPT, "sampling_params": {"max_new_tokens": 4}}, d)  # d is the prefill now
    (ps, _), (ds, dout) = await asyncio.gather(post(session, d.url + "/generate", body),
                                               post(session, p.url + "/generate", body))
    assert (ps, ds) == (200, 200)
    assert dout["output_ids"] == expected_generation(PROMPT, max_new_tokens=4).output_ids


async def test_router_with_stale_roles_waits_until_the_deadline(fleet, session):
    """After P->D, the old prefill's listener keeps its registration: a decode leg sent there waits."""
    p = fleet.prefill[0]
    await switch(session, p, TO_DECODE)
    body = pd_body({"text": PROMPT, "rid": "stale"}, p)
    status, out = await post(session, p.url + "/generate", body)  # now a decode leg, pulling from itself
    assert status == 500 and out["message"].endswith("timed out after 0.5s in KVPoll.WaitingForInput")


async def test_conversion_faults(fleet, session):
    p = fleet.prefill[0]
    await fleet.set_faults(p, conversion_failure="safe")
    status, out = await switch(session, p, TO_DECODE)
    assert status == 400 and out["safe_to_restore"] is True
    assert (await get(session, p.url + "/model_info"))[1]["disaggregation_mode"] == "prefill"
    assert (await get(session, p.url + "/health"))[0] == 200
    await fleet.set_faults(p, conversion_failure="unsafe")
    status, out = await switch(session, p, TO_DECODE)
    assert status == 400 and out["safe_to_restore"] is False
    assert out["message"].startswith("role switch failed; instance unhealthy, restart required")
    assert (await get(session, p.url + "/health"))[0] == 503
    await fleet.set_faults(p, conversion_failure=None)
    assert await switch(session, p, TO_DECODE) == (400, answer(
        False, "instance is unhealthy after a failed role switch; restart required", "prefill", "decode", False))


async def test_convert_api_opens_and_closes_bootstrap_listeners(session):
    base = free_port()
    async with Fleet(1, 1, api="convert", convert_bootstrap_base=base, **FAST) as f:
        p, d = f.prefill[0], f.decode[0]
        assert (await post(session, p.url + "/pd_role_switch", TO_DECODE))[0] == 404
        status, out = await post(session, d.url + "/convert_pd_role", {"server_url": d.url, "check_idle": True})
        # the first free port from the base (another process on this machine can take the base meanwhile)
        port = out.get("bootstrap_port")
        assert isinstance(port, int) and base <= port < base + 100, out
        assert (status, out) == (200, {"success": True, "message": "The role of this server is now PREFILL.",
                                       "bootstrap_port": port})
        server = (await get(session, d.url + "/server_info"))[1]
        assert server["disaggregation_mode"] == "prefill" and server["disaggregation_bootstrap_port"] == port
        old_port = p.bootstrap_port
        status, out = await post(session, p.url + "/convert_pd_role", {"server_url": p.url})
        assert (status, out["message"]) == (200, "The role of this server is now DECODE.")
        # the new pairing works through the reported port; the old port is closed
        body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 3}, "bootstrap_host": "127.0.0.1",
                "bootstrap_port": port, "bootstrap_room": 1}
        (ps, _), (ds, dout) = await asyncio.gather(post(session, d.url + "/generate", body),
                                                   post(session, p.url + "/generate", body))
        assert (ps, ds) == (200, 200) and len(dout["output_ids"]) == 3
        stale = dict(body, bootstrap_port=old_port, bootstrap_room=2)
        status, out = await post(session, p.url + "/generate", stale)
        assert status == 500 and out["message"].startswith("Decode handshake failed")


async def test_convert_refuses_when_busy(session):
    async with Fleet(1, 1, api="convert", **FAST) as f:
        p = f.prefill[0]
        task = asyncio.ensure_future(post(session, p.url + "/generate", pd_body({"text": PROMPT, "rid": "x"}, p)))
        await f.wait_for(p, lambda s: s["rids_by_phase"].get("bootstrap") == ["x"])
        status, out = await post(session, p.url + "/convert_pd_role", {"check_idle": True})
        assert status == 400 and out["success"] is False and "not idle" in out["message"]
        status, out = await post(session, p.url + "/convert_pd_role", {})  # check_idle is true by default
        assert status == 400 and out["success"] is False
        status, out = await post(session, p.url + "/convert_pd_role", {"check_idle": False, "idle_timeout_s": 0.05})
        assert (status, out["message"]) == (400, "The server is not idle after waiting 0.05 s, please drain it "
                                                 "before converting.")
        assert (await get(session, p.url + "/model_info"))[1]["disaggregation_mode"] == "prefill"
        await post(session, p.url + "/abort_request", {"rid": "x"})
        await task


async def test_convert_check_idle_false_waits_until_idle_then_converts(session):
    """server_patches' meaning of check_idle (the seed design's: check the server is idle before converting):
    false waits for the drain instead of refusing."""
    async with Fleet(1, 1, api="convert", **FAST) as f:
        p = f.prefill[0]
        task = asyncio.ensure_future(post(session, p.url + "/generate", pd_body({"text": PROMPT, "rid": "x"}, p)))
        await f.wait_for(p, lambda s: s["rids_by_phase"].get("bootstrap") == ["x"])
        convert = asyncio.ensure_future(post(session, p.url + "/convert_pd_role",
                                             {"check_idle": False, "idle_timeout_s": 30}))
        await f.wait_for(p, lambda s: s["convert_waiting_for_idle"])
        assert not convert.done()
        await post(session, p.url + "/abort_request", {"rid": "x"})
        await task
        status, out = await convert
        assert (status, out["success"], out["message"]) == (200, True, "The role of this server is now DECODE.")
        assert (await get(session, p.url + "/model_info"))[1]["disaggregation_mode"] == "decode"
        for bad in ({"check_idle": "yes"}, {"idle_timeout_s": 0}, {"idle_timeout_s": True}):
            status, out = await post(session, p.url + "/convert_pd_role", bad)
            assert status == 400 and out["success"] is False, (bad, out)


async def test_patched_api_serves_server_patches_convert_over_the_in_place_switch(session):
    """--api patched: a 0.5.23 server with server_patches (both APIs; /convert_pd_role by its contract)."""
    async with Fleet(1, 1, api="patched", **FAST) as f:
        p, d = f.prefill[0], f.decode[0]
        status, out = await post(session, p.url + "/convert_pd_role", {"new_role": "decode"})
        assert status == 400 and out["error"]["message"] == "unknown field 'new_role'" and out["success"] is False
        status, out = await post(session, p.url + "/convert_pd_role", {"bootstrap_port": p.bootstrap_port + 1})
        assert status == 400 and "cannot move it" in out["message"]
        task = asyncio.ensure_future(post(session, p.url + "/generate", pd_body({"text": PROMPT, "rid": "x"}, p)))
        await f.wait_for(p, lambda s: s["rids_by_phase"].get("bootstrap") == ["x"])
        status, out = await post(session, p.url + "/convert_pd_role", {})
        assert (status, out["message"], out["safe_to_restore"]) == (
            400, "instance is not idle; drain all requests before switching", True)
        await post(session, p.url + "/abort_request", {"rid": "x"})
        await task
        status, out = await post(session, p.url + "/convert_pd_role", {"server_url": p.url, "check_idle": True})
        assert (status, out) == (200, {"success": True, "message": "converted prefill -> decode",
                                       "bootstrap_port": p.bootstrap_port, "old_role": "prefill",
                                       "new_role": "decode", "safe_to_restore": False})
        assert (await get(session, p.url + "/model_info"))[1]["disaggregation_mode"] == "decode"
        state = (await get(session, p.url + "/convert_pd_role"))[1]
        assert (state["in_progress"], state["role"]) == (False, "decode")
        # the upstream switch is there too, and the server keeps its bootstrap port as prefill again
        status, out = await post(session, d.url + "/pd_role_switch", {"new_role": "prefill"})
        assert status == 200 and out["message"] == "ok"
        status, out = await post(session, d.url + "/convert_pd_role", {})
        assert (status, out["new_role"], out["bootstrap_port"]) == (200, "decode", d.bootstrap_port)
