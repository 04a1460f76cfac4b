"""SMG's RL control plane (`/v1/rl`) driven by SMG's own client (`smg.rl`, smg 1.13.0) and by plain HTTP,
against pd-router in front of a simulated 2P+2D fleet: the discovery rows, one-server calls, selector fan-outs,
the fleet operations that run the router's flows, and the errors.

`smg.rl` is a blocking (urllib) client: it runs in a thread, so the router on this test's loop keeps serving.
"""

from __future__ import annotations

import asyncio
import dataclasses
from urllib.parse import quote

import orjson
import pytest
from aiohttp import web
from multidict import CIMultiDict

from router.api.rl.engine_relay import MAX_BODY_CHARS
from router.core.config import AdmissionConfig
from router.core.keys import CONFIG
from router.core.registry import Role, WorkerState

from .test_weights_e2e import Router, sim_router  # noqa: F401 (the fixture)

rl_client = pytest.importorskip("smg.rl", reason="smg 1.13.0 (installed --no-deps by scripts/setup.sh)")
RL, FanoutError, RlError, paused = rl_client.RL, rl_client.FanoutError, rl_client.RlError, rl_client.paused

ADMIN_KEY = "admin-secret"
WHOLE_FLEET = "engine=sglang"


def client(router: Router, api_key: str | None = None) -> "RL":
    return RL(str(router.http.make_url("")), api_key=api_key, timeout=60)


async def blocking(fn, *args, **kwargs):
    return await asyncio.to_thread(fn, *args, **kwargs)


async def rl_error(fn, *args, **kwargs) -> "RlError":
    with pytest.raises(RlError) as caught:
        await blocking(fn, *args, **kwargs)
    return caught.value


def ids(router: Router, role: str | None = None) -> list[str]:
    return sorted(w.id for w in router.registry.workers() if role is None or w.role.value == role)


# ---- discovery ---------------------------------------------------------------------------------------------
async def test_workers_lists_every_server_with_smg_fields(sim_router):
    router = await sim_router(2, 2)
    rl = client(router)
    workers = await blocking(rl.workers)
    assert sorted(w.id for w in workers) == ids(router)
    assert [w.base_url for w in workers] == sorted(w.base_url for w in workers), "rows sorted by base_url"
    for worker in workers:
        known = router.registry.get(worker.id)
        assert (worker.url, worker.base_url, worker.control_url) == (known.url,) * 3
        assert (worker.worker_type, worker.role) == (known.role.value,) * 2
        assert (worker.engine, worker.connection_mode, worker.engine_version) == ("sglang", "http", "0.5.23")
        assert (worker.model_id, worker.tp_size, worker.dp_size, worker.pp_size, worker.dp_ranks) == \
            ("sim/tiny-llama", 1, 1, 1, 1)
        assert (worker.health, worker.weight_version) == ("ready", "default")
        assert worker.labels["role"] == known.role.value and worker.labels["state"] == "active"
        assert worker.capabilities["pause_modes"] == ["abort", "retract", "in_place"]
        assert await blocking(rl.worker, worker.id) == worker

    status, raw = await router.call("/v1/rl/workers", method="GET")
    assert status == 200 and raw["protocol_version"] == 1 and raw["total"] == 4
    assert {f.name for f in dataclasses.fields(rl_client.Worker)} <= set(raw["workers"][0])


async def test_discovery_reports_the_version_the_router_saw_last(sim_router):
    router = await sim_router(1, 1)
    status, _ = await router.call("/update_weight_version", {"new_version": "v7"})
    assert status == 200
    assert {w.weight_version for w in await blocking(client(router).workers)} == {"v7"}


async def test_an_unknown_worker_is_404(sim_router):
    router = await sim_router(1, 1)
    rl = client(router)
    for call in (lambda: rl.worker("w99"), lambda: rl.call("w99", "server_info", method="GET")):
        error = await rl_error(call)
        assert error.status == 404
        assert error.payload["error"]["type"] == "worker_not_found" and error.payload["error"]["id"] == "w99"


# ---- one server ---------------------------------------------------------------------------------------------
async def test_call_relays_to_that_server_only_in_smg_envelope(sim_router):
    router = await sim_router(2, 2)
    rl = client(router)
    decode = router.fleet.decode[1]
    worker = router.worker(decode)
    result = await blocking(rl.call, worker.id, "server_info", method="GET")
    assert (result.worker_id, result.url, result.status) == (worker.id, worker.url, 200)
    assert result.latency_ms >= 0 and result.body["port"] == decode.port

    result = await blocking(rl.call, worker.id, "init_weights_update_group",
                            {"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 3, "world_size": 5})
    assert result.status == 200 and result.body["success"] is True
    # only that server joined the group: another has none to destroy, and its refusal comes back as the
    # engine's status, in the envelope
    other = router.worker(router.fleet.decode[0])
    result = await blocking(rl.call, other.id, "destroy_weights_update_group", {})
    assert result.status == 400 and result.body["success"] is False
    result = await blocking(rl.call, worker.id, "destroy_weights_update_group", {})
    assert result.status == 200 and result.body["success"] is True


async def test_a_call_that_would_change_one_server_of_the_fleet_is_refused(sim_router):
    router = await sim_router(1, 1)
    rl = client(router)
    worker = router.worker(router.fleet.decode[0])
    for path, body in (("update_weights_from_disk", {"model_path": "sim/tiny-llama", "weight_version": "v2"}),
                       ("pause_generation", {}), ("release_memory_occupation", {})):
        error = await rl_error(rl.call, worker.id, path, body)
        assert error.status == 409 and error.payload["error"]["type"] == "fleet_operation", path
    assert await router.versions() == ["default", "default"]
    assert router.admission.is_open


async def test_an_unreachable_server_is_502(sim_router):
    router = await sim_router(1, 1)
    gone = router.registry.add("http://127.0.0.1:9", Role.DECODE, None, reason="test: nothing listens")
    error = await rl_error(client(router).call, gone.id, "server_info", method="GET")
    assert error.status == 502 and error.payload["error"]["type"] == "upstream_unreachable"


# ---- fan-outs ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("selector,role", [
    ("worker_type=decode", "decode"),
    ("role in (prefill)", "prefill"),
    ("role notin (prefill), health=ready", "decode"),
    (WHOLE_FLEET, None),
])
async def test_fanout_reaches_the_selected_servers(sim_router, selector, role):
    router = await sim_router(2, 2)
    result = await blocking(client(router).fanout, "flush_cache", {}, selector=selector)
    assert sorted(result.results) == ids(router, role)
    assert (result.total, result.succeeded, result.failed) == (len(ids(router, role)),) * 2 + ([],)
    assert all(r.status == 200 and "Cache flushed" in r.body for r in result.results.values())


async def test_fanout_by_id_and_by_url(sim_router):
    router = await sim_router(2, 2)
    rl = client(router)
    first, second = ids(router)[0], ids(router)[2]
    result = await blocking(rl.fanout, "get_server_info", selector=f"id in ({first},{second})", method="GET")
    assert sorted(result.results) == [first, second]
    url = router.registry.get(second).url
    result = await blocking(rl.fanout, "get_server_info", selector=f'url="{url}"', method="GET")
    assert list(result.results) == [second] and result.results[second].body["port"] == int(url.rsplit(":", 1)[1])


async def test_fanout_with_a_failed_server_is_207(sim_router):
    router = await sim_router(2, 2)
    sick = router.fleet.prefill[1]
    await router.fleet.set_faults(sick, unhealthy=True)
    rl = client(router)
    with pytest.raises(FanoutError) as caught:
        await blocking(rl.fanout, "health", selector=WHOLE_FLEET, method="GET")
    result = caught.value.result
    assert caught.value.status == 207
    assert [(f.worker_id, f.status, f.error) for f in result.failed] == [(router.worker(sick).id, 503,
                                                                          "upstream_error")]
    assert (result.total, result.succeeded) == (4, 3) and result.results[router.worker(sick).id].status == 503
    allowed = await blocking(rl.fanout, "health", selector=WHOLE_FLEET, method="GET", allow_partial=True)
    assert allowed.succeeded == 3


async def test_fanout_errors(sim_router):
    router = await sim_router(1, 1)
    status, body = await router.call("/v1/rl/engine/flush_cache")
    assert status == 400 and body["error"]["type"] == "selector_required"
    status, body = await router.call("/v1/rl/engine/flush_cache?selector=id%20in%20(w1%2C")
    assert status == 400 and body["error"]["type"] == "invalid_selector" and body["error"]["offset"] == 10
    status, body = await router.call("/v1/rl/engine/flush_cache?selector=engine%3Dvllm")
    assert status == 400 and body["error"]["type"] == "no_workers_match" and body["error"]["selector"] == "engine=vllm"
    status, body = await router.call("/v1/rl/engine/flush%20cache?selector=engine%3Dsglang")
    assert status == 400 and body["error"]["type"] == "invalid_engine_path"
    for path in ("generate", "pd_role_switch", "no_such_route"):
        status, body = await router.call(f"/v1/rl/engine/{path}?selector=engine%3Dsglang", {})
        assert status == 404 and body["error"]["type"] == "unknown_engine_path", path
    error = await rl_error(client(router).fanout, "flush_cache", {}, selector="engine=vllm")
    assert error.status == 400 and error.payload["error"]["type"] == "no_workers_match"


# ---- fleet operations --------------------------------------------------------------------------------------
async def test_paused_update_runs_the_flows_for_the_whole_fleet(sim_router):
    router = await sim_router(2, 2)
    rl = client(router)

    def refit():
        with paused(rl, WHOLE_FLEET) as pause:
            assert not router.admission.is_open, "new requests wait in the router's hold"
            update = rl.fanout("update_weights_from_disk", {"model_path": "sim/tiny-llama-v2", "weight_version": "v2"},
                               selector=WHOLE_FLEET)
        return pause, update

    pause, update = await blocking(refit)
    assert (pause.total, pause.succeeded, update.total, update.succeeded) == (4, 4, 4, 4)
    assert sorted(update.results) == ids(router)
    for result in update.results.values():
        assert result.status == 200 and result.body["success"] is True
        assert result.body["weight_version"] == "v2" and result.body["routable"] is True
    assert await router.versions() == ["v2"] * 4
    assert router.admission.is_open and router.flow.paused is None
    history = (await router.call("/weight_updates", method="GET"))[1]["history"]
    assert [op["kind"] for op in reversed(history)] == ["pause_generation", "update_weights_from_disk",
                                                        "continue_generation"]
    assert (await router.generate()).weight_version == "v2"


async def test_an_update_that_fails_on_one_server_is_207_and_leaves_it_out(sim_router):
    router = await sim_router(2, 2)
    broken = router.fleet.decode[0]
    await router.fleet.set_faults(broken, update_failure=True)
    rl = client(router)
    with pytest.raises(FanoutError) as caught:
        await blocking(rl.fanout, "update_weights_from_disk",
                       {"model_path": "sim/tiny-llama-v2", "weight_version": "v2"}, selector=WHOLE_FLEET)
    result, broken_id = caught.value.result, router.worker(broken).id
    assert caught.value.status == 207 and (result.total, result.succeeded) == (4, 3)
    assert [(f.worker_id, f.status, f.error) for f in result.failed] == [(broken_id, 400, "upstream_error")]
    assert result.results[broken_id].body["routable"] is False
    assert router.registry.get(broken_id).state is WorkerState.FAILED, "left out until it serves v2"
    assert sorted(w.url for w in router.registry.routable(Role.DECODE)) == [router.fleet.decode[1].url]
    assert (await router.generate()).weight_version == "v2"


async def test_a_fleet_operation_on_part_of_the_fleet_is_refused(sim_router):
    router = await sim_router(2, 2)
    rl = client(router)
    for path, body in (("pause_generation", {}), ("abort_request", {"abort_all": True}),
                       ("update_weights_from_disk", {"model_path": "sim/tiny-llama-v2", "weight_version": "v2"})):
        error = await rl_error(rl.fanout, path, body, selector="worker_type=decode")
        assert error.status == 409 and error.payload["error"]["type"] == "partial_fleet", path
        assert error.payload["error"]["missing"] == ids(router, "prefill")
    assert await router.versions() == ["default"] * 4
    assert router.admission.is_open and not router.flow.history, "nothing ran"


async def test_abort_all_and_init_group_go_through_the_router(sim_router):
    router = await sim_router(2, 2)
    rl = client(router)
    result = await blocking(rl.fanout, "abort_request", {"abort_all": True}, selector=WHOLE_FLEET)
    assert (result.total, result.succeeded) == (4, 4)
    result = await blocking(rl.fanout, "init_weights_update_group",
                            {"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1,
                             "world_size": 5}, selector=WHOLE_FLEET)
    offsets = sorted(r.body["rank_offset"] for r in result.results.values())
    assert offsets == [1, 2, 3, 4], "each server got ranks of its own"
    error = await rl_error(rl.fanout, "update_weights_from_disk", {"model_path": 5}, selector=WHOLE_FLEET)
    assert error.status == 400 and "model_path" in error.payload["error"]["message"]


async def test_selected_servers_outside_the_fleet_operations_are_skipped(sim_router):
    router = await sim_router(1, 1)
    pending = router.registry.add("http://127.0.0.1:9", Role.PREFILL, None, state=WorkerState.PENDING,
                                  reason="test: not reachable yet")
    status, body = await router.call(f"/v1/rl/engine/pause_generation?selector={WHOLE_FLEET}", {})
    assert status == 200 and (body["total"], body["succeeded"]) == (2, 2)
    assert [(s["worker_id"], s["state"]) for s in body["skipped"]] == [(pending.id, "pending")]
    assert body["operation"]["success"] is True
    status, body = await router.call(f"/v1/rl/engine/continue_generation?selector={WHOLE_FLEET}", {})
    assert status == 200 and router.admission.is_open


# ---- access ------------------------------------------------------------------------------------------------
async def test_the_rl_routes_need_the_admin_key(sim_router):
    router = await sim_router(1, 1, router={"admin_api_key": ADMIN_KEY})
    error = await rl_error(client(router).workers)
    assert error.status == 401
    assert len(await blocking(client(router, ADMIN_KEY).workers)) == 2



# ---- what is relayed ---------------------------------------------------------------------------------------
class RecordingServer:
    """A server that records what reaches it and answers with what the test sets (an SGLang stand-in for
    the relay's own details: query, body, headers, a secret, a large answer)."""

    def __init__(self) -> None:
        self.seen: list[dict] = []
        self.answer: object = {"success": True, "api_key": "server-secret"}
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def _any(self, request: web.Request) -> web.Response:
        raw = await request.read()
        self.seen.append({"method": request.method, "path": request.path, "query": request.rel_url.raw_query_string,
                          "body": raw, "headers": CIMultiDict(request.headers)})
        if isinstance(self.answer, str):
            return web.Response(text=self.answer)
        return web.json_response(self.answer)

    def last(self, path: str) -> dict:
        return [seen for seen in self.seen if seen["path"] == path][-1]  # the router polls others on its own

    async def __aenter__(self) -> "RecordingServer":
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._any)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc) -> None:
        await self._runner.cleanup()


async def test_the_relay_forwards_query_body_and_tracing_but_not_the_callers_key(sim_router):
    router = await sim_router(1, 1, router={"admin_api_key": ADMIN_KEY, "worker_api_key": "worker-key"})
    async with RecordingServer() as server:
        worker = router.registry.add(server.url, Role.DECODE, None, reason="test: a recording server")
        headers = {"Authorization": f"Bearer {ADMIN_KEY}", "X-Request-Id": "req-7", "traceparent": "00-abc-def-01"}
        resp = await router.http.post(f"/v1/rl/workers/{worker.id}/engine/flush_cache?timeout=3&note=a%20b",
                                      json={"a": 1}, headers=headers)
        envelope = await resp.json()
        assert resp.status == 200 and envelope["body"] == {"success": True, "api_key": "<redacted>"}
        seen = server.last("/flush_cache")
        assert (seen["method"], seen["path"], seen["query"], orjson.loads(seen["body"])) == \
            ("POST", "/flush_cache", "timeout=3&note=a%20b", {"a": 1})
        assert seen["headers"]["Authorization"] == "Bearer worker-key", "the router's worker key, not the caller's"
        assert (seen["headers"]["X-Request-Id"], seen["headers"]["traceparent"]) == ("req-7", "00-abc-def-01")

        selector = quote(f'url="{server.url}"')
        server.answer = "x" * (MAX_BODY_CHARS + 10)
        resp = await router.http.get(f"/v1/rl/engine/get_load?selector={selector}&since=5", headers=headers)
        answer = await resp.json()
        assert resp.status == 200 and list(answer["results"]) == [worker.id]
        assert server.last("/get_load")["query"] == "since=5", "the selector stays with the router"
        result = answer["results"][worker.id]
        assert result["body_truncated"] is True and len(result["body"]) == MAX_BODY_CHARS
        router.registry.remove(worker)


async def test_a_tensor_update_fanout_takes_bodies_the_size_of_tensors(sim_router):
    """Admin bodies are bound by --max-admin-payload-size; serialized tensors by --max-payload-size, on the
    fan-out as on the router's /update_weights_from_tensor."""
    router = await sim_router(1, 1, router={"admission": AdmissionConfig(max_admin_payload_size=1000)})
    bound = router.http.app[CONFIG].admission.max_admin_payload_size
    tensors = {"serialized_named_tensors": ["A" * (bound + 10)], "weight_version": "v2"}
    result = await blocking(client(router).fanout, "update_weights_from_tensor", tensors, selector=WHOLE_FLEET)
    assert (result.total, result.succeeded) == (2, 2)
    assert await router.versions() == ["v2", "v2"]
    error = await rl_error(client(router).fanout, "flush_cache", {"pad": "A" * (bound + 10)}, selector=WHOLE_FLEET)
    assert error.status == 413
