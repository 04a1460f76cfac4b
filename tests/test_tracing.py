"""Traces end to end (`--enable-trace`): pd-router in front of simulated SGLang servers, exporting to a real OTLP
receiver (gRPC, OTLP's and SGLang's default, and HTTP/protobuf) whose protobuf is decoded with
opentelemetry-proto. Checked: the tree of spans (client -> request span -> one span per leg), the events, and the
traceparent that reached each server (the simulator records it, `GET /_sim/traces`): the request's trace and the
leg's span as parent, so a tracing SGLang's spans hang under the leg that reached it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys

import aiohttp
import pytest

pytest.importorskip("opentelemetry.sdk", reason="the `trace` extra (pip install 'pd-router[trace]')")

from router.core.config import DISCOVER, RetryConfig, RouterConfig, TraceConfig, WorkerSpec  # noqa: E402
from router.core.keys import REGISTRY  # noqa: E402
from router.obs import otel_tracing as tracing_module  # noqa: E402
from router.obs.otel_tracing import TRACING  # noqa: E402
from router.server.app import create_app  # noqa: E402
from simulator.fleet import Fleet  # noqa: E402

from .helpers import free_port, wait_for  # noqa: E402
from .otlp_receiver import OtlpReceiver  # noqa: E402

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
CLIENT_TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
BODY = {"text": "trace me", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}


@pytest.fixture
def receiver():
    with OtlpReceiver() as receiver:
        yield receiver


@pytest.fixture
async def fleet():
    async with Fleet(prefill=2, decode=1) as fleet:
        yield fleet


async def traced_router(aiohttp_client, fleet, endpoint: str, protocol: str | None = None, **changes):
    config = RouterConfig(
        prefill=tuple(WorkerSpec(h.url, DISCOVER) for h in fleet.prefill),
        decode=tuple(WorkerSpec(h.url) for h in fleet.decode),
        trace=TraceConfig(enabled=True, otlp_traces_endpoint=endpoint, protocol=protocol, service_name="router-t"),
        **changes).validated()
    client = await aiohttp_client(create_app(config), server_kwargs={"handler_cancellation": True})
    client.registry = client.app[REGISTRY]
    return client


async def sim_traces(fleet: Fleet) -> dict[str, list[dict]]:
    """url -> the trace headers each simulated server got."""
    out = {}
    async with aiohttp.ClientSession() as session:
        for handle in fleet.workers:
            async with session.get(f"{handle.url}/_sim/traces") as resp:
                out[handle.url] = (await resp.json())["calls"]
    return out


def parse_traceparent(value: str) -> tuple[str, str, str]:
    version, trace_id, parent, flags = value.split("-")
    assert version == "00" and len(trace_id) == 32 and len(parent) == 16
    return trace_id, parent, flags


def request_tree(spans, trace_id: str, service: str = "router-t"):
    """(request span, its leg spans) of one trace."""
    mine = [s for s in spans if s.trace_id == trace_id and s.service == service]
    (request,) = [s for s in mine if s.name.startswith("POST ")]
    legs = [s for s in mine if s.parent_span_id == request.span_id]
    return request, legs


def has_request(trace_id: str | None = None, count: int = 1):
    def check(spans):
        done = [s for s in spans if s.name.startswith("POST ") and (trace_id is None or s.trace_id == trace_id)]
        legs = [s for s in spans if s.name.endswith(" leg") and (trace_id is None or s.trace_id == trace_id)]
        return len(done) >= count and len(legs) >= 2 * count
    return check


@pytest.mark.parametrize("protocol,stream", [(None, False), ("grpc", True), ("http/protobuf", False),
                                             ("http/protobuf", True)])
async def test_a_traced_request_is_one_tree_from_the_client_to_both_servers(aiohttp_client, fleet, receiver,
                                                                          protocol, stream):
    endpoint = receiver.http_endpoint if protocol == "http/protobuf" else receiver.grpc_endpoint
    router = await traced_router(aiohttp_client, fleet, endpoint, protocol)
    resp = await router.post("/generate", json={**BODY, "stream": stream, "rid": "traced-1"},
                             headers={"traceparent": CLIENT_TRACEPARENT, "tracestate": "vendor=abc"})
    assert resp.status == 200
    await resp.read()
    spans = receiver.wait_for_spans(has_request(CLIENT_TRACE), message="the request's spans")
    assert receiver.exports["http" if protocol == "http/protobuf" else "grpc"] >= 1
    request, legs = request_tree(spans, CLIENT_TRACE)
    assert request.parent_span_id == CLIENT_SPAN  # the client's trace continued
    assert request.attributes["http.response.status_code"] == 200 and request.attributes["pd.outcome"] == "success"
    assert request.event_names()[0] == "admitted" and request.event_names().count("pair_chosen") == 1
    by_role = {leg.attributes["pd.role"]: leg for leg in legs}
    assert sorted(by_role) == ["decode", "prefill"] and len(legs) == 2
    assert all(leg.attributes["rid"] == "traced-1" and leg.attributes["pd.leg.outcome"] == "success" for leg in legs)

    # what each server got: this trace, its own leg's span as the parent, the client's tracestate kept
    seen = await sim_traces(fleet)
    for role, leg in by_role.items():
        calls = [c for c in seen[leg.attributes["server.url"]] if c["rids"] == ["traced-1"]]
        assert len(calls) == 1, (role, seen)
        trace_id, parent, flags = parse_traceparent(calls[0]["traceparent"])
        assert (trace_id, parent, flags) == (CLIENT_TRACE, leg.span_id, "01")
        assert calls[0]["tracestate"] == "vendor=abc"
        assert leg.start_ns >= request.start_ns and leg.end_ns <= request.end_ns + 1


async def test_no_trace_context_starts_a_new_trace_and_a_malformed_one_too(aiohttp_client, fleet, receiver, caplog):
    router = await traced_router(aiohttp_client, fleet, receiver.grpc_endpoint)
    bad = ["00-00000000000000000000000000000000-00f067aa0ba902b7-01",  # all-zero trace id
           "garbage", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7", "ff-" + CLIENT_TRACEPARENT[3:],
           "00-4BF92F3577B34DA6A3CE929D0E0E4736-00F067AA0BA902B7-01", CLIENT_TRACEPARENT + "-extra"]
    for i, header in enumerate([None, *bad]):
        resp = await router.post("/generate", json={**BODY, "rid": f"new-{i}"},
                                 headers={} if header is None else {"traceparent": header})
        assert resp.status == 200, await resp.text()
    spans = receiver.wait_for_spans(has_request(count=len(bad) + 1), message="every request's spans")
    requests = [s for s in spans if s.name.startswith("POST ")]
    assert all(s.parent_span_id == "" for s in requests)  # roots of their own traces
    assert len({s.trace_id for s in requests}) == len(requests) and CLIENT_TRACE not in {s.trace_id for s in requests}
    seen = await sim_traces(fleet)
    for request in requests:
        _, legs = request_tree(spans, request.trace_id)
        for leg in legs:
            (call,) = [c for c in seen[leg.attributes["server.url"]] if c["rids"] == [leg.attributes["rid"]]]
            assert parse_traceparent(call["traceparent"])[:2] == (request.trace_id, leg.span_id)

    # a valid traceparent with a malformed tracestate: the trace continues, the tracestate is dropped (W3C), and
    # nothing of it reaches the log however often a client sends it
    for i, state in enumerate(["bad key=1,ok=2", "ok=2," + "x" * 600, "a=1,a=2"]):
        resp = await router.post("/generate", json={**BODY, "rid": f"state-{i}"},
                                 headers={"traceparent": CLIENT_TRACEPARENT, "tracestate": state})
        assert resp.status == 200
    receiver.wait_for_spans(has_request(CLIENT_TRACE, count=3))
    calls = [c for calls in (await sim_traces(fleet)).values() for c in calls if c["rids"][0].startswith("state-")]
    assert len(calls) == 6 and all(c["tracestate"] is None for c in calls)
    assert all(parse_traceparent(c["traceparent"])[0] == CLIENT_TRACE for c in calls)
    assert not [r for r in caplog.records if r.name.startswith("opentelemetry") and r.levelno >= logging.WARNING]


async def test_a_retry_is_an_event_and_the_failed_leg_an_error_span(aiohttp_client, fleet, receiver):
    router = await traced_router(aiohttp_client, fleet, receiver.grpc_endpoint,
                                 retry=RetryConfig(initial_backoff_ms=1, max_backoff_ms=2))
    failing = fleet.prefill[0]
    await fleet.set_faults(failing, fail_next=1, error_status=503)
    await fleet.set_faults(fleet.prefill[1], fail_next=1, error_status=503)  # whichever is chosen first fails
    resp = await router.post("/generate", json=BODY, headers={"traceparent": CLIENT_TRACEPARENT})
    assert resp.status == 200, await resp.text()
    spans = receiver.wait_for_spans(lambda s: len([x for x in s if x.name.endswith(" leg")]) >= 6)
    request, legs = request_tree(spans, CLIENT_TRACE)
    names = request.event_names()
    # both prefills fail once: attempt 1 on one, 2 on the other, 3 back on the first (no other left)
    assert names.count("pair_chosen") == 3 and names.count("retry") == 2, names
    retries = [attrs for name, attrs in request.events if name == "retry"]
    assert all("503" in r["pd.reason"] for r in retries) and [r["pd.attempt"] for r in retries] == [1, 2]
    assert request.attributes["pd.attempts"] == 3
    attempts = sorted((leg.attributes["pd.attempt"], leg.attributes["pd.role"], leg.attributes["pd.leg.outcome"])
                      for leg in legs)
    assert attempts == [(1, "decode", "cancelled"), (1, "prefill", "error"), (2, "decode", "cancelled"),
                        (2, "prefill", "error"), (3, "decode", "success"), (3, "prefill", "success")]
    assert [leg.status_code for leg in legs if leg.attributes["pd.leg.outcome"] == "error"] == [2, 2]


async def test_a_failed_request_is_an_error_span(aiohttp_client, fleet, receiver):
    router = await traced_router(aiohttp_client, fleet, receiver.grpc_endpoint, retry=RetryConfig(enabled=False))
    for handle in fleet.prefill:
        await fleet.set_faults(handle, fail_next=1, error_status=503)
    resp = await router.post("/generate", json=BODY)
    assert resp.status == 503
    spans = receiver.wait_for_spans(has_request())
    (request,) = [s for s in spans if s.name.startswith("POST ")]
    assert request.status_code == 2 and request.attributes["http.response.status_code"] == 503
    assert "503" in request.status_message


async def test_conversions_and_weight_updates_are_spans_with_one_child_per_step(aiohttp_client, receiver):
    async with Fleet(prefill=2, decode=1) as fleet:
        router = await traced_router(aiohttp_client, fleet, receiver.http_endpoint, "http/protobuf")
        resp = await router.post("/update_weights_from_disk", json={"model_path": "sim/m", "weight_version": "v2"})
        assert resp.status == 200, await resp.text()
        worker = router.registry.find(fleet.prefill[0].url)
        resp = await router.post(f"/admin/workers/{worker.id}/convert", json={"mode": "drain"})
        assert resp.status == 200, await resp.text()
        spans = receiver.wait_for_spans(
            lambda s: {"update weights from disk", "convert prefill -> decode"} <= {x.name for x in s})
        for name in ("update weights from disk", "convert prefill -> decode"):
            (op,) = [s for s in spans if s.name == name]
            assert op.parent_span_id == "" and op.status_code != 2, op
            steps = [s for s in spans if s.trace_id == op.trace_id and s.parent_span_id == op.span_id]
            assert len(steps) >= 3 and all(s.attributes["pd.step.outcome"] in ("ok", "skipped") for s in steps)
            assert all(op.start_ns <= s.start_ns <= s.end_ns <= op.end_ns + 1000 for s in steps)
            if name.startswith("update"):
                record = await (await router.get(f"/weight_updates/{op.attributes['pd.operation.id']}")).json()
            else:
                record = await (await router.get(f"/admin/conversions/{op.attributes['pd.conversion.id']}")).json()
            # one span per step the flow recorded, in its order, with its outcome
            assert [(s.name, s.attributes["pd.step.outcome"]) for s in sorted(steps, key=lambda s: s.start_ns)] == \
                [(step["name"], step["outcome"]) for step in record["steps"]], record
        (update,) = [s for s in spans if s.name == "update weights from disk"]
        assert update.attributes["pd.weight_version"] == "v2" and update.attributes["pd.state"] == "succeeded"


async def test_collector_down_requests_served_no_hang_one_warning(aiohttp_client, fleet, caplog, monkeypatch):
    monkeypatch.setattr(tracing_module, "EXPORT_TIMEOUT_S", 0.5)
    caplog.set_level(logging.INFO, logger="router.obs.otel_tracing")
    router = await traced_router(aiohttp_client, fleet, f"127.0.0.1:{free_port()}")  # nothing listens there
    watch = router.app[TRACING].watch

    async def burst(n: int) -> None:
        for _ in range(n):
            async with asyncio.timeout(10):
                resp = await router.post("/generate", json=BODY, headers={"traceparent": CLIENT_TRACEPARENT})
                assert resp.status == 200
                await resp.read()

    await burst(5)
    await wait_for(lambda: watch.failing, timeout=15, message="the exporter found the collector down")
    await burst(10)
    await wait_for(lambda: watch.dropped >= 15 * 3, timeout=15, message="later batches failed too")
    async with asyncio.timeout(12):  # the app's clean-up flushes within its bound
        await router.close()
    warnings = [r for r in caplog.records if r.name == "router.obs.otel_tracing" and r.levelno >= logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "cannot export spans" in warnings[0].getMessage()


async def test_collector_killed_and_back_spans_flow_again(aiohttp_client, fleet, caplog, monkeypatch):
    monkeypatch.setattr(tracing_module, "EXPORT_TIMEOUT_S", 0.5)
    caplog.set_level(logging.INFO, logger="router.obs.otel_tracing")
    receiver = OtlpReceiver().start(grpc=False)
    port = receiver.http_port
    router = await traced_router(aiohttp_client, fleet, receiver.http_endpoint, "http/protobuf")
    watch = router.app[TRACING].watch
    assert (await router.post("/generate", json=BODY)).status == 200
    receiver.wait_for_spans(has_request())
    receiver.stop()  # the collector dies
    for _ in range(3):
        assert (await router.post("/generate", json=BODY)).status == 200
    await wait_for(lambda: watch.failing, timeout=15, message="exports failing")
    back = OtlpReceiver().start(grpc=False, http_port=port)  # a collector restarted where it was
    try:
        assert (await router.post("/generate", json=BODY)).status == 200
        back.wait_for_spans(has_request(), message="spans after the collector came back")
        await wait_for(lambda: not watch.failing, timeout=10)
    finally:
        await router.close()
        back.stop()
    lines = [r.getMessage() for r in caplog.records if r.name == "router.obs.otel_tracing"]
    assert sum("cannot export spans" in line for line in lines) == 1
    assert sum("works again" in line for line in lines) == 1


async def test_a_bad_protocol_or_missing_endpoint_is_refused_at_start():
    from router.core.config import ConfigError
    from router.server.cli import config_from_args

    with pytest.raises(ConfigError, match="grpc or http/protobuf"):
        config_from_args(["--enable-trace"], env={"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json"})
    config_from_args([], env={"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json"})  # off: not its business
    config = config_from_args(["--enable-trace", "--otlp-traces-endpoint", "collector:4317"], env={})
    assert config.trace == TraceConfig(enabled=True, otlp_traces_endpoint="collector:4317")
    assert tracing_module.http_traces_url("collector:4318") == "http://collector:4318/v1/traces"
    assert tracing_module.http_traces_url("https://c:1/x/v1/traces") == "https://c:1/x/v1/traces"


def test_tracing_off_imports_nothing_of_opentelemetry_and_passes_the_client_context_through():
    """A router process without --enable-trace serves a request: no opentelemetry module was imported, and the
    client's traceparent reached both servers as it was sent (servers tracing on their own join its trace)."""
    script = f"""
import asyncio, sys, aiohttp
from router.core.config import DISCOVER, RouterConfig, WorkerSpec
from router.server.app import create_app
from simulator.fleet import Fleet
from aiohttp.test_utils import TestServer, TestClient

async def main():
    async with Fleet(prefill=1, decode=1) as fleet:
        config = RouterConfig(prefill=(WorkerSpec(fleet.prefill[0].url, DISCOVER),),
                              decode=(WorkerSpec(fleet.decode[0].url),)).validated()
        async with TestClient(TestServer(create_app(config))) as client:
            resp = await client.post("/generate", json={{"text": "x", "rid": "off-1"}},
                                     headers={{"traceparent": "{CLIENT_TRACEPARENT}", "tracestate": "k=v"}})
            assert resp.status == 200, await resp.text()
        async with aiohttp.ClientSession() as s:
            for h in fleet.workers:
                calls = (await (await s.get(h.url + "/_sim/traces")).json())["calls"]
                assert [(c["traceparent"], c["tracestate"]) for c in calls] == [("{CLIENT_TRACEPARENT}", "k=v")], calls
    loaded = sorted(m for m in sys.modules if m.startswith("opentelemetry"))
    assert not loaded, loaded
    print("ok")

asyncio.run(main())
"""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


async def test_router_process_sigterm_flushes_its_spans_and_exits_at_once_with_the_collector_down(tmp_path):
    """A traced router process: SIGTERM with a live collector exports the last request's spans before it exits
    0; with the collector gone, SIGTERM still exits 0 promptly (no wait on export retries)."""
    from .router_process import RouterProcess

    async with Fleet(prefill=1, decode=1) as fleet:
        with OtlpReceiver() as receiver:
            async with RouterProcess(fleet, "--enable-trace", "--otlp-traces-endpoint", receiver.grpc_endpoint,
                                     log_path=tmp_path / "up.log") as router:
                status, _ = await router.call("/generate", {**BODY, "rid": "last-one"})
                assert status == 200
                router.send()
                assert await router.exited(20) == 0, router.log()
            spans = receiver.wait_for_spans(has_request(), timeout=5, message="the last request's spans")
            assert {s.attributes.get("rid") for s in spans if s.name.endswith(" leg")} == {"last-one"}

        down = f"127.0.0.1:{free_port()}"
        async with RouterProcess(fleet, "--enable-trace", "--otlp-traces-endpoint", down,
                                 log_path=tmp_path / "down.log") as router:
            for _ in range(3):
                assert (await router.call("/generate", BODY))[0] == 200
            sent = router.send()
            assert await router.exited(20) == 0, router.log()
            took = asyncio.get_running_loop().time() - sent  # monotonic, as `send`'s
            assert took < 15, router.log()
            assert "Traceback" not in router.log()


async def test_router_process_sigkilled_mid_request_loses_only_its_spans(tmp_path):
    """SIGKILL while a traced request waits on a hung decode: the client's connection breaks, nothing hangs; the
    router started again with the same flags exports the next request's tree."""
    from .router_process import RouterProcess

    async with Fleet(prefill=1, decode=1) as fleet:
        with OtlpReceiver() as receiver:
            router = RouterProcess(fleet, "--enable-trace", "--otlp-traces-endpoint", receiver.grpc_endpoint,
                                   log_path=tmp_path / "router.log")
            async with router:
                await fleet.set_faults(fleet.decode[0], hang=True)
                pending = asyncio.ensure_future(router.call("/generate", {**BODY, "rid": "hung"}))
                await fleet.wait_for(fleet.decode[0], lambda s: s["counters"]["requests_by_route"].get("generate"))
                await router.kill()
                with pytest.raises(aiohttp.ClientError):
                    await asyncio.wait_for(pending, 10)
                await fleet.set_faults(fleet.decode[0], reset=True)
                await router.start()
                status, _ = await _traced_call(router, "after")
                assert status == 200
                spans = receiver.wait_for_spans(has_request(CLIENT_TRACE), message="the restarted router's spans")
                _, legs = request_tree(spans, CLIENT_TRACE, "pd-router")  # the default service name
                assert {leg.attributes["rid"] for leg in legs} == {"after"}


async def _traced_call(router, rid: str) -> tuple[int, bytes]:
    async with router.session.post(router.url + "/generate", json={**BODY, "rid": rid},
                                   headers={"traceparent": CLIENT_TRACEPARENT}) as resp:
        return resp.status, await resp.read()


def test_enable_trace_without_the_packages_exits_2_saying_what_to_install(tmp_path):
    """--enable-trace where the `trace` extra is missing (hidden from the process): exit 2 naming the extra."""
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(
        "import sys\nclass Hide:\n    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'opentelemetry' or name.startswith('opentelemetry.'):\n"
        "            raise ModuleNotFoundError(name)\n        return None\nsys.meta_path.insert(0, Hide())\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": f"{hide}{os.pathsep}{root}"}
    done = subprocess.run([sys.executable, "-m", "router", "--enable-trace", "--port", str(free_port())], cwd=root,
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    assert "pip install 'pd-router[trace]'" in done.stderr


async def test_sampled_out_requests_export_nothing_and_still_tell_the_servers(aiohttp_client, fleet, receiver,
                                                                          monkeypatch):
    """OTEL_TRACES_SAMPLER (the SDK's own variable) lowers the cost: a request sampled out exports no span, and its
    legs still carry its trace with the sampled flag off, so the servers (parent-based, as SGLang's) do not
    record it either; a client that sampled its span in keeps it in (parent-based)."""
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0")
    router = await traced_router(aiohttp_client, fleet, receiver.grpc_endpoint)
    assert (await router.post("/generate", json={**BODY, "rid": "out-1"})).status == 200
    resp = await router.post("/generate", json={**BODY, "rid": "in-1"}, headers={"traceparent": CLIENT_TRACEPARENT})
    assert resp.status == 200
    spans = receiver.wait_for_spans(has_request(CLIENT_TRACE))
    assert {s.trace_id for s in spans} == {CLIENT_TRACE}  # nothing of the sampled-out request
    seen = [c for calls in (await sim_traces(fleet)).values() for c in calls if c["rids"] == ["out-1"]]
    # the sampled bit off (the SDK sets W3C level 2's random-trace-id bit, 0x02, on the traces it starts)
    assert len(seen) == 2 and all(int(parse_traceparent(c["traceparent"])[2], 16) & 1 == 0 for c in seen), seen
