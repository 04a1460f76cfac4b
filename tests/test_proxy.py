"""The request path against fake workers: injection, relay, merge, failures, cancellation."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import aiohttp
import orjson
import pytest
from aiohttp import web

from router.core.config import AdmissionConfig, RouterConfig, WorkerSpec
from router.core.keys import REGISTRY
from router.core.registry import Role
from router.server.app import create_app

from .conftest import RUNNER_KWARGS
from .helpers import wait_for


async def read_events(resp) -> list:
    raw = await resp.read()
    events = []
    for block in raw.split(b"\n\n"):
        if block.startswith(b"data: "):
            payload = block[6:]
            events.append("[DONE]" if payload == b"[DONE]" else orjson.loads(payload))
    return events


def inflight(client) -> list[int]:
    return [w.inflight for w in client.registry.workers()]


async def test_generate_injects_bootstrap_and_relays_decode(fake_fleet, make_router):
    p, d = await fake_fleet(1, 1)
    client = await make_router([p], [d])
    resp = await client.post("/generate", json={"text": "hello", "sampling_params": {"max_new_tokens": 3}})
    assert resp.status == 200
    body = await resp.json()
    assert body["meta_info"]["role"] == "decode"  # decode's answer is relayed
    (pb,), (db,) = p.bodies(), d.bodies()
    assert pb == db, "both legs get the same body"
    assert pb["bootstrap_host"] == "127.0.0.1"
    assert pb["bootstrap_port"] == p.bootstrap_port
    assert isinstance(pb["bootstrap_room"], int) and 0 <= pb["bootstrap_room"] < 2**63
    assert pb["text"] == "hello" and pb["rid"]
    await wait_for(lambda: inflight(client) == [0, 0])


async def test_rooms_are_distinct_per_request(sim_workers, make_router):
    p, d = await sim_workers(1, 1)
    client = await make_router([p], [d])
    await asyncio.gather(*(client.post("/generate", json={"text": f"q{i}"}) for i in range(20)))
    rooms = [b["bootstrap_room"] for b in p.bodies()]
    assert len(rooms) == 20 and len(set(rooms)) == 20


@pytest.mark.parametrize("body,count", [
    ({"text": ["a", "b", "c"]}, 3),
    ({"input_ids": [[1, 2], [3, 4]]}, 2),
    ({"text": "a", "sampling_params": {"n": 4}}, 4),
    ({"text": ["a", "b"], "sampling_params": {"n": 2}}, 4),
])
async def test_batches_get_one_distinct_room_per_sequence(fake_fleet, make_router, body, count):
    p, d = await fake_fleet(1, 1)
    client = await make_router([p], [d], admission=AdmissionConfig(max_n=128))  # servers that serve n > 1
    resp = await client.post("/generate", json=body)
    assert resp.status == 200
    (sent,) = p.bodies()
    assert len(sent["bootstrap_room"]) == count == len(set(sent["bootstrap_room"]))
    assert sent["bootstrap_host"] == ["127.0.0.1"] * count
    assert sent["bootstrap_port"] == [p.bootstrap_port] * count


@pytest.mark.parametrize("path,body,count", [
    ("/v1/completions", {"model": "m", "prompt": ["a", "b"]}, 2),
    ("/v1/completions", {"model": "m", "prompt": "a", "n": 3}, 3),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 2}, 2),
])
async def test_openai_list_prompts_and_n_get_distinct_rooms(fake_fleet, make_router, path, body, count):
    p, d = await fake_fleet(1, 1)
    client = await make_router([p], [d], admission=AdmissionConfig(max_n=128))  # servers that serve n > 1
    resp = await client.post(path, json=body)
    assert resp.status == 200
    (sent,) = p.bodies(path)
    assert len(set(sent["bootstrap_room"])) == count


async def test_client_rid_and_headers_pass_through(sim_workers, make_router):
    p, d = await sim_workers(1, 1)
    client = await make_router([p], [d])
    resp = await client.post("/generate", json={"text": "x", "rid": "my-rid"},
                             headers={"Authorization": "Bearer abc", "X-Request-Id": "req-7"})
    assert resp.status == 200
    assert p.bodies()[0]["rid"] == "my-rid" == d.bodies()[0]["rid"]


async def test_logprobs_merged_non_streaming(fake_fleet, make_router):
    p, d = await fake_fleet(1, 1)
    client = await make_router([p], [d])
    resp = await client.post("/generate", json={"text": "x", "return_logprob": True})
    body = await resp.json()
    assert body["meta_info"]["input_token_logprobs"] == [[-1.0, 1, None]]


async def test_streaming_relays_events_and_done(fake_fleet, make_router):
    p, d = await fake_fleet(1, 1)
    d.behaviour.stream_chunks = 4
    client = await make_router([p], [d])
    resp = await client.post("/generate", json={"text": "x", "stream": True})
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    events = await read_events(resp)
    assert events[-1] == "[DONE]"
    assert [e["output_ids"] for e in events[:-1]] == [[0], [0, 1], [0, 1, 2], [0, 1, 2, 3]]
    await wait_for(lambda: inflight(client) == [0, 0])


async def test_streaming_logprob_merge_on_every_event(fake_fleet, make_router):
    p, d = await fake_fleet(1, 1)
    client = await make_router([p], [d])
    resp = await client.post("/generate", json={"text": "x", "stream": True, "return_logprob": True})
    events = await read_events(resp)
    assert len(events) == 4 and events[-1] == "[DONE]"
    for event in events[:-1]:
        assert event["meta_info"]["input_token_logprobs"] == [[-1.0, 1, None]]


async def test_prefill_error_is_returned_at_once_and_decode_aborted(fake_fleet, make_router):
    p, d = await fake_fleet(1, 1)
    p.behaviour.status = 400
    p.behaviour.error_body = {"error": {"message": "bad sampling params"}}
    d.behaviour.hang = True  # decode would wait for KV forever
    client = await make_router([p], [d])
    resp = await asyncio.wait_for(client.post("/generate", json={"text": "x"}), 5)
    assert resp.status == 400
    assert (await resp.json())["error"]["message"] == "bad sampling params"
    rid = p.bodies()[0]["rid"]
    await wait_for(lambda: {"rid": rid} in d.aborts, message="decode leg aborted")
    await wait_for(lambda: d.in_handler == 0, message="decode connection closed")
    await wait_for(lambda: inflight(client) == [0, 0])


async def test_prefill_error_in_streaming_mode_is_plain_http(sim_workers, make_router):
    p, d = await sim_workers(1, 1)
    p.set_faults(error_rate=1.0, error_status=400)
    d.set_faults(hang_after_tokens=1)
    client = await make_router([p], [d])
    resp = await asyncio.wait_for(client.post("/generate", json={"text": "x", "stream": True}), 5)
    assert resp.status == 400
    await wait_for(lambda: len(d.aborts) == 1)
    await wait_for(lambda: inflight(client) == [0, 0])


async def test_decode_cut_mid_stream_ends_with_error_event_and_done(fake_fleet, make_router):
    p, d = await fake_fleet(1, 1)
    d.behaviour.stream_chunks = 5
    d.behaviour.cut_after = 2
    client = await make_router([p], [d])
    resp = await client.post("/generate", json={"text": "x", "stream": True})
    assert resp.status == 200
    events = await read_events(resp)
    assert events[-1] == "[DONE]"
    assert "error" in events[-2]
    assert [e["output_ids"] for e in events[:2]] == [[0], [0, 1]]
    await wait_for(lambda: inflight(client) == [0, 0])


@pytest.mark.parametrize("stream", [False, True])
async def test_client_disconnect_aborts_both_legs(fake_fleet, make_router, stream):
    p, d = await fake_fleet(1, 1)
    d.behaviour.hang = True
    client = await make_router([p], [d])
    task = asyncio.ensure_future(client.post("/generate", json={"text": "x", "stream": stream}))
    await wait_for(lambda: d.in_handler == 1 and client.registry.workers(Role.DECODE)[0].inflight == 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    rid = d.bodies()[0]["rid"]
    await wait_for(lambda: {"rid": rid} in d.aborts, message="decode aborted")
    await wait_for(lambda: {"rid": rid} in p.aborts or p.in_handler == 0, message="prefill done or aborted")
    await wait_for(lambda: inflight(client) == [0, 0], message="no leaked in-flight count")


async def test_unreachable_prefill_is_retried_on_another_pair(sim_workers, make_router):
    p_dead, p_ok, d = await sim_workers(2, 1)
    client = await make_router([p_dead, p_ok], [d], retry=__import__("router.core.config").core.config.RetryConfig(
        initial_backoff_ms=1))
    await p_dead.stop()
    statuses = []
    for i in range(8):
        resp = await client.post("/generate", json={"text": f"x{i}"})
        statuses.append(resp.status)
    assert statuses == [200] * 8
    await wait_for(lambda: inflight(client) == [0, 0, 0])


async def test_no_routable_worker_is_503_json(sim_workers, make_router):
    (p,) = await sim_workers(1, 0)
    client = await make_router([p], [])
    resp = await client.post("/generate", json={"text": "x"})
    assert resp.status == 503
    assert "decode" in (await resp.json())["error"]["message"]


@pytest.mark.parametrize("data,fragment", [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "JSON object"),
    (b'{"text": 5}', "text must be"),
    (b'{"text": "a", "sampling_params": {"n": 0}}', "n must be"),
])
async def test_bad_input_is_400_json(sim_workers, make_router, data, fragment):
    p, d = await sim_workers(1, 1)
    client = await make_router([p], [d])
    resp = await client.post("/generate", data=data, headers={"Content-Type": "application/json"})
    assert resp.status == 400
    assert fragment in (await resp.json())["error"]["message"]
    assert p.requests == [] and d.requests == []


async def test_request_timeout_gives_504_and_aborts(sim_workers, make_router):
    p, d = await sim_workers(1, 1)
    d.set_faults(hang_after_tokens=1)
    client = await make_router([p], [d], request_timeout_secs=0.3)
    resp = await client.post("/generate", json={"text": "x"})
    assert resp.status == 504
    await wait_for(lambda: len(d.aborts) == 1)
    await wait_for(lambda: inflight(client) == [0, 0])



@contextlib.asynccontextmanager
async def without_handler_cancellation(p, d):
    """A router app on a port of its own that never cancels a handler whose client left (the window between a
    connection closing and aiohttp's cancellation, held open): its URL and registry."""
    config = RouterConfig(prefill=(WorkerSpec(p.url, p.bootstrap_port),), decode=(WorkerSpec(d.url),)).validated()
    runner = web.AppRunner(create_app(config), handler_cancellation=False, **RUNNER_KWARGS)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}", runner.app[REGISTRY]
    finally:
        await runner.cleanup()


async def test_a_stream_whose_client_left_ends_as_a_disconnect_not_an_error(sim_workers, caplog):
    """Writing the stream fails once the client has gone, before anything cancelled the handler (here: no
    handler cancellation at all): the request ends as the client's disconnect (both legs stopped and aborted,
    counted once), never as an unhandled error."""
    p, d = await sim_workers(1, 1)
    d.set_faults(hang_after_tokens=1)
    async with without_handler_cancellation(p, d) as (url, registry):
        async with aiohttp.ClientSession() as session:
            resp = await session.post(url + "/generate", json={"text": "x", "stream": True})
            assert resp.status == 200
            assert (await resp.content.readany()).startswith(b"data: ")
            resp.close()  # the client leaves while decode is stalled
            caplog.set_level("INFO", logger="router")
            d.set_faults(hang_after_tokens=None)  # decode goes on: the router's next writes find the client gone
            await wait_for(lambda: [w.inflight for w in registry.workers()] == [0, 0], message="both legs ended")
            rid = d.bodies()[0]["rid"]
            await wait_for(lambda: {"rid": rid} in d.aborts, message="decode aborted")
            async with session.get(url + "/metrics") as answer:
                metrics = await answer.text()
        assert 'pd_router_request_outcomes_total{outcome="client_disconnect",route="/generate"} 1.0' in metrics, \
            [line for line in metrics.splitlines() if "outcomes" in line]
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert not errors, errors


async def test_a_client_gone_before_the_streams_head_ends_as_a_disconnect_not_an_error(fake_fleet, caplog):
    """The client leaves while decode has not answered, and decode's first event comes before anything
    cancelled the handler (its connection closing: here no handler cancellation at all): writing the stream's
    head fails, and the request ends as the client's disconnect (both legs ended, decode aborted), never as an
    unhandled error (the hostile fuzz saw one under load)."""
    p, d = await fake_fleet(1, 1)
    d.behaviour.hang = True
    async with without_handler_cancellation(p, d) as (url, registry):
        async with aiohttp.ClientSession() as session:
            request = asyncio.ensure_future(session.post(url + "/generate", json={"text": "x", "stream": True}))
            await wait_for(lambda: d.in_handler == 1, message="decode has the request")
            request.cancel()  # the client leaves before the stream began
            with pytest.raises(asyncio.CancelledError):
                await request
            caplog.set_level("INFO", logger="router")
            d.release.set()  # decode answers: the router's first write finds the client gone
            await wait_for(lambda: [w.inflight for w in registry.workers()] == [0, 0], message="both legs ended")
            rid = d.bodies()[0]["rid"]
            await wait_for(lambda: {"rid": rid} in d.aborts, message="decode aborted")
            async with session.get(url + "/metrics") as answer:
                metrics = await answer.text()
        assert 'pd_router_request_outcomes_total{outcome="client_disconnect",route="/generate"} 1.0' in metrics, \
            [line for line in metrics.splitlines() if "outcomes" in line]
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert not errors, errors
