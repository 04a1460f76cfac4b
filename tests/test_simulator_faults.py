"""Fault injection, by flag at start and at run time through POST /_sim/faults."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from simulator.faults import Faults
from simulator.fleet import Fleet
from tests.sim_support import FAST, get, pd_body, pd_generate, post

PROMPT = "Hello world, this is"


async def test_error_rate_and_fail_next(fleet, session):
    d = fleet.decode[0]
    await fleet.set_faults(d, fail_next=2, error_status=503)
    body = pd_body({"text": PROMPT, "sampling_params": {"max_new_tokens": 1}}, fleet.prefill[0])
    failed = [await post(session, d.url + "/generate", body) for _ in range(2)]
    assert [s for s, _ in failed] == [503, 503]
    assert failed[0][1]["code"] == 503 and "Simulated fault" in failed[0][1]["message"]
    _, (status, _) = await pd_generate(session, fleet, {"text": PROMPT, "sampling_params": {"max_new_tokens": 1}})
    assert status == 200  # fail_next is used up
    await fleet.set_faults(d, error_rate=1.0, error_status=500)
    assert (await post(session, d.url + "/generate", body))[0] == 500
    assert (await fleet.state(d))["counters"]["faults_injected"] == 3


async def test_hang_until_cleared_or_aborted(fleet, session):
    d = fleet.decode[0]
    await fleet.set_faults(d, hang=True)
    body = pd_body({"text": PROMPT, "rid": "h", "sampling_params": {"max_new_tokens": 2}}, fleet.prefill[0])
    task = asyncio.ensure_future(post(session, d.url + "/generate", body))
    await fleet.wait_for(d, lambda s: s["rids_by_phase"].get("waiting") == ["h"])
    assert not task.done()
    await post(session, d.url + "/abort_request", {"rid": "h"})
    status, out = await task
    assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "abort"


async def test_hang_after_tokens_then_release(fleet, session):
    d = fleet.decode[0]
    await fleet.set_faults(d, hang_after_tokens=2)
    task = asyncio.ensure_future(pd_generate(session, fleet, {"text": PROMPT, "rid": "ht",
                                                              "sampling_params": {"max_new_tokens": 5}}))
    await fleet.wait_for(d, lambda s: s["rids_by_phase"].get("decode") == ["ht"])
    assert (await fleet.state(d))["counters"]["generation_tokens"] == 2
    await fleet.set_faults(d, hang_after_tokens=None)
    _, (status, out) = await task
    assert status == 200 and len(out["output_ids"]) == 5


async def test_crash_mid_stream_drops_the_connection(fleet, session):
    d = fleet.decode[0]
    await fleet.set_faults(d, crash_after_tokens=2)
    body = pd_body({"text": PROMPT, "stream": True, "sampling_params": {"max_new_tokens": 10}}, fleet.prefill[0])
    p_task = asyncio.ensure_future(post(session, fleet.prefill[0].url + "/generate", body))
    received = b""
    with pytest.raises(aiohttp.ClientPayloadError):
        async with session.post(d.url + "/generate", json=body) as resp:
            assert resp.status == 200
            async for chunk in resp.content.iter_any():
                received += chunk
    assert b"[DONE]" not in received and received.count(b"data: ") >= 1
    assert (await p_task)[0] == 200
    await fleet.wait_for(d, lambda s: not s["rids_by_phase"])


async def test_unhealthy_and_slow_start(session):
    async with Fleet(1, 0, startup_s=0.3, **FAST) as f:
        p = f.prefill[0]
        assert (await get(session, p.url + "/health"))[0] == 503
        deadline = asyncio.get_running_loop().time() + 5
        while (await get(session, p.url + "/health"))[0] != 200:
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.05)
        await f.set_faults(p, unhealthy=True)
        assert (await get(session, p.url + "/health"))[0] == 503
        assert (await get(session, p.url + "/health_generate"))[0] == 503


async def test_health_script_answers_in_order_then_the_probe_decides(fleet, session):
    p = fleet.prefill[0]
    await fleet.set_faults(p, health_script=[503, 200, 500])
    statuses = [(await get(session, p.url + path))[0] for path in ("/health", "/health_generate", "/health", "/health")]
    assert statuses == [503, 200, 500, 200]
    assert (await post(session, p.url + "/_sim/faults", {"health_script": [200, 99]}))[0] == 400


async def test_health_hang_holds_each_probe_with_the_answer_it_had_on_arrival(fleet, session):
    p = fleet.prefill[0]
    await fleet.set_faults(p, health_hang=True, unhealthy=True)
    held = asyncio.ensure_future(get(session, p.url + "/health"))
    await asyncio.sleep(0.1)  # a held probe: no answer however long it waits
    assert not held.done()
    await fleet.set_faults(p, unhealthy=False)
    assert not held.done()
    await fleet.set_faults(p, health_hang=False)
    assert (await held)[0] == 503  # decided when it came in
    assert (await get(session, p.url + "/health"))[0] == 200


async def test_bootstrap_unreachable(fleet, session):
    await fleet.set_faults(fleet.prefill[0], bootstrap_unreachable=True)
    body = pd_body({"text": PROMPT, "rid": "bu"}, fleet.prefill[0], room=3)
    status, out = await post(session, fleet.decode[0].url + "/generate", body)
    assert status == 500 and out["message"].startswith("Decode handshake failed")


async def test_fault_endpoint_validates_and_resets(fleet, session):
    d = fleet.decode[0]
    status, out = await post(session, d.url + "/_sim/faults", {"no_such_fault": 1})
    assert status == 400 and "unknown fault fields: no_such_fault" in out["error"]["message"]
    status, out = await post(session, d.url + "/_sim/faults", {"error_rate": 2})
    assert status == 400
    await fleet.set_faults(d, hang=True, error_rate=0.5)
    async with session.delete(d.url + "/_sim/faults") as r:
        assert r.status == 200 and (await r.json()) == Faults().as_dict()


async def test_faults_given_at_start(session):
    async with Fleet(0, 1, faults=Faults(fail_next=1), **FAST) as f:
        status, _ = await post(session, f.decode[0].url + "/generate", {"text": PROMPT, "bootstrap_room": 1})
        assert status == 500


async def test_process_exit_fault_kills_the_worker(session):
    async with Fleet(1, 1, processes=True, faults=Faults(exit_after_tokens=2), **FAST) as f:
        with pytest.raises(aiohttp.ServerDisconnectedError):
            await asyncio.wait_for(pd_generate(session, f, {"text": PROMPT, "sampling_params": {"max_new_tokens": 5}}),
                                   20)
        f.decode[0].process.wait(timeout=10)
        assert f.decode[0].process.returncode == 17
