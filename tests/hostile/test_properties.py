"""Properties over what clients can send, fuzzed (hypothesis over request and admin bodies, schemathesis over
the router's own OpenAPI document), against a router in front of a simulated 2P+2D fleet:

- no client input produces a 5xx from the router itself (a 5xx may only be a server's answer relayed, or the
  fleet's state), and every error is `{"error": {"message", ...}}` JSON;
- under all of it: no in-flight count left behind, every worker back in its pool, routable, breaker closed.

Seeded and bounded for the default tier (PDR_FUZZ_EXAMPLES examples per property, 25 unless set; a longer
run: PDR_FUZZ_EXAMPLES=2000).
"""

from __future__ import annotations

import gzip
import os
import re
import time

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.api.access import Access, routes_by_access
from router.core.config import AdmissionConfig

from .live import LiveRouter, assert_not_the_routers_fault, json_error_of

EXAMPLES = int(os.environ.get("PDR_FUZZ_EXAMPLES", "25"))
FUZZ = settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                       HealthCheck.filter_too_much, HealthCheck.data_too_large])
GENERATION = ["/generate", "/v1/completions", "/v1/chat/completions"]
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def live():
    # --max-n 8, above the default (1): the fuzzed n of 2 to 4 reach what --max-n opens for servers that serve
    # n > 1 (a bootstrap room per sequence), which the simulator does; the default's bound: `live_default`
    with LiveRouter(2, 2, request_timeout_secs=20,
                    admission=AdmissionConfig(queue_timeout_secs=1.0, max_n=8, max_batch_size=16)) as router:
        yield router


@pytest.fixture(scope="module")
def live_default():
    """The router as it starts by default, n > 1 refused before anything is built for it (its own message)."""
    with LiveRouter(1, 1, request_timeout_secs=20,
                    admission=AdmissionConfig(queue_timeout_secs=1.0, max_batch_size=16)) as router:
        yield router


scalars = (st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats(allow_nan=True)
           | st.text(max_size=12))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=10)
small = st.integers(-3, 4)  # token budgets and counts the fleet can serve at once
token_ids = st.lists(st.integers(-2, 40), max_size=6)
prompts = st.one_of(st.text(max_size=12), st.lists(st.text(max_size=8), max_size=3), token_ids,
                    st.lists(token_ids, max_size=3), values)
sampling = st.one_of(values, st.fixed_dictionaries({}, optional={
    "max_new_tokens": small | values, "n": small | values, "temperature": values, "beam_width": small}),
    st.lists(st.fixed_dictionaries({}, optional={"n": small, "max_new_tokens": small}), max_size=3))
flags = st.one_of(st.booleans(), st.none(), st.sampled_from(["true", "false", "no", "on", "maybe", 2]), values)
rids = st.one_of(st.none(), st.text(max_size=8), st.lists(st.text(max_size=4), max_size=3), values)
generation_bodies = st.fixed_dictionaries({}, optional={
    "text": prompts, "input_ids": prompts, "prompt": prompts, "sampling_params": sampling, "n": small | values,
    "max_tokens": small | values, "max_completion_tokens": small, "rid": rids, "stream": flags,
    "return_logprob": flags,
    "messages": st.one_of(values, st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "x", 3]),
                                                                   "content": values}), max_size=2)),
    "bootstrap_room": values, "bootstrap_host": values}).map(
    lambda body: {**body, **({"max_tokens": 2} if "max_tokens" not in body else {})})


def _call(live, method, path, body: bytes, headers=None):
    status, content_type, raw = live.request(method, path, body, {**JSON, **(headers or {})})
    assert_not_the_routers_fault(status, content_type, raw)
    return status, content_type, raw


@pytest.mark.parametrize("router", ["live", "live_default"])
def test_no_generation_body_makes_the_router_fail(router, request):
    live = request.getfixturevalue(router)

    @FUZZ
    @given(path=st.sampled_from(GENERATION), body=generation_bodies)
    def check(path, body):
        status, content_type, raw = _call(live, "POST", path, orjson.dumps(body, option=orjson.OPT_NON_STR_KEYS))
        if status == 200 and content_type.startswith("text/event-stream"):
            assert raw.rstrip().endswith(b"data: [DONE]"), raw[-200:]

    check()
    live.assert_settled()


def test_no_bytes_on_the_wire_make_the_router_fail(live):
    """Not JSON, JSON of another kind, compressed or not, on generation and admin routes alike."""
    @FUZZ
    @given(path=st.sampled_from([*GENERATION, "/workers", "/abort_request", "/update_weights_from_disk",
                                 "/v1/rl/engine/pause_generation", "/admin/workers/w1/convert"]),
           data=st.binary(max_size=64) | values.map(lambda v: orjson.dumps(v, option=orjson.OPT_NON_STR_KEYS)),
           coding=st.sampled_from([None, "gzip", "deflate", "br", "zstd", "identity", "gzip, gzip", "\x00"]),
           compress=st.booleans())
    def check(path, data, coding, compress):
        headers = {"Content-Encoding": coding} if coding is not None else {}
        if compress and coding == "gzip":
            data = gzip.compress(data)
        status, content_type, raw = _call(live, "POST", path, data, headers)
        if coding not in (None, "identity", "gzip", "deflate"):
            assert status == 400, raw[:200]

    check()
    live.assert_settled()


def _admin_post_routes(live) -> list[str]:
    routes = sorted({p for m, p in routes_by_access(live.app)[Access.ADMIN] if m == "POST"})
    return [re.sub(r"\{[^}]+\}", "w1", p) for p in routes]


def test_no_admin_body_makes_the_router_fail(live):
    """Bodies that pass an admin model run the operation (a pause, a release of memory): after them the fleet is
    brought back, and every worker must be back in its pool."""
    routes = _admin_post_routes(live)

    @FUZZ
    @given(path=st.sampled_from(routes), body=st.dictionaries(st.sampled_from(
        ["rid", "abort_all", "mode", "url", "worker_type", "bootstrap_port", "model_path", "tags", "new_role",
         "timeout_s", "weight_version", "registry_url", "names", "x"]), values, max_size=3) | values)
    def check(path, body):
        _call(live, "POST", path, orjson.dumps(body, option=orjson.OPT_NON_STR_KEYS))

    try:
        check()
    finally:  # whatever the fuzz left the fleet in (paused, memory released), an operator brings it back
        for path in ("/resume_memory_occupation", "/continue_generation"):
            live.request("POST", path, b"{}", JSON)
    live.assert_settled()


def _short(case):
    """A generated generation case asks for a few tokens (the fleet's time is not what is tested)."""
    if isinstance(case.body, dict):
        for name in ("max_tokens", "max_completion_tokens"):
            if isinstance(case.body.get(name), int) and not isinstance(case.body[name], bool):
                case.body[name] = min(case.body[name], 4)
        if case.operation.path in GENERATION and "max_tokens" not in case.body:
            case.body["max_tokens"] = 2
    return case


def test_the_openapi_document_fuzzed_finds_no_failure_of_the_router(live):
    import schemathesis

    status, content_type, raw = live.request("GET", "/openapi.json")
    assert status == 200
    schema = schemathesis.openapi.from_dict(orjson.loads(raw))
    base = f"http://127.0.0.1:{live.port}"
    tried, took = 0, {}
    try:
        operations = [result.ok() for result in schema.get_all_operations()]
        # generation first; what holds the fleet (a pause, released memory) last, so it delays nothing else
        holding = ("/pause_generation", "/release_memory_occupation", "/v1/rl/engine/{path}")
        operations.sort(key=lambda op: (op.path not in GENERATION, op.path in holding, op.path, op.method))
        for operation in operations:

            @settings(FUZZ, max_examples=max(2, EXAMPLES // 5))
            @given(case=operation.as_strategy().map(_short))
            def check(case):
                response = case.call(base_url=base, timeout=30)
                content_type = response.headers.get("content-type") or [""]  # schemathesis: lists of values
                assert_not_the_routers_fault(response.status_code, content_type[0], response.content)

            started = time.monotonic()
            check()
            tried += 1
            took[operation.label] = time.monotonic() - started
    finally:
        for path in ("/resume_memory_occupation", "/continue_generation"):
            live.request("POST", path, b"{}", JSON)
    assert tried == len(orjson.loads(raw)["paths"]) or tried > 40
    print("slowest operations:", sorted(took.items(), key=lambda kv: -kv[1])[:8])
    live.assert_settled()


def test_the_document_covers_every_route_and_names_what_they_need(live):
    status, content_type, raw = live.request("GET", "/openapi.json")
    document = orjson.loads(raw)
    documented = {(m.upper(), p) for p, ops in document["paths"].items() for m in ops}
    registered = {(m, re.sub(r"\{([^}:]+)(?::[^}]*)?\}", r"{\1}", p))
                  for access in Access for m, p in routes_by_access(live.app)[access]}
    assert registered == documented
    generate = document["paths"]["/generate"]["post"]
    assert generate["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("GenerateRequest")
    pause = document["components"]["schemas"]["PauseGeneration"]
    assert pause.get("additionalProperties") is False  # the admin models' own strictness
    schemas = document["components"]["schemas"]
    for body in ("GenerateRequest", "CompletionRequest", "ChatCompletionRequest"):  # the rank fields it judges
        assert {"routed_dp_rank", "data_parallel_rank", "disagg_prefill_dp_rank"} <= set(schemas[body]["properties"])
    assert {"api_key", "labels", "priority", "cost"} <= set(schemas["WorkerRegistration"]["properties"])
    assert document["paths"]["/add_worker"]["post"]["parameters"][0]["name"] == "url"
    assert json_error_of(*live.request("GET", "/no/such/route"))["code"] == 404


def test_slow_and_many_connection_clients_leave_the_others_served(live):
    """Hundreds of idle connections, clients sending their headers or body a byte at a time and never finishing:
    the other clients are served meanwhile, and once those leave nothing of them is left counted."""
    import socket

    address = ("127.0.0.1", live.port)
    opened = [socket.create_connection(address) for _ in range(300)]  # connected, saying nothing
    try:
        for i in range(30):
            sock = socket.create_connection(address)
            opened.append(sock)
            if i % 2:  # a body promised and never sent whole
                sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 200\r\n\r\n{\"text\": \"sl")
            else:  # headers never ended
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: a")
        body = orjson.dumps({"text": "hello", "sampling_params": {"max_new_tokens": 2}})
        for _ in range(20):
            status, content_type, raw = live.request("POST", "/generate", body, JSON, timeout=10)
            assert status == 200, raw[:200]
        for sock in opened[300:]:  # a trickle keeps going: the router still serves the rest
            sock.sendall(b"o")
        status, _, raw = live.request("GET", "/health", timeout=10)
        assert status == 200, raw
    finally:
        for sock in opened:
            sock.close()
    live.assert_settled()
