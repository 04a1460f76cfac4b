"""The peers' worker-body fields pd-router keeps (POST /workers, PATCH /workers/{id}): a per-worker `api_key` is
what that worker alone is sent (its legs and its control-plane calls), `labels`, `priority` and `cost` are stored
and shown in GET /workers. A simulated 1P+1D fleet whose servers each require their own key (SGLang's --api-key);
and /readiness while the router drains."""

from __future__ import annotations

import json

from router.core.keys import LIFECYCLE, REGISTRY

from .helpers import wait_for
from simulator.fleet import Fleet
from .sim_support import FAST

import pytest

KEYS = {"prefill": "prefill-secret", "decode": "decode-secret"}


@pytest.fixture
async def keyed_fleet():
    async with Fleet(1, 1, prefill_overrides={"api_key": KEYS["prefill"]},
                     decode_overrides={"api_key": KEYS["decode"]}, **FAST) as fleet:
        yield fleet


async def _add(router, handle, role: str, **fields) -> dict:
    resp = await router.post("/workers", json={"url": handle.url, **fields})
    body = await resp.json()
    assert resp.status == 200, body
    return body


async def test_each_worker_is_sent_its_own_key_and_keeps_its_labels(keyed_fleet, make_router):
    from router.core.config import HealthConfig

    router = await make_router(health=HealthConfig(interval_secs=0.05, timeout_secs=1, failure_threshold=1,
                                                   success_threshold=1))
    prefill, decode = keyed_fleet.prefill[0], keyed_fleet.decode[0]
    # no worker_type: the role is read from each server, with its key
    added = await _add(router, prefill, "prefill", api_key=KEYS["prefill"], bootstrap_port=prefill.bootstrap_port,
                       labels={"zone": "a"}, priority=80, cost=2)
    await _add(router, decode, "decode", api_key=KEYS["decode"], model_id="m")
    assert added["worker"]["role"] == "prefill" and "ignored_fields" not in added
    registry = router.app[REGISTRY]
    await wait_for(lambda: all(w.routable for w in registry.workers()) and len(registry.workers()) == 2,
                   timeout=10, message="both keyed workers routable")
    for stream in (False, True):  # the client's own Authorization is replaced on each leg by its worker's key
        resp = await router.post("/generate", json={"text": "hi", "stream": stream,
                                                    "sampling_params": {"max_new_tokens": 2}},
                                 headers={"Authorization": "Bearer the-clients"})
        assert resp.status == 200, await resp.text()
        await resp.read()
    listing = await (await router.get("/workers")).json()
    shown = {w["role"]: w for w in listing["workers"]}
    assert shown["prefill"]["labels"] == {"zone": "a"} and shown["prefill"]["priority"] == 80
    assert shown["prefill"]["cost"] == 2.0 and shown["prefill"]["api_key_set"] is True
    assert shown["decode"]["labels"] == {} and shown["decode"]["priority"] is None
    assert KEYS["prefill"] not in json.dumps(listing) and KEYS["decode"] not in json.dumps(listing)

    # SMG's PATCH: the key sent from then on (a wrong one: the decode refuses the leg, 401 as SGLang answers it)
    worker = registry.find(decode.url)
    resp = await router.patch(f"/workers/{worker.id}", json={"api_key": "wrong", "labels": {"tier": "b"}})
    assert resp.status == 200 and (await resp.json())["worker"]["labels"] == {"tier": "b"}
    resp = await router.post("/generate", json={"text": "hi"})
    assert resp.status == 401
    resp = await router.patch(f"/workers/{worker.id}", json={"api_key": KEYS["decode"]})
    assert resp.status == 200
    assert (await router.post("/generate", json={"text": "hi"})).status == 200


async def test_a_worker_added_without_its_key_is_not_read(keyed_fleet, make_router):
    router = await make_router()
    resp = await router.post("/workers", json={"url": keyed_fleet.decode[0].url, "api_key": "not-its-key"})
    assert resp.status >= 400 and "error" in await resp.json()
    assert router.app[REGISTRY].workers() == []


async def test_readiness_while_draining(fleet, make_router):
    router = await make_router(fleet.prefill, fleet.decode)
    await wait_for(lambda: all(w.routable for w in router.app[REGISTRY].workers()), message="routable")
    resp = await router.get("/readiness")
    assert resp.status == 200 and (await resp.json())["status"] == "ready"
    router.app[LIFECYCLE].begin_shutdown("SIGTERM", 30.0)  # what the SIGTERM handler does first
    resp = await router.get("/readiness")
    body = await resp.json()
    assert resp.status == 503 and body["status"] == "not ready" and body["reason"] == "draining"
    assert body["error"]["code"] == 503 and body["healthy_workers"] == 2  # the workers are fine: the router goes
    resp = await router.get("/liveness")
    assert resp.status == 200 and await resp.text() == "OK"  # the process still runs


async def test_a_discovery_file_entry_carries_its_workers_key_and_labels(keyed_fleet, make_router, tmp_path):
    from router.core.config import WorkerSourcesConfig

    prefill, decode = keyed_fleet.prefill[0], keyed_fleet.decode[0]
    listing = tmp_path / "workers.json"
    listing.write_text(json.dumps({"workers": [
        {"url": prefill.url, "worker_type": "prefill", "bootstrap_port": prefill.bootstrap_port,
         "api_key": KEYS["prefill"]},
        {"url": decode.url, "api_key": KEYS["decode"], "labels": {"zone": "b"}}]}))  # its role read with its key
    router = await make_router(worker_sources=WorkerSourcesConfig(file=str(listing), file_interval_secs=0.05))
    registry = router.app[REGISTRY]
    await wait_for(lambda: len(registry.workers()) == 2 and all(w.routable for w in registry.workers()),
                   timeout=10, message="both listed keyed workers routable")
    assert registry.find(decode.url).labels == {"zone": "b"}
    assert (await router.post("/generate", json={"text": "hi"})).status == 200
    shown = await (await router.get("/admin/discovery")).json()
    assert KEYS["decode"] not in json.dumps(shown) and KEYS["prefill"] not in json.dumps(shown)
