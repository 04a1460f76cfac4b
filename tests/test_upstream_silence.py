"""Timeouts on the data path: a leg whose server stops sending mid-answer is cut after
`--upstream-idle-timeout-secs` (not while the fleet is paused in place), and a prefill leg still open after
its decode answered is cut at the same bound; in-flight counts return to 0 and the client gets a clean
answer or a clean error."""

from __future__ import annotations

import asyncio
import time

import pytest

from router.core.config import HealthConfig, RetryConfig, RouterConfig, WorkerSpec
from router.core.keys import TRAFFIC
from router.dataplane.proxy import PROXY
from router.server.app import create_app
from simulator.fleet import Fleet

from .helpers import wait_for
from .test_failures import settled
from .test_proxy import read_events

NO_PROBES = HealthConfig(enabled=False)
IDLE_S = 0.3


def pool(client):
    return client.app[PROXY].dispatcher.upstream


async def test_a_stream_that_stalls_mid_answer_is_cut_with_an_error_event(fake_fleet, make_router):
    p, d = await fake_fleet(1, 1)
    d.behaviour.stream_chunks, d.behaviour.stall_after = 4, 1
    client = await make_router([p], [d], health=NO_PROBES, upstream_idle_timeout_secs=IDLE_S)
    started = time.monotonic()
    resp = await client.post("/generate", json={"text": "x", "stream": True, "rid": "stalled"})
    assert resp.status == 200
    events = await read_events(resp)
    took = time.monotonic() - started
    assert events[0]["output_ids"] == [0]
    assert events[-1] == "[DONE]" and "UpstreamSilent" in events[-2]["error"]["message"], events
    assert IDLE_S <= took < IDLE_S * 3 + 1, took
    assert pool(client).silence_cuts_total == 1
    await wait_for(lambda: {"rid": "stalled"} in d.aborts, message="the stalled request aborted on its server")
    assert client.registry.get(d.url).failures_total == 1  # a hung server counts against it
    await settled(client)


async def test_a_stream_silent_before_its_first_event_is_answered_502_when_nothing_else_can_serve(
        sim_workers, make_router):
    p, d = await sim_workers(1, 1)
    d.set_faults(hang=True)  # the head, then nothing
    client = await make_router([p], [d], health=NO_PROBES, upstream_idle_timeout_secs=IDLE_S,
                               retry=RetryConfig(enabled=False))
    resp = await client.post("/generate", json={"text": "x", "stream": True})
    assert resp.status == 502
    assert "sent nothing" in (await resp.json())["error"]["message"]
    await settled(client)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_hung_prefill_after_decode_answered_is_cut_and_its_count_returns_to_0(fake_fleet, make_router,
                                                                                      stream):
    p, d = await fake_fleet(1, 1)
    p.behaviour.hang = True  # never answers (the fake decode does not wait for its KV)
    client = await make_router([p], [d], health=NO_PROBES, upstream_idle_timeout_secs=IDLE_S)
    live = client.app[PROXY].live
    resp = await client.post("/generate", json={"text": "x", "stream": stream, "rid": "r1"})
    assert resp.status == 200  # the client has decode's whole answer
    if stream:
        assert (await read_events(resp))[-1] == "[DONE]"
    else:
        assert (await resp.json())["meta_info"]["finish_reason"]["type"] == "length"
    prefill = client.registry.get(p.url)
    assert prefill.inflight == 1 and len(live) == 1, "the lingering prefill leg keeps its request live"
    await wait_for(lambda: prefill.inflight == 0, timeout=IDLE_S * 3 + 2, message="the hung prefill cut")
    assert len(live) == 0 and prefill.failures_total == 1
    await wait_for(lambda: {"rid": "r1"} in p.aborts, message="the hung prefill aborted on its server")
    await settled(client)


async def test_no_cut_while_silence_is_held_and_silence_so_far_does_not_count_after(sim_workers, make_router):
    p, d = await sim_workers(1, 1)
    d.set_faults(hang_after_tokens=1)  # one event, then nothing
    client = await make_router([p], [d], health=NO_PROBES, upstream_idle_timeout_secs=IDLE_S)
    legs, traffic = pool(client), client.app[TRAFFIC]
    traffic.expect_silence("pause_generation")
    resp = await client.post("/generate", json={"text": "x", "stream": True})
    first = await resp.content.readuntil(b"\n\n")
    assert b"output_ids" in first
    looks = legs.silence_looks_total
    await wait_for(lambda: legs.silence_looks_total >= looks + 12, message="three timeouts' worth of looks")
    assert legs.silence_cuts_total == 0 and d.in_handler == 1
    traffic.end_silence("pause_generation")
    released = time.monotonic()
    events = await read_events(resp)
    assert "UpstreamSilent" in events[-2]["error"]["message"]
    assert time.monotonic() - released >= IDLE_S, "the held silence did not count"
    await settled(client)


# ---- with the weight flow: a pause in place holds the silence until continue_generation -----------------------
SIM = dict(health_check_s=0.0, bootstrap_retries=3, bootstrap_retry_interval_s=0.02, deferred_release_s=0.0,
           decode_step_s=0.01)


async def test_a_stream_paused_in_place_longer_than_the_timeout_finishes_after_continue(aiohttp_client):
    async with Fleet(1, 1, **SIM) as fleet:
        config = RouterConfig(prefill=(WorkerSpec(fleet.prefill[0].url, fleet.prefill[0].bootstrap_port),),
                              decode=(WorkerSpec(fleet.decode[0].url),), health=NO_PROBES,
                              upstream_idle_timeout_secs=IDLE_S).validated()
        client = await aiohttp_client(create_app(config), server_kwargs={"handler_cancellation": True})
        legs = pool(client)
        body = {"text": "a story", "stream": True, "sampling_params": {"max_new_tokens": 80, "temperature": 0}}
        resp = await client.post("/generate", json=body)
        assert b"output_ids" in await resp.content.readuntil(b"\n\n")
        pause = await client.post("/pause_generation", json={"mode": "in_place"})
        assert pause.status == 200, await pause.text()
        looks = legs.silence_looks_total
        await wait_for(lambda: legs.silence_looks_total >= looks + 12, message="three timeouts' worth of looks")
        assert legs.silence_cuts_total == 0
        resumed = await client.post("/continue_generation", json={})
        assert resumed.status == 200, await resumed.text()
        events = await read_events(resp)
        assert events[-1] == "[DONE]" and events[-2]["meta_info"]["finish_reason"]["type"] == "length", events[-2:]
        assert legs.silence_cuts_total == 0
