"""--routing-key-override / --sticky-sessions (SMG's): on any policy (round_robin here, which alternates), a request
naming a routing key goes where its key went, while that worker is routable; requests without a key follow the
policy. A simulated 1P+2D fleet (two decodes, so that stickiness shows)."""

from __future__ import annotations

import pytest
from aiohttp.test_utils import TestClient, TestServer

from router.core.keys import REGISTRY
from router.server.app import create_app
from router.server.cli import config_from_args
from simulator.fleet import Fleet

from .conftest import RUNNER_KWARGS
from .helpers import wait_for
from .sim_support import FAST


@pytest.fixture
async def fleet():
    async with Fleet(1, 2, **FAST) as f:
        yield f


async def _router(fleet: Fleet, *flags: str) -> TestClient:
    argv = ["--prefill", fleet.prefill[0].url, str(fleet.prefill[0].bootstrap_port),
            "--health-check-interval-secs", "0.05", "--health-failure-threshold", "1", "--policy", "round_robin"]
    for handle in fleet.decode:
        argv += ["--decode", handle.url]
    server = TestServer(create_app(config_from_args([*argv, *flags], env={})))
    await server.start_server(**RUNNER_KWARGS)
    client = TestClient(server)
    await client.start_server()
    return client


async def _decode_of(router, key: str | None) -> str:
    """The decode that served one request (the one whose count went up)."""
    decodes = [w for w in router.app[REGISTRY].workers() if w.role.value == "decode"]
    before = {w.url: w.requests_total for w in decodes}
    resp = await router.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 1}},
                             headers={"X-SMG-Routing-Key": key} if key else {})
    assert resp.status == 200, await resp.text()
    (served,) = [w.url for w in decodes if w.requests_total > before[w.url]]
    return served


async def test_a_routing_key_sticks_to_its_decode_on_round_robin(fleet):
    router = await _router(fleet, "--sticky-sessions")
    try:
        first = await _decode_of(router, "conversation-a")
        assert [await _decode_of(router, "conversation-a") for _ in range(4)] == [first] * 4
        keyless = [await _decode_of(router, None) for _ in range(4)]
        assert len(set(keyless)) == 2  # the policy's own choice: round robin over both
        other = next(h for h in fleet.decode if h.url != first)
        # its decode goes out of routing: the key moves to the other, and stays there
        pinned = next(h for h in fleet.decode if h.url == first)
        await fleet.set_faults(pinned, unhealthy=True)
        worker = router.app[REGISTRY].find(first)
        await wait_for(lambda: not worker.routable, timeout=10, message="the pinned decode out of routing")
        assert [await _decode_of(router, "conversation-a") for _ in range(3)] == [other.url] * 3
        shown = await (await router.get("/admin/policies")).json()
        assert '"keys": 1' in str(shown).replace("'", '"')  # the decode pool's override holds the one key
    finally:
        await router.close()


async def test_without_the_flag_round_robin_ignores_the_key(fleet):
    router = await _router(fleet)
    try:
        served = [await _decode_of(router, "conversation-a") for _ in range(4)]
        assert len(set(served)) == 2
    finally:
        await router.close()
