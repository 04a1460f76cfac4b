"""etcd discovery is one more way in for a worker, so a pd-router announced there is never one: a key naming
the router itself, or another router, leaves that worker failed (never routed), and the fleet serves on."""

from __future__ import annotations

import orjson

from router.cluster.discovery_watch import discovery_key
from router.core.config import HealthConfig, RouterConfig, WorkerSourcesConfig
from router.core.keys import REGISTRY
from router.core.registry import WorkerState
from router.server.app import create_app

from ..helpers import wait_for

CLUSTER = "test"


async def test_a_router_announced_in_etcd_is_never_a_worker(aiohttp_client, sim_workers, etcd, etcd_client):
    p, d = await sim_workers(1, 1)
    for worker, role in ((p, "prefill"), (d, "decode")):
        await etcd_client.put(discovery_key(CLUSTER, worker.url),
                              orjson.dumps({"url": worker.url, "worker_type": role, "bootstrap_port": p.bootstrap_port}))
    config = RouterConfig(worker_sources=WorkerSourcesConfig(etcd_endpoints=tuple(etcd.endpoints),
                                                             etcd_cluster_name=CLUSTER),
                          health=HealthConfig(interval_secs=0.2)).validated()
    client = await aiohttp_client(create_app(config))
    registry = client.app[REGISTRY]
    itself = f"http://127.0.0.1:{client.port}"
    await etcd_client.put(discovery_key(CLUSTER, itself), orjson.dumps({"url": itself, "worker_type": "decode"}))

    def failed():
        worker = registry.find(itself)
        return worker is not None and worker.state is WorkerState.FAILED

    await wait_for(failed, timeout=10, message="the router's own URL read and left failed")
    assert "this router itself" in registry.find(itself).state_reason and not registry.find(itself).routable
    resp = await client.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}})
    assert resp.status == 200, await resp.text()
