"""Workers started with SGLang's --api-key: the router's --worker-api-key reaches every call to them."""

from __future__ import annotations

import pytest

from router.server.app import create_app
from router.server.cli import config_from_args
from router.core.config import HealthConfig, RouterConfig, WorkerSpec
from router.core.keys import REGISTRY
from simulator.fleet import Fleet

from .helpers import wait_for
from .sim_support import FAST

KEY = "worker-secret"


@pytest.fixture
async def keyed_fleet():
    async with Fleet(prefill=1, decode=2, api_key=KEY, **FAST) as fleet:
        yield fleet


async def build(aiohttp_client, fleet, **overrides):
    config = RouterConfig(prefill=tuple(WorkerSpec(h.url, h.bootstrap_port) for h in fleet.prefill),
                          decode=tuple(WorkerSpec(h.url) for h in fleet.decode),
                          health=HealthConfig(interval_secs=0.05, timeout_secs=1), **overrides).validated()
    client = await aiohttp_client(create_app(config), server_kwargs={"handler_cancellation": True})
    client.registry = client.app[REGISTRY]
    return client


async def test_simulator_enforces_its_key(keyed_fleet, aiohttp_client):
    import aiohttp
    async with aiohttp.ClientSession() as session:
        url = keyed_fleet.decode[0].url
        async with session.get(url + "/server_info") as resp:
            assert resp.status == 401 and await resp.json() == {"error": "Unauthorized"}
        async with session.get(url + "/server_info", headers={"Authorization": f"Bearer {KEY}"}) as resp:
            assert resp.status == 200
        async with session.get(url + "/health") as resp:
            assert resp.status == 200  # probes stay open, as in SGLang


async def test_with_worker_key_generation_and_control_work(keyed_fleet, aiohttp_client):
    client = await build(aiohttp_client, keyed_fleet, worker_api_key=KEY)
    # control plane: facts learnt from /server_info (needs the key)
    await wait_for(lambda: all(w.weight_version for w in client.registry.workers()), message="facts learnt")
    for stream in (False, True):
        resp = await client.post("/generate", json={"text": "hi", "stream": stream,
                                                    "sampling_params": {"max_new_tokens": 3}})
        assert resp.status == 200, await resp.text()
        await resp.read()
    resp = await client.post("/update_weight_version", json={"new_version": "v9"})
    assert resp.status == 200, await resp.text()
    assert (await (await client.get("/get_server_info")).json())["decode"][0]["internal_states"]
    decode = client.registry.workers()[1]
    resp = await client.post(f"/admin/workers/{decode.id}/convert", json={"new_role": "prefill"})
    assert resp.status == 200, await resp.text()
    await wait_for(lambda: all(w.inflight == 0 for w in client.registry.workers()))


async def test_client_key_not_replaced_without_worker_key(keyed_fleet, aiohttp_client):
    """Without --worker-api-key the client's Authorization is passed through: right key works, none fails."""
    client = await build(aiohttp_client, keyed_fleet)
    resp = await client.post("/generate", json={"text": "hi"}, headers={"Authorization": f"Bearer {KEY}"})
    assert resp.status == 200
    resp = await client.post("/generate", json={"text": "hi"})
    assert resp.status == 401


def test_flag_and_env():
    base = "--prefill http://a:1 9 --decode http://b:2".split()
    assert config_from_args(base + ["--worker-api-key", "k"], env={}).worker_api_key == "k"
    assert config_from_args(base, env={"PD_ROUTER_WORKER_API_KEY": "e"}).worker_api_key == "e"
    assert config_from_args(base, env={}).worker_api_key is None
