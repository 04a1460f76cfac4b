"""mini_lb's info endpoints, fixed: concurrent, statuses honoured."""

from __future__ import annotations

import asyncio

from router.core.registry import Role, WorkerState

from .helpers import wait_for


async def test_health_reports_pools_and_503_when_one_is_empty(sim_workers, make_router):
    p, d = await sim_workers(1, 1)
    client = await make_router([p], [d])
    resp = await client.get("/health")
    assert resp.status == 200
    assert (await resp.json())["pools"]["decode"]["routable"] == 1
    (dw,) = client.registry.workers(Role.DECODE)
    client.registry.set_health(dw, False, "test")
    resp = await client.get("/health")
    assert resp.status == 503 and "decode" in (await resp.json())["message"]


async def test_health_generate_checks_statuses(sim_workers, make_router):
    p, d = await sim_workers(1, 1)
    client = await make_router([p], [d])
    assert (await client.get("/health_generate")).status == 200
    await d.stop()
    resp = await client.get("/health_generate")
    assert resp.status == 503
    failed = [w for w in (await resp.json())["workers"] if not w["success"]]
    assert [w["url"] for w in failed] == [d.url]


async def test_flush_cache_fans_out_and_reports_failure(sim_workers, make_router):
    p, d = await sim_workers(1, 1)
    client = await make_router([p], [d])
    resp = await client.post("/flush_cache")
    assert resp.status == 200 and (await resp.json())["success"] is True
    d.set_faults(hang_after_tokens=1)  # busy with a request after its prefill's token: SGLang answers 400
    pending = asyncio.ensure_future(client.post("/generate", json={"text": "x"}))
    await wait_for(lambda: d.worker.engine.requests and not p.worker.engine.requests, message="only d busy")
    resp = await client.post("/flush_cache")
    body = await resp.json()
    assert resp.status == 400 and body["success"] is False
    assert [w["url"] for w in body["workers"] if not w["success"]] == [d.url]
    d.set_faults(hang_after_tokens=None)
    assert (await pending).status == 200


async def test_server_info_aggregates_both_pools(sim_workers, make_router):
    p1, p2, d = await sim_workers(2, 1)
    client = await make_router([p1, p2], [d])
    body = await (await client.get("/get_server_info")).json()
    assert len(body["prefill"]) == 2 and len(body["decode"]) == 1
    assert body["internal_states"][0]["disaggregation_mode"] == "decode"


async def test_model_info_and_models_from_a_worker(sim_workers, make_router):
    p, d = await sim_workers(1, 1, model_path="fake-model")
    client = await make_router([p], [d])
    for path in ("/get_model_info", "/model_info"):
        assert (await (await client.get(path)).json())["model_path"] == "fake-model"
    assert (await (await client.get("/v1/models")).json())["data"][0]["id"] == "fake-model"


async def test_model_info_503_without_workers(make_router):
    client = await make_router([], [])
    resp = await client.get("/get_model_info")
    assert resp.status == 503 and "no server" in (await resp.json())["error"]["message"].lower()
