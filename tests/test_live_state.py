"""The servers are the truth about themselves: start-up, registration and a worker's return read each server's
live role, bootstrap port, weight version and readiness (real HTTP fake servers on loopback)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from router.core.config import HealthConfig
from router.core.registry import Role, WorkerState
from router.core.routability import HoldKind

from simulator.config import WorkerConfig
from simulator.worker import Worker

from .helpers import free_port, wait_for
from .sim_support import FAST as SIM_FAST

FAST = HealthConfig(interval_secs=0.05, timeout_secs=0.5, failure_threshold=1, success_threshold=1)


def shown(listing: dict, url: str) -> dict:
    (entry,) = [w for w in listing["workers"] if w["url"] == url]
    return entry


async def listing(client) -> dict:
    resp = await client.get("/workers")
    assert resp.status == 200
    return await resp.json()


# ---- start-up ------------------------------------------------------------------------------------------------
async def test_a_server_whose_live_role_differs_from_its_flag_is_routed_in_its_live_role(fake_fleet, make_router,
                                                                                          caplog):
    """A router restarted after conversions: its command line still has the launch roles."""
    p, converted_to_prefill, d = await fake_fleet(2, 1)  # the second prefill was a decode the router converted
    converted_to_decode = (await fake_fleet(0, 1))[0]
    converted_to_prefill.bootstrap_port = 9123  # its live bootstrap port
    caplog.set_level(logging.WARNING, logger="router.control.live_state")
    client = await make_router([p, converted_to_decode], [converted_to_prefill, d])
    workers = await listing(client)
    assert shown(workers, converted_to_prefill.url)["worker_type"] == "prefill"
    assert shown(workers, converted_to_prefill.url)["bootstrap_port"] == 9123
    assert shown(workers, converted_to_decode.url)["worker_type"] == "decode"
    assert shown(workers, converted_to_decode.url)["bootstrap_port"] is None
    assert all(w["routable"] for w in workers["workers"])
    messages = [r.getMessage() for r in caplog.records]
    assert f"--decode {converted_to_prefill.url} is now prefill (live role): routing it as prefill with " \
           f"bootstrap port 9123" in messages
    assert f"--prefill {converted_to_decode.url} is now decode (live role): routing it as decode" in messages
    for i in range(6):  # every pair is a real prefill and a real decode
        assert (await client.post("/generate", json={"text": f"x{i}"})).status == 200
    prefill_ports = {body["bootstrap_port"] for fake in (d, converted_to_decode) for body in fake.bodies()}
    assert prefill_ports <= {9000, 9123} and len(converted_to_prefill.bodies()) + len(p.bodies()) == 6


async def test_a_server_not_reachable_at_start_up_stays_pending_and_joins_when_it_answers(sim_workers, make_router):
    (p,) = await sim_workers(1, 0)
    late = Worker(WorkerConfig(role="decode", port=free_port(), bootstrap_port=None, **SIM_FAST))
    client = await make_router([p], [late], health=FAST, worker_startup_timeout_secs=0.3)
    worker = client.registry.get(late.url)
    assert worker.state is WorkerState.PENDING and not worker.routable
    assert (await client.post("/generate", json={"text": "x"})).status == 503
    await late.start()
    try:
        await wait_for(lambda: worker.routable, timeout=10, message="read once it answers")
        assert (await client.post("/generate", json={"text": "x"})).status == 200
    finally:
        await late.stop()


async def test_a_paused_server_is_held_out_with_its_reason_until_it_is_ready(sim_workers, make_router):
    p, d1, d2 = await sim_workers(1, 2)
    await d2.worker.engine.pause("in_place")  # /ready answers 503 while paused (its /health would hang: not probed)
    client = await make_router([p], [d1, d2], health=FAST)
    entry = shown(await listing(client), d2.url)
    assert (entry["state"], entry["routable"], entry["hold"]["kind"]) == ("failed", False, "paused")
    assert "/ready answers 503" in entry["state_reason"]
    calls = d2.health_calls
    for i in range(4):
        assert (await client.post("/generate", json={"text": f"x{i}"})).status == 200
    assert d2.bodies() == [] and d2.health_calls == calls
    d2.worker.engine.resume()
    worker = client.registry.get(d2.url)
    await wait_for(lambda: worker.routable, timeout=10, message="back once /ready answers 200")
    assert worker.state is WorkerState.ACTIVE and worker.hold is None


async def test_servers_on_several_weight_versions_the_fleet_keeps_one_that_can_serve(sim_workers, make_router):
    """After a router died half-way through an update: the version of the pair, even against a majority."""
    (p,) = await sim_workers(1, 0, weight_version="v1")
    (d_old,) = await sim_workers(0, 1, weight_version="v1")
    d_new = await sim_workers(0, 2, weight_version="v2")
    client = await make_router([p], [d_old, *d_new])
    assert client.registry.fleet_version == "v1"
    workers = await listing(client)
    for fake in d_new:
        entry = shown(workers, fake.url)
        assert (entry["routable"], entry["hold"]["kind"]) == (False, "weights")
        assert "serves weight_version 'v2', the fleet serves 'v1'" in entry["state_reason"]
    assert [w.url for w in client.registry.routable(Role.DECODE)] == [d_old.url]


async def test_a_worker_back_from_being_unhealthy_is_read_again(fake_fleet, make_router):
    p, d1, d2 = await fake_fleet(1, 2)
    client = await make_router([p], [d1, d2], health=FAST)
    worker = client.registry.get(d2.url)
    await wait_for(lambda: d2.health_calls >= 1)
    d2.behaviour.health_status = 503
    await wait_for(lambda: not worker.healthy, message="down")
    d2.role = "prefill"  # converted behind the router's back while it was away
    d2.bootstrap_port = 9555
    d2.behaviour.health_status = 200
    await wait_for(lambda: worker.role is Role.PREFILL and worker.routable, timeout=10, message="read again")
    assert worker.bootstrap_port == 9555 and worker in client.registry.routable(Role.PREFILL)


# ---- registration --------------------------------------------------------------------------------------------
async def test_an_api_registration_is_routed_in_the_live_role(fake_fleet, make_router):
    p, d = await fake_fleet(1, 1)
    (other,) = await fake_fleet(1, 0)
    client = await make_router([p], [d])
    resp = await client.post("/workers", json={"url": other.url, "worker_type": "decode"})
    assert resp.status == 200
    entry = (await resp.json())["worker"]
    assert (entry["worker_type"], entry["bootstrap_port"], entry["routable"]) == ("prefill", 9000, True)
    assert entry["source"] == "POST /workers"


@pytest.fixture
async def three(sim_workers, make_router):
    p, d1, d2 = await sim_workers(1, 2)
    client = await make_router([p], [d1, d2])
    return client, p, d1, d2


async def register(client, mode: str, url: str, port: int | None = None):
    resp = await client.post("/register", json={"mode": mode, "registry_url": url, "bootstrap_port": port})
    return resp.status, await resp.json()


async def test_register_of_a_known_server_in_another_role_than_it_has_is_409(three):
    client, p, d1, d2 = three
    status, body = await register(client, "prefill", d2.url, 8100)
    assert status == 409, body
    assert body["error"]["message"] == f"cannot re-register {d2.url} as prefill: the server's live role is decode"
    assert body["error"]["live_role"] == "decode" and client.registry.get(d2.url).role is Role.DECODE


async def test_register_of_a_known_server_on_other_weights_is_409(three):
    client, p, d1, d2 = three
    d2.weight_version = "v9"
    status, body = await register(client, "decode", d2.url)
    assert status == 409
    assert "weight version 'v9' differs from the fleet's 'default'" in body["error"]["message"]
    assert body["error"]["fleet_weight_version"] == "default"


async def test_register_of_a_known_paused_server_is_409_at_once(three):
    """A paused server answers /ready 503: the router says it is paused without waiting for /health. Real 0.5.23
    holds a paused server's /health until the scheduler answers anything (the router's own /server_info read
    does, in about a second); a server whose /health holds on (here the health_hang fault) made the router wait
    out its probe (25 s) and answer 502."""
    client, p, d1, d2 = three
    await d2.worker.engine.pause("in_place")
    d2.set_faults(health_hang=True)
    try:
        async with asyncio.timeout(10):  # a deadline well under the router's /health probe (25 s)
            status, body = await register(client, "decode", d2.url)
    finally:
        d2.set_faults(health_hang=False)  # the probes it holds are answered
        d2.worker.engine.resume()
    assert status == 409 and "/ready answers 503" in body["error"]["message"], body


async def test_register_of_a_known_server_that_is_down_is_502(three):
    client, p, d1, d2 = three
    d2.set_faults(unhealthy=True)
    status, body = await register(client, "decode", d2.url)
    assert status == 502 and "/health answered 503" in body["error"]["message"]


async def test_register_of_a_busy_server_is_409(three):
    client, p, d1, d2 = three
    d2.set_faults(hang_after_tokens=1)  # the decode stalls after the prefill's token
    requests = []
    while not d2.in_handler:  # a request held on d2, so that its conversion drains
        requests.append(asyncio.ensure_future(client.post("/generate", json={"text": "x"})))
        await wait_for(lambda: d1.in_handler + d2.in_handler + len(d1.requests) >= len(requests))
    worker = client.registry.get(d2.url)
    resp = await client.post(f"/admin/workers/{worker.id}/convert", json={"wait": False, "new_role": "prefill"})
    assert resp.status == 202
    status, body = await register(client, "decode", d2.url)
    assert status == 409 and body["error"]["message"] == f"worker {d2.url} is draining: wait for that operation " \
                                                         f"to end"
    assert body["error"]["state"] == "draining"
    d2.set_faults(hang_after_tokens=None)
    await asyncio.gather(*requests)
    await wait_for(lambda: worker.state is WorkerState.ACTIVE and worker.role is Role.PREFILL, timeout=10)


async def test_register_brings_back_a_held_server_that_passes_the_checks(three):
    client, p, d1, d2 = three
    worker = client.registry.get(d2.url)
    client.registry.hold_out(worker, HoldKind.WEIGHTS, "update failed")
    status, body = await register(client, "decode", d2.url)
    assert status == 200, body
    assert (worker.state, worker.hold, worker.routable) == (WorkerState.ACTIVE, None, True)
