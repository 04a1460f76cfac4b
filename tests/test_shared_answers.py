"""Public fan-out routes are bounded: concurrent anonymous calls share one fan-out, info answers are reused
briefly, and a registry change drops what was kept."""

from __future__ import annotations

import asyncio
import collections

import pytest

from router.api.shared_answers import SHARED_ANSWERS, SharedAnswer
from router.core.errors import ServiceUnavailable
from router.flows.fleet_control import FLEET_CONTROL

from .fakes import INFO_PATHS
from .helpers import wait_for

CALLERS = 20
FAN_OUT_ROUTES = ("/health_generate", "/server_info", "/get_server_info", "/model_info", "/get_model_info",
                  "/v1/models")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Computation:
    """A produce function that counts its runs and finishes when told."""

    def __init__(self) -> None:
        self.runs = 0
        self.gate = asyncio.Event()
        self.error: Exception | None = None

    async def __call__(self) -> str:
        self.runs += 1
        run = self.runs
        await self.gate.wait()
        if self.error is not None:
            raise self.error
        return f"answer {run}"


# ---- SharedAnswer ------------------------------------------------------------------------------------------
async def test_concurrent_callers_share_one_computation():
    shared, produce = SharedAnswer(), Computation()
    callers = [asyncio.ensure_future(shared.get(produce)) for _ in range(CALLERS)]
    await wait_for(lambda: shared.waiting == CALLERS)
    produce.gate.set()
    assert await asyncio.gather(*callers) == ["answer 1"] * CALLERS
    assert produce.runs == 1 and shared.waiting == 0
    assert await shared.get(produce) == "answer 2"  # ttl 0: the next caller gets a fresh computation


async def test_an_error_is_shared_too_and_not_kept_past_its_ttl():
    clock = Clock()
    shared, produce = SharedAnswer(ttl=1.0, clock=clock), Computation()
    produce.error = ServiceUnavailable("no worker")
    callers = [asyncio.ensure_future(shared.get(produce)) for _ in range(3)]
    await wait_for(lambda: shared.waiting == 3)
    produce.gate.set()
    results = await asyncio.gather(*callers, return_exceptions=True)
    assert all(isinstance(r, ServiceUnavailable) for r in results) and produce.runs == 1
    with pytest.raises(ServiceUnavailable):
        await shared.get(produce)
    assert produce.runs == 1
    clock.now += 1.0
    produce.error = None
    assert await shared.get(produce) == "answer 2"


async def test_a_kept_answer_is_reused_until_its_ttl_or_an_invalidation():
    clock = Clock()
    shared, produce = SharedAnswer(ttl=1.0, clock=clock), Computation()
    produce.gate.set()
    assert await shared.get(produce) == "answer 1"
    clock.now += 0.9
    assert await shared.get(produce) == "answer 1"
    clock.now += 0.1
    assert await shared.get(produce) == "answer 2"
    shared.invalidate()
    assert await shared.get(produce) == "answer 3"


async def test_an_answer_computed_across_an_invalidation_is_not_kept():
    shared, produce = SharedAnswer(ttl=60.0), Computation()
    first = asyncio.ensure_future(shared.get(produce))
    await wait_for(lambda: shared.waiting == 1)
    shared.invalidate()  # e.g. a worker was removed while the fan-out ran
    produce.gate.set()
    assert await first == "answer 1"
    assert await shared.get(produce) == "answer 2"


async def test_a_caller_that_leaves_does_not_cancel_the_others():
    shared, produce = SharedAnswer(), Computation()
    leaving = asyncio.ensure_future(shared.get(produce))
    staying = asyncio.ensure_future(shared.get(produce))
    await wait_for(lambda: shared.waiting == 2)
    leaving.cancel()
    await asyncio.gather(leaving, return_exceptions=True)
    produce.gate.set()
    assert await staying == "answer 1" and produce.runs == 1


# ---- through the router ------------------------------------------------------------------------------------
def shared_for(client, path: str) -> SharedAnswer:
    name = {"/health_generate": "health_generate", "/server_info": "server_info", "/get_server_info": "server_info",
            "/model_info": "model_info", "/get_model_info": "model_info", "/v1/models": "models"}[path]
    return client.app[SHARED_ANSWERS][name]


def info_calls(fakes) -> dict[str, collections.Counter]:
    return {f.url: collections.Counter({p: n for p, n in f.calls.items() if p in INFO_PATHS}) for f in fakes}


async def router_in_front_of(start_workers, make_router):
    fakes = await start_workers(2, 2)
    client = await make_router(fakes[:2], fakes[2:])
    await wait_for(lambda: all(w.weight_version for w in client.registry.workers()), message="facts learnt")
    await client.app[FLEET_CONTROL].reconcile()  # the fleet's version adopted: no background reads from here on
    client.fakes = fakes
    return client


@pytest.fixture
async def fleet_router(sim_workers, make_router):
    return await router_in_front_of(sim_workers, make_router)


@pytest.fixture
async def gated_fleet_router(fake_fleet, make_router):
    """The same in front of fakes, whose info routes a test can hold behind a gate (`info_gate`)."""
    return await router_in_front_of(fake_fleet, make_router)


@pytest.mark.parametrize("path", FAN_OUT_ROUTES)
async def test_concurrent_anonymous_calls_cause_one_fan_out(gated_fleet_router, path):
    client, fakes = gated_fleet_router, gated_fleet_router.fakes
    shared = shared_for(client, path)
    # What one call costs the fleet.
    for fake in fakes:
        fake.calls.clear()
    shared.invalidate()
    resp = await client.get(path)
    assert resp.status == 200, await resp.text()
    one_call = info_calls(fakes)
    assert sum(sum(c.values()) for c in one_call.values()) >= 1

    for fake in fakes:
        fake.calls.clear()
        fake.info_gate = asyncio.Event()
    shared.invalidate()
    calls = [asyncio.ensure_future(client.get(path)) for _ in range(CALLERS)]
    await wait_for(lambda: shared.waiting == CALLERS, message="every caller waits on the shared fan-out")
    for fake in fakes:
        fake.info_gate.set()
    answers = await asyncio.gather(*calls)
    bodies = [await r.json() for r in answers]
    assert all(r.status == 200 for r in answers) and all(b == bodies[0] for b in bodies)
    assert info_calls(fakes) == one_call  # not CALLERS times as many
    if path == "/health_generate":
        assert all(c["/health_generate"] == 1 for c in one_call.values())  # one generation per worker


async def test_info_answers_are_reused_briefly_and_dropped_on_a_registry_change(fleet_router):
    client, fakes = fleet_router, fleet_router.fakes
    shared = shared_for(client, "/server_info")
    shared.invalidate()
    first = await (await client.get("/server_info")).json()
    for fake in fakes:
        fake.calls.clear()
    for _ in range(5):  # a loop of anonymous calls: answered from the kept answer
        assert await (await client.get("/get_server_info")).json() == first
    assert sum(sum(c.values()) for c in info_calls(fakes).values()) == 0
    client.registry.remove(client.registry.find(fakes[3].url))
    after = await (await client.get("/server_info")).json()
    assert len(after["decode"]) == 1 and len(first["decode"]) == 2


async def test_health_generate_is_never_reused_after_its_fan_out(fleet_router):
    """Its job is a fresh check: a server that stopped answers 503 at the next call."""
    client, fakes = fleet_router, fleet_router.fakes
    assert (await client.get("/health_generate")).status == 200
    await fakes[3].stop()
    assert (await client.get("/health_generate")).status == 503
