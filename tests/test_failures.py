"""Failures on the request path: retries exhausted, overload, oversized bodies, hangs, and real worker
processes killed or hung mid-request (the simulator's process fleet). Every test ends with every in-flight
count (per worker and admission) back at zero."""

from __future__ import annotations

import asyncio

import aiohttp
import orjson
import pytest

from router.core.config import AdmissionConfig, BreakerConfig, HealthConfig, RetryConfig
from router.control.health import HEALTH
from router.dataplane.admission import ADMISSION
from router.core.registry import Role
from simulator.config import Timing
from simulator.fleet import Fleet
from tests.sim_support import FAST

from .helpers import wait_for
from .test_metrics import scrape, value
from .test_proxy import read_events

NO_PROBES = HealthConfig(enabled=False)
FAST_RETRY = RetryConfig(max_retries=2, initial_backoff_ms=1, max_backoff_ms=5)


async def settled(client) -> None:
    """Nothing leaked: every worker's count and the admission count back at zero."""
    await wait_for(lambda: all(w.inflight == 0 for w in client.registry.workers()), message="worker in-flight 0")
    await wait_for(lambda: client.app[ADMISSION].active == 0 and client.app[ADMISSION].waiting == 0,
                   message="admission empty")


# ---- retries ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
async def test_retry_exhausted_answers_the_last_failure(fake_fleet, make_router, stream):
    p1, p2, d1, d2 = await fake_fleet(2, 2)
    for d in (d1, d2):
        d.behaviour.status = 503
        d.behaviour.error_body = {"error": {"message": "decode overloaded"}}
    client = await make_router([p1, p2], [d1, d2], health=NO_PROBES, retry=FAST_RETRY,
                               breaker=BreakerConfig(enabled=False))
    resp = await client.post("/generate", json={"text": "x", "stream": stream})
    assert resp.status == 503
    assert (await resp.json())["error"]["message"] == "decode overloaded"
    bodies = d1.bodies() + d2.bodies()
    assert len(bodies) == 1 + FAST_RETRY.max_retries, "bounded: one attempt plus max_retries"
    assert len({b["bootstrap_room"] for b in bodies}) == len(bodies), "a fresh room every attempt"
    assert len({b["rid"] for b in bodies}) == len(bodies)
    m = await scrape(client)
    assert value(m, "pd_router_retries_total", route="/generate", reason="failure") == FAST_RETRY.max_retries
    await settled(client)


async def test_prefill_server_error_is_retried_on_a_fresh_pair(sim_workers, make_router):
    p1, p2, d = await sim_workers(2, 1)
    p1.set_faults(error_rate=1.0, error_status=500)
    client = await make_router([p1, p2], [d], health=NO_PROBES, retry=FAST_RETRY, prefill_policy="round_robin",
                               breaker=BreakerConfig(failure_threshold=5))
    resp = await client.post("/generate", json={"text": "x"})
    assert resp.status == 200
    assert len(p1.bodies()) == 1 and len(p2.bodies()) == 1
    assert p1.bodies()[0]["bootstrap_room"] != p2.bodies()[0]["bootstrap_room"]
    record = client.app[HEALTH].record(client.registry.get(p1.url))
    assert record.breaker.failures == 1, "a plain 500 counts against the prefill"
    await settled(client)


async def test_failed_kv_transfer_is_not_blamed_on_the_server_reporting_it(fake_fleet, make_router):
    """When a decode dies, its prefill answers 500 KVTransferError: retried, and no breaker count."""
    p1, p2, d = await fake_fleet(2, 1)
    p1.behaviour.status = 500
    p1.behaviour.error_body = {"object": "error", "message": "Prefill transfer failed for request rank=0 ... "
                               "with exception KVTransferError(bootstrap_room=1): Failed due to an unknown reason"}
    client = await make_router([p1, p2], [d], health=NO_PROBES, retry=FAST_RETRY, prefill_policy="round_robin",
                               breaker=BreakerConfig(failure_threshold=1))
    assert (await client.post("/generate", json={"text": "x"})).status == 200
    worker = client.registry.get(p1.url)
    assert worker.breaker == "closed" and client.app[HEALTH].record(worker).breaker.failures == 0
    await settled(client)


async def test_connection_refused_everywhere_is_502_json(sim_workers, make_router):
    p, d = await sim_workers(1, 1)
    client = await make_router([p], [d], health=NO_PROBES, retry=FAST_RETRY, breaker=BreakerConfig(enabled=False))
    await d.stop()
    resp = await client.post("/generate", json={"text": "x"})
    assert resp.status == 502
    assert "decode" in (await resp.json())["error"]["message"]
    await settled(client)


async def test_client_errors_are_not_retried(sim_workers, make_router):
    p, d1, d2 = await sim_workers(1, 2)
    for d in (d1, d2):
        d.set_faults(error_rate=1.0, error_status=400)
    client = await make_router([p], [d1, d2], health=NO_PROBES, retry=FAST_RETRY)
    assert (await client.post("/generate", json={"text": "x"})).status == 400
    assert len(d1.bodies()) + len(d2.bodies()) == 1
    await settled(client)


async def test_no_retry_after_output_was_sent(sim_workers, make_router):
    p, d1, d2 = await sim_workers(1, 2)
    for d in (d1, d2):
        d.set_faults(crash_after_tokens=2)
    client = await make_router([p], [d1, d2], health=NO_PROBES, retry=FAST_RETRY)
    resp = await client.post("/generate", json={"text": "x", "stream": True})
    events = await read_events(resp)
    assert resp.status == 200 and events[-1] == "[DONE]" and "error" in events[-2]
    assert len(d1.bodies()) + len(d2.bodies()) == 1, "the stream had started: never re-sent"
    await settled(client)


# ---- overload -----------------------------------------------------------------------------------------------
async def test_queue_full_is_429_with_retry_after(sim_workers, make_router):
    p, d = await sim_workers(1, 1)
    d.set_faults(hang_after_tokens=1)
    client = await make_router([p], [d], health=NO_PROBES,
                               admission=AdmissionConfig(max_concurrent_requests=1, queue_size=1,
                                                         queue_timeout_secs=30))
    admission = client.app[ADMISSION]
    first = asyncio.ensure_future(client.post("/generate", json={"text": "a"}))
    await wait_for(lambda: d.in_handler == 1)
    second = asyncio.ensure_future(client.post("/generate", json={"text": "b"}))
    await wait_for(lambda: admission.waiting == 1, message="second request queued")
    resp = await client.post("/generate", json={"text": "c"})
    assert resp.status == 429 and resp.headers["Retry-After"] == "1"
    assert "queue is full" in (await resp.json())["error"]["message"]
    m = await scrape(client)
    assert value(m, "pd_router_queue_length") == 1 and value(m, "pd_router_admission_rejected_total") == 1
    d.set_faults(hang_after_tokens=None)
    assert [(await first).status, (await second).status] == [200, 200]
    assert len(d.bodies()) == 2, "the refused request never reached a worker"
    await settled(client)


async def test_queue_timeout_is_503_with_retry_after(sim_workers, make_router):
    p, d = await sim_workers(1, 1)
    d.set_faults(hang_after_tokens=1)
    client = await make_router([p], [d], health=NO_PROBES,
                               admission=AdmissionConfig(max_concurrent_requests=1, queue_size=4,
                                                         queue_timeout_secs=0.2))
    first = asyncio.ensure_future(client.post("/generate", json={"text": "a"}))
    await wait_for(lambda: d.in_handler == 1)
    resp = await client.post("/generate", json={"text": "b"})
    assert resp.status == 503 and "Retry-After" in resp.headers
    assert "queue timeout" in (await resp.json())["error"]["message"]
    d.set_faults(hang_after_tokens=None)
    assert (await first).status == 200
    await settled(client)


@pytest.mark.parametrize("path", ["/generate", "/v1/chat/completions", "/workers", "/register"])
async def test_body_too_large_is_413_json(sim_workers, make_router, path):
    p, d = await sim_workers(1, 1)
    client = await make_router([p], [d], health=NO_PROBES, admission=AdmissionConfig(max_payload_size=1024))
    body = orjson.dumps({"text": "x" * 4096, "messages": [{"role": "user", "content": "y" * 4096}]})
    resp = await client.post(path, data=body, headers={"Content-Type": "application/json"})
    assert resp.status == 413
    assert "1024" in (await resp.json())["error"]["message"]
    assert p.requests == [] and d.requests == []
    ok = await client.post("/generate", json={"text": "small"})
    assert ok.status == 200
    await settled(client)


# ---- hangs --------------------------------------------------------------------------------------------------
async def test_decode_stalling_mid_stream_ends_at_the_deadline(fake_fleet, make_router):
    p, d = await fake_fleet(1, 1)
    d.behaviour.stream_chunks, d.behaviour.stall_after = 4, 1
    client = await make_router([p], [d], health=NO_PROBES, request_timeout_secs=0.5)
    resp = await client.post("/generate", json={"text": "x", "stream": True})
    assert resp.status == 200
    events = await read_events(resp)
    assert events[0]["output_ids"] == [0]
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == 504
    await wait_for(lambda: len(d.aborts) == 1, message="the stalled leg was aborted on its server")
    await settled(client)


async def test_request_deadline_on_a_hung_decode_is_504_naming_the_pair(sim_workers, make_router):
    p, d = await sim_workers(1, 1)
    d.set_faults(hang_after_tokens=1)
    client = await make_router([p], [d], health=NO_PROBES, request_timeout_secs=0.3)
    resp = await client.post("/generate", json={"text": "x"})
    assert resp.status == 504
    error = (await resp.json())["error"]
    assert error["decode"] == d.url and error["prefill"] == p.url
    await wait_for(lambda: len(d.aborts) == 1, message="the hung leg was aborted on its server")
    await wait_for(lambda: d.in_handler == 0, message="its connection closed")
    m = await scrape(client)
    assert value(m, "pd_router_aborts_total", reason="timeout") == 1
    await settled(client)


# ---- real worker processes ------------------------------------------------------------------------------
# A killed process refuses connections at once; the timeout only has to survive a loaded machine.
SIM_HEALTH = HealthConfig(interval_secs=0.1, timeout_secs=2.0, failure_threshold=1, success_threshold=2)
LONG = {"text": "tell me a long story", "sampling_params": {"max_new_tokens": 150, "ignore_eos": True}}
SHORT = {"text": "hi", "sampling_params": {"max_new_tokens": 4}}


async def restart(fleet: Fleet, index: int) -> None:
    """Start the killed decode again on its old port (a crashed server brought back by its supervisor)."""
    old = fleet.decode[index]
    if old.process is not None and old.process.stdout is not None:
        old.process.stdout.close()
    cfg = fleet.config.with_(role="decode", port=old.port, bootstrap_port=0)
    fleet.decode[index] = await fleet._spawn(cfg)


@pytest.fixture
async def sim():
    """Simulated workers: `await sim(decodes, processes=...)`; stopped after the test."""
    fleets: list[Fleet] = []

    async def start(decodes: int = 2, processes: bool = False, prefills: int = 1, **overrides) -> Fleet:
        fleet = await Fleet(prefills, decodes, processes=processes, timing=Timing(decode_step_s=0.02),
                            **{**FAST, **overrides}).start()
        fleets.append(fleet)
        return fleet

    yield start
    for fleet in fleets:
        await fleet.stop()


async def test_decode_process_killed_mid_request_and_brought_back(sim, make_router):
    """SIGKILL a decode serving a stream and a unary request: the stream ends with an SSE error event, the
    unary request is re-sent to the other decode, the dead one leaves routing, and rejoins once restarted."""
    fleet = await sim(2, processes=True)
    client = await make_router(fleet.prefill, fleet.decode, health=SIM_HEALTH, retry=FAST_RETRY,
                               decode_policy="round_robin",
                               breaker=BreakerConfig(failure_threshold=1, timeout_secs=0.5))
    decodes = client.registry.workers(Role.DECODE)
    async with client.post("/generate", json={**LONG, "stream": True}) as stream:
        assert stream.status == 200
        assert (await stream.content.readuntil(b"\n\n")).startswith(b"data: ")
        (victim,) = [w for w in decodes if w.inflight == 1]
        # Round robin: the second unary request lands on the stream's decode.
        unary = [asyncio.ensure_future(client.post("/generate", json=LONG)) for _ in range(2)]
        await wait_for(lambda: victim.inflight == 2 and sum(w.inflight for w in decodes) == 3)
        index = next(i for i, h in enumerate(fleet.decode) if h.url == victim.url)
        fleet.kill(fleet.decode[index])
        rest = await stream.read()
    tail = [block for block in rest.split(b"\n\n") if block.startswith(b"data: ")]
    assert tail[-1] == b"data: [DONE]" and b"error" in tail[-2], "stream: SSE error event, then [DONE]"
    answers = [await task for task in unary]
    assert [a.status for a in answers] == [200, 200], "no byte had been sent: re-sent, not lost"
    assert [(await a.json())["meta_info"]["completion_tokens"] for a in answers] == [150, 150]
    m = await scrape(client)
    assert value(m, "pd_router_retries_total", route="/generate", reason="failure") == 1
    await settled(client)
    await wait_for(lambda: not victim.healthy, message="the killed decode leaves routing")
    statuses = await asyncio.gather(*(client.post("/generate", json=SHORT) for _ in range(6)))
    assert [r.status for r in statuses] == [200] * 6
    await restart(fleet, index)
    await wait_for(lambda: victim.healthy, timeout=15, message="the restarted decode rejoins by itself")
    assert victim in client.registry.routable(Role.DECODE)
    await settled(client)


async def test_last_worker_of_a_pool_is_not_evicted(sim_workers, make_router):
    """Probes fail on the only decode: its waiting request is not failed over to nowhere; it keeps waiting
    and succeeds when the server answers."""
    p, d = await sim_workers(1, 1)
    d.set_faults(hang_after_tokens=1)
    client = await make_router([p], [d], retry=FAST_RETRY,
                               health=HealthConfig(interval_secs=0.02, timeout_secs=0.5, failure_threshold=1,
                                                   success_threshold=1))
    worker = client.registry.get(d.url)
    await wait_for(lambda: client.app[HEALTH].record(worker).probe.proven)
    pending = asyncio.ensure_future(client.post("/generate", json={"text": "x"}))
    await wait_for(lambda: d.in_handler == 1)
    d.set_faults(unhealthy=True)
    await wait_for(lambda: not worker.healthy)
    assert not pending.done() and d.aborts == [] and d.in_handler == 1
    d.set_faults(unhealthy=False)
    d.set_faults(hang_after_tokens=None)
    assert (await pending).status == 200
    await settled(client)


async def test_hung_decode_costs_no_request(sim, make_router):
    """Requests caught on a decode that stops making progress are re-routed once its probes fail; the ones
    after that never go there."""
    fleet = await sim(2)
    client = await make_router(fleet.prefill, fleet.decode, request_timeout_secs=30, retry=FAST_RETRY,
                               health=HealthConfig(interval_secs=0.1, timeout_secs=1.0, failure_threshold=2,
                                                   success_threshold=1))
    hung = fleet.decode[0]
    hung_worker = client.registry.get(hung.url)
    await fleet.set_faults(hung, hang=True)
    caught = [asyncio.ensure_future(client.post("/generate", json=SHORT)) for _ in range(4)]
    await wait_for(lambda: not hung_worker.healthy, timeout=5, message="probes time out: out of routing")
    served_there = hung_worker.requests_total
    statuses = await asyncio.gather(*(client.post("/generate", json=SHORT) for _ in range(6)))
    assert [r.status for r in statuses] == [200] * 6
    assert hung_worker.requests_total == served_there, "nothing routed to it after it left"
    assert [(await task).status for task in caught] == [200] * 4, "the caught ones were re-routed"
    await fleet.set_faults(hung, reset=True)
    await wait_for(lambda: hung_worker.healthy, timeout=5, message="back once it answers")
    await settled(client)


@pytest.mark.parametrize("stream", [False, True])
async def test_requests_waiting_on_a_worker_declared_down_are_rerouted(sim, make_router, stream):
    """A prefill hangs (generation and /health): once its probes fail, the requests waiting on it are re-sent
    to another pair at once instead of waiting for the request deadline (here 60 s)."""
    # A short KV wait: the simulator's decode otherwise keeps pulling from the hung prefill for 300 s after
    # the abort, which holds its shutdown.
    fleet = await sim(decodes=1, prefills=2, kv_wait_timeout_s=2.0)
    hung = fleet.prefill[0]
    client = await make_router(fleet.prefill, fleet.decode, request_timeout_secs=60, retry=FAST_RETRY,
                               prefill_policy="round_robin",
                               health=HealthConfig(interval_secs=0.05, timeout_secs=0.5, failure_threshold=2,
                                                   success_threshold=1))
    hung_worker = client.registry.get(hung.url)
    await wait_for(lambda: client.app[HEALTH].record(hung_worker).probe.proven)
    await fleet.set_faults(hung, hang=True)
    pending = asyncio.ensure_future(client.post("/generate", json={**SHORT, "stream": stream}))
    await wait_for(lambda: hung_worker.inflight == 1, message="the request waits on the hung prefill")
    resp = await asyncio.wait_for(pending, 10)
    assert resp.status == 200
    if stream:
        assert (await read_events(resp))[-1] == "[DONE]"
    else:
        assert (await resp.json())["meta_info"]["completion_tokens"] == 4
    assert not hung_worker.healthy and hung_worker.requests_total == 1
    await fleet.wait_for(hung, lambda state: not state["rids_by_phase"], timeout=5)  # aborted there
    await fleet.set_faults(hung, reset=True)
    await settled(client)
