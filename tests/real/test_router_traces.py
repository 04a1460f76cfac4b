"""One trace from the client through pd-router to both real SGLang 0.5.23 servers.

A prefill and a decode server of their own, started with `--enable-trace --otlp-traces-endpoint` pointing at
the tests' OTLP receiver (gRPC, SGLang's default), and pd-router with `--enable-trace` exporting to the same
receiver. A request sent with the client's `traceparent` must come back as one trace: the router's request
span under the client's span, a span per leg, and each server's own request span (`prefill Req ...`,
`decode Req ...`, opened by 0.5.23's tokenizer manager from the traceparent it read) under the leg that reached
it. This module runs first (conftest's order), before the session fleet starts, so its two servers never run
beside the fleet's four.
"""

from __future__ import annotations

import json
import subprocess
import urllib.request

import pytest

pytest.importorskip("opentelemetry.sdk", reason="the `trace` extra (pip install 'pd-router[trace]')")

from server_patches.pair import RealServer, ensure_tiny_model, wait_healthy  # noqa: E402

from ..otlp_receiver import OtlpReceiver  # noqa: E402
from .router_process import RouterProcess  # noqa: E402

CLIENT_TRACE = "5bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "10f067aa0ba902b7"
START_TIMEOUT_S = 300.0
# What SGLang 0.5.23's --enable-trace imports (observability/trace.py); without one of them it refuses to start.
SGLANG_TRACE_IMPORTS = ("opentelemetry.sdk.trace", "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
                        "opentelemetry.exporter.otlp.proto.http.trace_exporter")


@pytest.fixture(scope="module")
def receiver():
    with OtlpReceiver() as receiver:
        yield receiver


@pytest.fixture(scope="module")
def traced(stack_paths, receiver, tmp_path_factory):
    """(router, prefill, decode): servers and router all exporting to the receiver."""
    probe = subprocess.run([str(stack_paths.venv / "bin" / "python"), "-c",
                            "import " + ", ".join(SGLANG_TRACE_IMPORTS)], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"the real venv {stack_paths.venv} cannot trace: {probe.stderr.strip().splitlines()[-1:]} "
                    f"(server_patches/requirements-real.txt pins the OpenTelemetry packages: rerun "
                    f"python -m server_patches.install)")
    run_dir = tmp_path_factory.mktemp("traced")
    model = ensure_tiny_model(stack_paths)
    servers = {}
    try:
        for role in ("prefill", "decode"):
            servers[role] = RealServer.launch(
                role, paths=stack_paths, model=model, log_path=run_dir / f"{role}.log", die_with_parent=True,
                extra_args=["--enable-trace", "--otlp-traces-endpoint", receiver.grpc_endpoint,
                            "--otlp-service-name", f"sglang-{role}"])
        wait_healthy(list(servers.values()), START_TIMEOUT_S)
        router = RouterProcess.start(
            prefill=[(servers["prefill"].url, servers["prefill"].bootstrap_port)], decode=[servers["decode"].url],
            log_path=run_dir / "router.log",
            extra_args=["--enable-trace", "--otlp-traces-endpoint", receiver.grpc_endpoint,
                        "--otlp-service-name", "pd-router", "--health-check-interval-secs", "30",
                        "--rebalance", "off"])
        try:
            yield router, servers["prefill"], servers["decode"]
        finally:
            router.stop()
            assert "Traceback" not in router.log(), router.log_tail(60)
    finally:
        for server in servers.values():
            server.stop()


def generate(url: str, body: dict, traceparent: str | None) -> tuple[int, bytes]:
    headers = {"Content-Type": "application/json"}
    if traceparent:
        headers["traceparent"] = traceparent
    request = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(), headers=headers)
    with urllib.request.urlopen(request, timeout=120) as resp:
        return resp.status, resp.read()


def server_request_span(spans, trace_id: str, role: str):
    """SGLang 0.5.23's request span on the `role` server (tokenizer manager: `"<role> Req <rid[:8]>"`), or None."""
    found = [s for s in spans if s.trace_id == trace_id and s.service == f"sglang-{role}"
             and s.name.startswith(f"{role} Req")]
    return found[0] if found else None


def one_trace(receiver, trace_id: str):
    """Wait until the trace holds the router's request span, both legs and both servers' request spans (each
    server exports its own spans as they end, in batches of its own)."""
    def complete(spans):
        mine = [s for s in spans if s.trace_id == trace_id]
        return sum(s.name.endswith(" leg") for s in mine) >= 2 and any(s.name.startswith("POST ") for s in mine) \
            and all(server_request_span(mine, trace_id, role) for role in ("prefill", "decode"))
    receiver.wait_for_spans(complete, timeout=60, message=f"trace {trace_id} from the router and both servers")
    return receiver.trace(trace_id)


@pytest.mark.parametrize("stream", [False, True])
def test_one_trace_holds_the_routers_spans_and_both_servers(traced, receiver, stream):
    router, prefill, decode = traced
    trace_id = CLIENT_TRACE[:-1] + ("1" if stream else "0")
    body = {"text": "Tracing through the router", "stream": stream,
            "sampling_params": {"temperature": 0, "max_new_tokens": 6}}
    status, raw = generate(router.url, body, f"00-{trace_id}-{CLIENT_SPAN}-01")
    assert status == 200, raw[:500]
    spans = one_trace(receiver, trace_id)
    (request,) = [s for s in spans if s.service == "pd-router" and s.name.startswith("POST ")]
    assert request.parent_span_id == CLIENT_SPAN and request.attributes["pd.outcome"] == "success"
    legs = {s.attributes["pd.role"]: s for s in spans
            if s.service == "pd-router" and s.parent_span_id == request.span_id}
    assert sorted(legs) == ["decode", "prefill"]
    assert legs["prefill"].attributes["server.url"] == prefill.url
    assert legs["decode"].attributes["server.url"] == decode.url
    for role in ("prefill", "decode"):
        # SGLang's request span is the leg's child: the server's side of the request hangs under the leg that
        # reached it (its per-thread and per-step spans under that span, exported as they end)
        server = server_request_span(spans, trace_id, role)
        assert server.parent_span_id == legs[role].span_id, (role, server, legs[role].span_id)
        assert legs[role].start_ns <= server.start_ns
        others = [s for s in spans if s.service == f"sglang-{role}" and s is not server]
        assert others, f"only the request span of {role} in the trace"


def test_a_request_without_trace_context_is_a_new_trace_on_every_side(traced, receiver):
    router, _, _ = traced
    status, _ = generate(router.url, {"text": "no context", "rid": "untraced-1",
                                      "sampling_params": {"max_new_tokens": 3}}, None)
    assert status == 200

    def roots(spans):
        return [s for s in spans
                if s.service == "pd-router" and s.name.startswith("POST ") and s.parent_span_id == ""]
    (root,) = roots(receiver.wait_for_spans(lambda spans: len(roots(spans)) >= 1, timeout=30))
    assert root.trace_id not in (CLIENT_TRACE[:-1] + "0", CLIENT_TRACE[:-1] + "1")
    spans = one_trace(receiver, root.trace_id)  # both servers' spans in the router's new trace
    legs = [s for s in spans if s.name.endswith(" leg")]
    assert {leg.attributes["rid"] for leg in legs} == {"untraced-1"}
