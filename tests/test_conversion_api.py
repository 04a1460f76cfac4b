"""Role conversion against fake workers: the flow's decisions, its refusals, its API and validation.

The end-to-end behaviour (PD transfers, aborts, load) is tested on the simulator in test_conversion_e2e.py.
"""

from __future__ import annotations

import asyncio

import pytest

from router.dataplane.admission import ADMISSION
from router.core.registry import Role, WorkerState

from .helpers import wait_for


def inflight(client) -> list[int]:
    return [w.inflight for w in client.registry.workers()]


def worker_of(client, fake):
    return client.registry.get(fake.url)


async def conversion_done(client, conversion_id: str) -> dict:
    async def done():
        resp = await client.get(f"/admin/conversions/{conversion_id}")
        body = await resp.json()
        return body if body["state"] == "done" else None

    await wait_for(done, timeout=10, message=f"conversion {conversion_id} to end")
    return await (await client.get(f"/admin/conversions/{conversion_id}")).json()


async def test_prefill_to_decode_with_pd_role_switch(sim_workers, make_router):
    p1, p2, d1 = await sim_workers(2, 1)
    client = await make_router([p1, p2], [d1])
    resp = await client.post("/pd_role_switch", json={"worker_url": p2.url, "new_role": "decode"})
    body = await resp.json()
    assert resp.status == 200, body
    assert body["success"] is True and body["outcome"] == "converted"
    assert (body["old_role"], body["new_role"], body["bootstrap_port"]) == ("prefill", "decode", None)
    # 0.5.23 refuses a switch to decode without decode_cuda_graph_memory_gb: the router sends a default
    assert p2.switch_calls == [{"new_role": "decode", "decode_cuda_graph_memory_gb": 0.0}]
    worker = worker_of(client, p2)
    assert (worker.role, worker.state, worker.routable) == (Role.DECODE, WorkerState.ACTIVE, True)
    assert worker.switch_api == "pd_role_switch"  # learnt by probing
    assert {w.url for w in client.registry.routable(Role.DECODE)} == {d1.url, p2.url}


async def test_decode_to_prefill_with_convert_api_routes_with_the_new_bootstrap_port(fake_fleet, make_router):
    p1, d1, d2 = await fake_fleet(1, 2, api="convert")
    client = await make_router([p1], [d1, d2])
    resp = await client.post("/convert_pd_role", json={"server_url": d2.url, "disable_cuda_graph": True})
    body = await resp.json()
    assert resp.status == 200, body
    assert (body["success"], body["old_role"], body["new_role"]) == (True, "decode", "prefill")
    assert body["bootstrap_port"] == d2.convert_bootstrap_port != d2.bootstrap_port
    assert d2.switch_calls == [{"server_url": d2.url, "disable_cuda_graph": True}]
    # Route through the converted prefill only: the old one leaves the fleet.
    resp = await client.delete(f"/workers/{worker_of(client, p1).id}")
    assert resp.status == 200
    resp = await client.post("/generate", json={"text": "hi"})
    assert resp.status == 200
    (sent,) = d2.bodies()
    assert sent["bootstrap_port"] == d2.convert_bootstrap_port
    assert d1.bodies()[0]["bootstrap_room"] == sent["bootstrap_room"]
    await wait_for(lambda: inflight(client) == [0, 0])


async def test_convert_pd_role_uses_the_servers_own_convert_api_where_it_has_one(fake_fleet, make_router):
    """A 0.5.23 server with server_patches serves both APIs and /server_info names only /pd_role_switch: the
    router's /convert_pd_role must still reach the server's /convert_pd_role (the design's options go with
    it); the router's /pd_role_switch keeps the learnt API; a plain 0.5.23 server falls back after a 404."""
    p1, p2, d1 = await fake_fleet(2, 1, api="patched")
    (plain,) = await fake_fleet(0, 1)
    client = await make_router([p1, p2], [d1, plain])
    await wait_for(lambda: worker_of(client, p2).switch_api == worker_of(client, plain).switch_api == "pd_role_switch")
    resp = await client.post("/convert_pd_role", json={"server_url": p2.url, "disable_cuda_graph": True})
    body = await resp.json()
    assert resp.status == 200 and body["new_role"] == "decode", body
    assert p2.switch_paths == ["/convert_pd_role"]
    assert p2.switch_calls == [{"server_url": p2.url, "disable_cuda_graph": True,
                                "decode_cuda_graph_memory_gb": 0.0}]
    assert worker_of(client, p2).switch_api == "pd_role_switch"  # what the server said it has stays learnt
    resp = await client.post("/pd_role_switch", json={"worker_url": p2.url, "new_role": "prefill"})
    body = await resp.json()
    assert resp.status == 200 and body["bootstrap_port"] == p2.bootstrap_port, body
    assert p2.switch_paths == ["/convert_pd_role", "/pd_role_switch"]
    resp = await client.post("/convert_pd_role", json={"server_url": plain.url})
    body = await resp.json()
    assert resp.status == 200 and body["new_role"] == "prefill", body
    assert plain.switch_paths == ["/pd_role_switch"]  # after a 404 on /convert_pd_role
    assert worker_of(client, plain).switch_api == "pd_role_switch"


async def test_same_role_is_a_no_op(sim_workers, make_router):
    p1, p2, d1 = await sim_workers(2, 1)
    client = await make_router([p1, p2], [d1])
    resp = await client.post("/pd_role_switch", json={"worker_url": p1.url, "new_role": "prefill"})
    body = await resp.json()
    assert resp.status == 200 and body["success"] is True and body["outcome"] == "unchanged"
    assert p1.switch_calls == []


async def test_last_routable_worker_of_its_pool_is_refused(sim_workers, make_router):
    p1, d1 = await sim_workers(1, 1)
    client = await make_router([p1], [d1])
    resp = await client.post("/convert_pd_role", json={"server_url": d1.url})
    body = await resp.json()
    assert resp.status == 409
    assert body["success"] is False and "last routable decode worker" in body["message"]
    assert body["error"]["message"] == body["message"]
    assert d1.switch_calls == [] and worker_of(client, d1).state is WorkerState.ACTIVE
    history = await (await client.get("/admin/conversions")).json()
    assert [c["outcome"] for c in history["conversions"]] == ["refused"]


async def hold_a_request_on(client, hung, *, other) -> list:
    """Send requests until one hangs on `hung` (the others go to `other`); the caller releases it."""
    hung.behaviour.hang = True
    requests = []
    while not hung.in_handler:
        requests.append(asyncio.ensure_future(client.post("/generate", json={"text": "x"})))
        await wait_for(lambda: other.in_handler + hung.in_handler + len(other.requests) >= len(requests))
    return requests


async def test_drain_waits_for_in_flight_requests_and_shows_its_state(fake_fleet, make_router):
    p1, p2, d1 = await fake_fleet(2, 1)
    client = await make_router([p1, p2], [d1])
    requests = await hold_a_request_on(client, p2, other=p1)
    resp = await client.post(f"/admin/workers/{worker_of(client, p2).id}/convert", json={"wait": False})
    record = await resp.json()
    assert resp.status == 202 and record["state"] == "drain"
    listing = await (await client.get("/workers")).json()
    (shown,) = [w for w in listing["workers"] if w["url"] == p2.url]
    assert shown["state"] == "draining" and shown["routable"] is False and record["id"] in shown["state_reason"]
    # A second conversion of the same worker is refused while the first runs.
    resp = await client.post("/pd_role_switch", json={"worker_url": p2.url, "new_role": "decode"})
    assert resp.status == 409 and "already being converted" in (await resp.json())["message"]
    assert p2.switch_calls == []  # not switched while a request runs on it
    p2.release.set()
    for resp in await asyncio.gather(*requests):
        assert resp.status == 200
    record = await conversion_done(client, record["id"])
    assert record["outcome"] == "converted" and record["status"] == 200
    assert [s["step"] for s in record["steps"]] == ["drain", "switch", "verify"]
    assert all(s["outcome"] == "ok" and s["duration_s"] >= 0 for s in record["steps"])
    assert worker_of(client, p2).role is Role.DECODE
    await wait_for(lambda: inflight(client) == [0, 0, 0])


async def test_drain_deadline_exceeded_puts_the_worker_back(fake_fleet, make_router):
    p1, p2, d1 = await fake_fleet(2, 1)
    client = await make_router([p1, p2], [d1])
    requests = await hold_a_request_on(client, p2, other=p1)
    resp = await client.post(f"/admin/workers/{worker_of(client, p2).id}/convert", json={"timeout_s": 0.2})
    record = await resp.json()
    assert resp.status == 504, record
    assert record["outcome"] == "restored" and "drain deadline" in record["message"]
    assert "1 requests still in flight" in record["steps"][0]["message"]
    assert record["steps"][0]["outcome"] == "timeout" and record["error"]["code"] == 504
    worker = worker_of(client, p2)
    assert (worker.role, worker.state, worker.routable) == (Role.PREFILL, WorkerState.ACTIVE, True)
    assert p2.switch_calls == []
    p2.release.set()
    assert all(r.status == 200 for r in await asyncio.gather(*requests))
    await wait_for(lambda: inflight(client) == [0, 0, 0])


async def test_not_idle_refusals_are_retried_within_the_switch_deadline(fake_fleet, make_router):
    p1, p2, d1 = await fake_fleet(2, 1)
    client = await make_router([p1, p2], [d1])
    p2.not_idle_refusals = 2
    resp = await client.post(f"/admin/workers/{worker_of(client, p2).id}/convert", json={})
    record = await resp.json()
    assert resp.status == 200 and record["outcome"] == "converted"
    (switch,) = [s for s in record["steps"] if s["step"] == "switch"]
    assert switch["attempts"] == 3 and len(p2.switch_calls) == 3


async def test_not_idle_until_the_switch_deadline_restores(fake_fleet, make_router):
    p1, p2, d1 = await fake_fleet(2, 1)
    client = await make_router([p1, p2], [d1])
    p2.not_idle_refusals = 10**6
    resp = await client.post(f"/admin/workers/{worker_of(client, p2).id}/convert", json={"switch_timeout_s": 0.5})
    record = await resp.json()
    assert resp.status == 504 and record["outcome"] == "restored"
    assert "not idle" in record["message"]
    assert worker_of(client, p2).routable and worker_of(client, p2).role is Role.PREFILL


@pytest.mark.parametrize("api", ["0.5.23", "convert"])
async def test_safe_failure_restores_and_unsafe_failure_fails(fake_fleet, make_router, api):
    p1, p2, d1 = await fake_fleet(2, 1, api=api)
    client = await make_router([p1, p2], [d1])
    worker = worker_of(client, p2)
    p2.switch_fault = "safe"
    resp = await client.post(f"/admin/workers/{worker.id}/convert", json={})
    record = await resp.json()
    assert resp.status == 502 and record["outcome"] == "restored", record
    assert worker.state is WorkerState.ACTIVE and worker.routable and worker.role is Role.PREFILL

    p2.switch_fault = "unsafe"
    resp = await client.post(f"/admin/workers/{worker.id}/convert", json={})
    record = await resp.json()
    assert resp.status == 502 and record["outcome"] == "failed", record
    assert worker.state is WorkerState.FAILED and not worker.routable
    assert worker not in client.registry.routable(Role.PREFILL)
    assert "reinstate" in worker.state_reason
    # Never routed to: every request goes to p1.
    for _ in range(5):
        assert (await client.post("/generate", json={"text": "x"})).status == 200
    assert len(p1.bodies()) == 5 and p2.bodies() == []
    # A failed worker cannot be converted again until an operator acts.
    resp = await client.post(f"/admin/workers/{worker.id}/convert", json={})
    assert resp.status == 409 and "failed" in (await resp.json())["error"]["message"]

    # The operator reinstates it: refused while the server reports no PD role, accepted once it does.
    resp = await client.post(f"/admin/workers/{worker.id}/reinstate")
    assert resp.status == 502 and worker.state is WorkerState.FAILED
    p2.role = "decode"  # the operator repaired it as a decode server
    p2.weight_version = "v2"  # ... but it does not carry the fleet's weights
    await wait_for(lambda: all(w.weight_version == "default" for w in client.registry.workers() if w.routable))
    resp = await client.post(f"/admin/workers/{worker.id}/reinstate", json={})
    assert resp.status == 409 and "weight version 'v2' differs" in (await resp.json())["error"]["message"]
    assert worker.state is WorkerState.FAILED
    p2.weight_version = "default"
    resp = await client.post(f"/admin/workers/{worker.id}/reinstate", json={})
    body = await resp.json()
    assert resp.status == 200, body
    assert (worker.role, worker.state, worker.routable) == (Role.DECODE, WorkerState.ACTIVE, True)
    resp = await client.post(f"/admin/workers/{worker.id}/reinstate")
    assert resp.status == 409  # only failed workers are reinstated
    await wait_for(lambda: inflight(client) == [0, 0, 0])


async def test_success_without_a_role_change_is_a_failure(fake_fleet, make_router):
    p1, p2, d1 = await fake_fleet(2, 1)
    client = await make_router([p1, p2], [d1])
    p2.switch_fault = "noop"
    resp = await client.post(f"/admin/workers/{worker_of(client, p2).id}/convert", json={"verify_timeout_s": 0.3})
    record = await resp.json()
    assert resp.status == 502 and record["outcome"] == "restored", record
    assert "still reports role prefill" in record["message"]
    assert worker_of(client, p2).role is Role.PREFILL and worker_of(client, p2).routable


async def test_server_without_a_switch_api_is_restored(fake_fleet, make_router):
    p1, p2, d1 = await fake_fleet(2, 1, api="none")
    client = await make_router([p1, p2], [d1])
    resp = await client.post("/pd_role_switch", json={"worker_url": p2.url, "new_role": "decode"})
    body = await resp.json()
    assert resp.status == 502 and body["outcome"] == "restored" and "no role-switch API" in body["message"]
    assert worker_of(client, p2).routable


async def test_abort_mode_marks_the_worker_and_aborts_all(sim_workers, make_router):
    p1, p2, d1 = await sim_workers(2, 1)
    client = await make_router([p1, p2], [d1])
    worker = worker_of(client, p2)
    epoch = worker.abort_epoch
    resp = await client.post(f"/admin/workers/{worker.id}/convert", json={"mode": "abort"})
    record = await resp.json()
    assert resp.status == 200 and record["mode"] == "abort" and record["steps"][0]["step"] == "abort"
    assert {"abort_all": True} in p2.aborts and worker.abort_epoch > epoch


async def test_abort_mode_aborts_again_while_busy_and_counts_the_routers_requests_once(fake_fleet, make_router):
    p1, p2, d1 = await fake_fleet(2, 1)
    client = await make_router([p1, p2], [d1])
    requests = await hold_a_request_on(client, p2, other=p1)
    worker = worker_of(client, p2)
    resp = await client.post(f"/admin/workers/{worker.id}/convert", json={"mode": "abort", "wait": False})
    record = await resp.json()
    assert resp.status == 202, record
    # The fake ignores aborts: while its request is still there, the router aborts the worker again.
    await wait_for(lambda: p2.aborts.count({"abort_all": True}) >= 3, timeout=10, message="repeated aborts")
    p2.release.set()
    await asyncio.gather(*requests)
    record = await conversion_done(client, record["id"])
    assert record["outcome"] == "converted" and record["steps"][0]["attempts"] >= 3
    text = await (await client.get("/metrics")).text()
    assert 'pd_router_aborts_total{reason="conversion"} 1.0' in text


@pytest.mark.parametrize("path,body,problem", [
    ("/pd_role_switch", {"worker_url": "URL", "new_role": "decode", "drain_timeout": 3}, "unknown field(s) drain_timeout"),
    ("/pd_role_switch", {"worker_url": "URL"}, "new_role is required"),
    ("/pd_role_switch", {"worker_url": "URL", "new_role": "regular"}, "new_role must be one of"),
    ("/pd_role_switch", {"worker_url": "URL", "new_role": "decode", "drain_timeout_secs": "5"}, "positive number"),
    ("/pd_role_switch", {"worker_url": "URL", "new_role": "decode", "decode_cuda_graph_bs": [1, 0]}, "positive integers"),
    ("/convert_pd_role", {}, "server_url is required"),
    ("/convert_pd_role", {"server_url": "URL", "mode": "kill"}, "mode must be one of drain, abort"),
    ("/convert_pd_role", {"server_url": "URL", "disable_cuda_graph": "yes"}, "must be true or false"),
    ("/convert_pd_role", {"server_url": "not a url"}, "invalid worker url"),
    ("/convert_pd_role", [1, 2], "must be a JSON object"),
    ("/admin/workers/ID/convert", {"mode": "drain", "timeout_s": -1}, "timeout_s must be a positive number"),
    ("/admin/workers/ID/convert", {"wait": 1}, "wait must be true or false"),
    ("/admin/workers/ID/convert", {"server_options": [1]}, "server_options must be a JSON object"),
    ("/admin/workers/ID/convert", {"new_role": "decode", "bogus": 1}, "unknown field(s) bogus"),
])
async def test_bad_bodies_are_400(sim_workers, make_router, path, body, problem):
    p1, p2, d1 = await sim_workers(2, 1)
    client = await make_router([p1, p2], [d1])
    worker = worker_of(client, p2)
    if isinstance(body, dict):
        body = {k: (p2.url if v == "URL" else v) for k, v in body.items()}
    resp = await client.post(path.replace("ID", worker.id), json=body)
    answer = await resp.json()
    assert resp.status == 400, answer
    assert problem in answer["error"]["message"]
    assert p2.switch_calls == [] and worker.state is WorkerState.ACTIVE


async def test_unknown_worker_and_conversion_are_404(sim_workers, make_router):
    p1, d1 = await sim_workers(1, 1)
    client = await make_router([p1], [d1])
    resp = await client.post("/pd_role_switch", json={"worker_url": "http://127.0.0.1:1", "new_role": "decode"})
    body = await resp.json()
    assert resp.status == 404 and body["success"] is False and "no worker" in body["error"]["message"]
    assert (await client.post("/admin/workers/w99/convert", json={})).status == 404
    assert (await client.get("/admin/conversions/c99")).status == 404
    assert (await client.get("/admin/conversions?limit=0")).status == 400


async def test_history_keeps_every_conversion_with_its_steps(sim_workers, make_router):
    p1, p2, d1, d2 = await sim_workers(2, 2)
    client = await make_router([p1, p2], [d1, d2])
    first = await (await client.post("/pd_role_switch", json={"worker_url": p2.url, "new_role": "decode"})).json()
    second = await (await client.post("/pd_role_switch", json={"worker_url": p2.url, "new_role": "prefill"})).json()
    assert first["success"] and second["success"]
    assert p2.switch_calls[1] == {"new_role": "prefill"}
    history = await (await client.get("/admin/conversions")).json()
    assert [c["id"] for c in history["conversions"]] == [second["conversion_id"], first["conversion_id"]]
    assert history["running"] == []
    one = await (await client.get(f"/admin/conversions/{first['conversion_id']}")).json()
    assert (one["old_role"], one["new_role"], one["outcome"]) == ("prefill", "decode", "converted")
    assert one["duration_s"] >= one["empty_s"] + one["server_switch_s"]
    assert [s["step"] for s in one["steps"]] == ["drain", "switch", "verify"]
    filtered = await (await client.get(f"/admin/conversions?worker={p1.url}")).json()
    assert filtered["conversions"] == []


async def test_conversions_and_their_aborts_are_counted_in_metrics(sim_workers, make_router):
    p1, p2, d1 = await sim_workers(2, 1)
    client = await make_router([p1, p2], [d1])
    assert (await client.post(f"/admin/workers/{worker_of(client, p2).id}/convert", json={"mode": "abort"})).status == 200
    assert (await client.post(f"/admin/workers/{worker_of(client, p1).id}/convert", json={})).status == 409
    text = await (await client.get("/metrics")).text()
    assert 'pd_router_conversions_total{outcome="converted"} 1.0' in text
    assert 'pd_router_conversions_total{outcome="refused"} 1.0' in text
    assert 'pd_router_conversion_duration_seconds_count{outcome="converted"} 1.0' in text


async def test_no_conversion_starts_while_the_fleet_is_held(sim_workers, make_router):
    p1, p2, d1 = await sim_workers(2, 1)
    client = await make_router([p1, p2], [d1])
    client.app[ADMISSION].close_gate("weight_update")
    resp = await client.post("/pd_role_switch", json={"worker_url": p2.url, "new_role": "decode"})
    body = await resp.json()
    assert resp.status == 409 and "the fleet is held (weight_update)" in body["message"]
    assert p2.switch_calls == [] and worker_of(client, p2).state is WorkerState.ACTIVE
    client.app[ADMISSION].open_gate("weight_update")
    resp = await client.post("/pd_role_switch", json={"worker_url": p2.url, "new_role": "decode",
                                                      "server_options": {"custom": 1}})
    assert resp.status == 200
    assert p2.switch_calls == [{"new_role": "decode", "decode_cuda_graph_memory_gb": 0.0, "custom": 1}]


async def test_unreachable_server_is_left_unchanged_in_its_pool(sim_workers, make_router):
    p1, p2, d1 = await sim_workers(2, 1)
    client = await make_router([p1, p2], [d1])
    await p2.stop()  # nothing listens there any more: the switch cannot have reached it
    resp = await client.post(f"/admin/workers/{worker_of(client, p2).id}/convert", json={})
    record = await resp.json()
    assert resp.status == 502 and record["outcome"] == "restored", record
    assert "got no answer" in record["message"]
    assert worker_of(client, p2).state is WorkerState.ACTIVE and worker_of(client, p2).role is Role.PREFILL


@pytest.mark.parametrize("fault,outcome,status", [("hang", "restored", 504), ("late", "converted", 200)])
async def test_switch_without_an_answer_is_decided_by_the_live_role(fake_fleet, make_router, fault, outcome, status):
    p1, p2, d1 = await fake_fleet(2, 1)
    client = await make_router([p1, p2], [d1])
    p2.switch_fault = fault
    resp = await client.post(f"/admin/workers/{worker_of(client, p2).id}/convert", json={"switch_timeout_s": 0.3})
    record = await resp.json()
    assert resp.status == status and record["outcome"] == outcome, record
    assert record["steps"][1]["outcome"] == "timeout"
    worker = worker_of(client, p2)
    assert worker.state is WorkerState.ACTIVE and worker.role is Role(p2.role)
    if fault == "late":  # it did switch: verified and moved, with a note of what happened
        assert [s["step"] for s in record["steps"]] == ["drain", "switch", "verify"]
        assert "the server reports role decode: verifying" in record["notes"][0]
