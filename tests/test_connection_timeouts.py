"""SMG's connection bounds, in front of a simulated 1P+1D fleet: --upstream-pool-idle-timeout-secs (pooled
connections to the workers closed when idle that long), --stream-body-stall-timeout-secs (408 for a body that
stops arriving), --sse-keepalive-secs (SSE comments while decode is silent; none by default, since SGLang's own
bench_serving parses every line as an event), --header-read-timeout-secs and --idle-connection-timeout-secs (a
router process: a late request head, an idle keep-alive connection, closed)."""

from __future__ import annotations

import asyncio

import aiohttp
import orjson
import pytest

from router.core.config import ConfigError, ConnectionTimeouts
from router.dataplane.proxy import PROXY
from router.server.cli import config_from_args

from .helpers import wait_for
from .router_process import RouterProcess


def _legs(router):
    return router.app[PROXY].dispatcher.upstream  # the legs' pool, as the composition root built it


async def _generate(router, **extra) -> dict:
    resp = await router.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}, **extra})
    assert resp.status == 200, await resp.text()
    return await resp.json()


async def test_idle_pooled_connections_to_the_workers_are_closed_after_the_idle_timeout(fleet, make_router):
    router = await make_router(fleet.prefill, fleet.decode,
                               connections=ConnectionTimeouts(upstream_pool_idle_timeout_secs=0.2))
    legs, decode = _legs(router), fleet.decode[0].url
    await _generate(router)
    connects = legs.connects_total
    await wait_for(lambda: legs.idle_connections(decode) == 0, timeout=10, message="the idle legs to be closed")
    await _generate(router)
    assert legs.connects_total == connects + 2  # both legs on fresh connections


async def test_with_the_default_idle_timeout_the_connections_are_reused(fleet, make_router):
    router = await make_router(fleet.prefill, fleet.decode)
    legs = _legs(router)
    await _generate(router)
    connects = legs.connects_total
    await _generate(router)
    assert legs.connects_total == connects and legs.idle_timeout == 4.0


async def test_a_request_body_that_stops_arriving_is_408_and_reaches_no_worker(fleet, make_router):
    router = await make_router(fleet.prefill, fleet.decode,
                               connections=ConnectionTimeouts(stream_body_stall_timeout_secs=0.3))
    body = orjson.dumps({"text": "hi", "sampling_params": {"max_new_tokens": 2}})
    release = asyncio.Event()

    async def stalling():
        yield body[:5]
        await release.wait()  # the client never sends the rest (until the test ends)
        yield body[5:]

    resp = await router.post("/generate", data=stalling(), headers={"Content-Type": "application/json"})
    release.set()
    answer = await resp.json()
    assert resp.status == 408 and "--stream-body-stall-timeout-secs" in answer["error"]["message"]
    state = await fleet.state(fleet.decode[0])
    assert state["counters"]["requests_by_route"] == {}  # nothing was sent on
    assert router.app[PROXY].admission.active == 0

    async def steady():  # a body sent in pieces without a stall is read whole
        for i in range(0, len(body), 7):
            yield body[i:i + 7]

    resp = await router.post("/generate", data=steady(), headers={"Content-Type": "application/json"})
    assert resp.status == 200 and (await resp.json())["meta_info"]["completion_tokens"] == 2


@pytest.mark.parametrize("keepalive", [0.1, 0.0], ids=["keep-alive comments", "none by default"])
async def test_a_stream_decode_goes_silent_on_gets_comments_then_ends_with_an_error_event(fleet, make_router,
                                                                                         keepalive):
    router = await make_router(fleet.prefill, fleet.decode, upstream_idle_timeout_secs=1.0,
                               connections=ConnectionTimeouts(sse_keepalive_secs=keepalive))
    await fleet.set_faults(fleet.decode[0], hang_after_tokens=1)  # one token, then silence
    resp = await router.post("/generate", json={"text": "hi", "stream": True,
                                                "sampling_params": {"max_new_tokens": 8}})
    raw = await resp.read()  # the idle timeout cuts the silent leg: the stream ends, it does not hang
    assert resp.status == 200
    blocks = [b for b in raw.split(b"\n\n") if b]
    comments = [b for b in blocks if b.startswith(b":")]
    data = [b for b in blocks if not b.startswith(b":")]
    assert all(b.startswith(b"data: ") for b in data), blocks  # a comment is always a whole block of its own
    assert data[-1] == b"data: [DONE]" and b'"error"' in data[-2]
    assert orjson.loads(data[0][6:])["text"] is not None  # the token before the silence
    if keepalive:
        assert comments and set(comments) == {b": keep-alive"}
        assert raw.index(b": keep-alive") > raw.index(data[0])
    else:
        assert not comments


def test_the_timeouts_refuse_negative_values():
    with pytest.raises(ConfigError, match="--sse-keepalive-secs must not be negative"):
        config_from_args(["--sse-keepalive-secs", "-1"], env={})
    config = config_from_args(["--header-read-timeout-secs", "5", "--idle-connection-timeout-secs", "0",
                               "--upstream-pool-idle-timeout-secs", "3", "--stream-body-stall-timeout-secs", "60",
                               "--sse-keepalive-secs", "15"], env={})
    assert config.connections == ConnectionTimeouts(3, 5, 0, 60, 15)


async def _closed_by_router(reader: asyncio.StreamReader, timeout: float) -> bytes:
    """What the router sent until it closed the connection (EOF) within `timeout`."""
    return await asyncio.wait_for(reader.read(), timeout)


async def _header_read_bounds(router: RouterProcess) -> None:
    """--header-read-timeout-secs 0.5 with connections kept 60 s when idle: the late heads are closed in time."""
    late, late_writer = await asyncio.open_connection("127.0.0.1", router.port)
    late_writer.write(b"POST /generate HTTP/1.1\r\nHost: x\r\n")  # a head that never ends (slowloris)
    silent, silent_writer = await asyncio.open_connection("127.0.0.1", router.port)  # never sends one
    again, again_writer = await asyncio.open_connection("127.0.0.1", router.port)
    again_writer.write(b"GET /liveness HTTP/1.1\r\nHost: x\r\n\r\n")
    try:
        assert (await asyncio.wait_for(again.readuntil(b"\r\n\r\nOK"), 10)).startswith(b"HTTP/1.1 200")
        again_writer.write(b"GET /liveness HTTP/1.1\r\n")  # its next head, begun and never ended
        for reader in (late, silent, again):
            assert await asyncio.wait_for(reader.read(), 10) == b""  # closed by the router (EOF)
    finally:
        for writer in (late_writer, silent_writer, again_writer):
            writer.close()


async def _idle_connection_bound(router: RouterProcess) -> None:
    """--idle-connection-timeout-secs 0.5: a keep-alive connection served once, then idle, is closed."""
    idle, idle_writer = await asyncio.open_connection("127.0.0.1", router.port)
    idle_writer.write(b"GET /liveness HTTP/1.1\r\nHost: x\r\n\r\n")
    try:
        answered = await asyncio.wait_for(idle.read(), 10)
        assert answered.startswith(b"HTTP/1.1 200") and answered.endswith(b"OK")
    finally:
        idle_writer.close()


async def test_a_late_request_head_and_an_idle_keep_alive_connection_are_closed(fleet, tmp_path):
    heads = RouterProcess(fleet, "--header-read-timeout-secs", "0.5", "--idle-connection-timeout-secs", "60",
                          log_path=tmp_path / "heads.log")
    idle = RouterProcess(fleet, "--header-read-timeout-secs", "0", "--idle-connection-timeout-secs", "0.5",
                         log_path=tmp_path / "idle.log")
    async with heads, idle:
        await asyncio.gather(_header_read_bounds(heads), _idle_connection_bound(idle))
        async with aiohttp.ClientSession() as session:  # both serve on
            for router in (heads, idle):
                async with session.post(router.url + "/generate", json={"text": "hi"}) as resp:
                    assert resp.status == 200


def _blocks(raw: bytes) -> tuple[list[bytes], list[bytes]]:
    blocks = [b for b in raw.split(b"\n\n") if b]
    return blocks, [b for b in blocks if not b.startswith(b":")]


async def test_keep_alive_comments_cover_a_long_prefill_before_the_first_token(make_router):
    from simulator.fleet import Fleet

    from .sim_support import FAST

    async with Fleet(1, 1, prefill_overrides={"prefill_overhead_s": 0.6}, **FAST) as slow:
        router = await make_router(slow.prefill, slow.decode, connections=ConnectionTimeouts(sse_keepalive_secs=0.1))
        resp = await router.post("/generate", json={"text": "hi", "stream": True,
                                                    "sampling_params": {"max_new_tokens": 3}})
        raw = await resp.read()
        blocks, data = _blocks(raw)
        assert resp.status == 200 and blocks[0] == b": keep-alive"  # the head and a comment before any token
        assert all(b.startswith(b"data: ") for b in data) and data[-1] == b"data: [DONE]"
        assert not any(b'"error"' in b for b in data)
        assert sum(orjson.loads(b[6:])["meta_info"]["completion_tokens"] == 3 for b in data[:-1]) == 1


async def test_a_kept_alive_stream_whose_prefill_never_answers_ends_with_an_error_event(fleet, make_router):
    from router.core.config import RetryConfig

    router = await make_router(fleet.prefill, fleet.decode, upstream_idle_timeout_secs=1.0,
                               retry=RetryConfig(max_retries=0),
                               connections=ConnectionTimeouts(sse_keepalive_secs=0.1))
    await fleet.set_faults(fleet.prefill[0], hang=True)
    resp = await router.post("/generate", json={"text": "hi", "stream": True})
    raw = await resp.read()  # the silent decode leg is cut at the idle timeout: an error event, not a hang
    blocks, data = _blocks(raw)
    assert resp.status == 200 and blocks[0] == b": keep-alive"
    assert data[-1] == b"data: [DONE]" and len(data) == 2 and b'"error"' in data[0], blocks
    assert router.app[PROXY].admission.active == 0
