"""Request bodies a client can get wrong: declared sizes over the bound, content codings, nesting too deep.

Each is a 4xx JSON error on every route that takes a body (the generation routes, the RL relay, the weight
updates, every admin route), never a 500, a reset connection or a wait for a body that never comes; and
nothing reaches a worker.
"""

from __future__ import annotations

import asyncio
import gzip
import zlib

import orjson
import pytest

from router.api.access import Access, routes_by_access
from router.core.config import AdmissionConfig
from router.dataplane.admission import ADMISSION

from ..helpers import wait_for

GENERATION = ["/generate", "/v1/completions", "/v1/chat/completions"]
BODIES = {
    "/generate": {"text": "hello", "sampling_params": {"max_new_tokens": 2}},
    "/v1/completions": {"prompt": "hello", "max_tokens": 2},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2},
}
LIMIT = 64 * 1024


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


@pytest.fixture
async def router(sim_workers, make_router):
    p, d = await sim_workers(1, 1)
    client = await make_router([p], [d], admission=AdmissionConfig(max_payload_size=LIMIT,
                                                                   max_admin_payload_size=LIMIT))
    client.workers = (p, d)
    yield client
    await wait_for(lambda: all(w.inflight == 0 for w in client.registry.workers()), message="in-flight back to 0")
    assert client.app[ADMISSION].active == 0


async def raw_exchange(client, head: bytes, body: bytes = b"", timeout: float = 5.0) -> tuple[int, dict, bytes]:
    """Send bytes on a fresh connection; the status, headers and body of the answer (within `timeout`)."""
    reader, writer = await asyncio.open_connection(client.host, client.port)
    try:
        writer.write(head + body)
        await writer.drain()
        status_line = await asyncio.wait_for(reader.readline(), timeout)
        headers = {}
        while (line := await asyncio.wait_for(reader.readline(), timeout)) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            headers[name.strip().lower()] = value.strip()
        length = int(headers.get("content-length", 0))
        answer = await asyncio.wait_for(reader.readexactly(length), timeout) if length else b""
        return int(status_line.split()[1]), headers, answer
    finally:
        writer.close()


def assert_json_error(status: int, headers: dict, body: bytes, statuses) -> dict:
    assert status in statuses, (status, body)
    assert headers.get("content-type", "").startswith("application/json"), (headers, body)
    error = orjson.loads(body)["error"]
    assert isinstance(error["message"], str) and error["message"], error
    return error


async def post(client, path: str, data: bytes, **headers) -> tuple[int, str, dict]:
    async with client.post(path, data=data, headers={"Content-Type": "application/json", **headers}) as resp:
        raw = await resp.read()
        return resp.status, resp.content_type, orjson.loads(raw) if raw else {}


async def test_a_declared_size_over_the_bound_is_413_before_any_byte_is_read(router):
    """The client declares more than --max-payload-size and sends nothing: the answer comes at once."""
    for path in GENERATION:
        head = (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {10**12}\r\n\r\n").encode()
        status, headers, body = await raw_exchange(router, head, b"{")
        error = assert_json_error(status, headers, body, (413,))
        assert "--max-payload-size" in error["message"]
        assert headers.get("connection") == "close"  # the rest of the body is not waited for
        assert sum(w.calls[path] for w in router.workers) == 0


async def test_a_body_over_the_bound_without_a_declared_size_is_413(router):
    chunk = b'{"text": "' + b"x" * (LIMIT + 10) + b'"}'

    async def chunks():
        yield chunk

    async with router.post("/generate", data=chunks()) as resp:  # chunked: no Content-Length
        assert resp.status == 413
        assert (await resp.json())["error"]["code"] == 413


@pytest.mark.parametrize("coding, encode", [
    ("gzip", gzip.compress),
    ("x-gzip", gzip.compress),
    ("deflate", zlib.compress),
    ("deflate", lambda b: zlib.compress(b)[2:-4]),  # raw deflate, as some clients send it
    ("identity", lambda b: b),
    ("gzip, identity", gzip.compress),
], ids=["gzip", "x-gzip", "deflate-zlib", "deflate-raw", "identity", "gzip+identity"])
async def test_accepted_codings_are_decoded_and_served(router, coding, encode):
    for path in GENERATION:
        status, _, answer = await post(router, path, encode(orjson.dumps(BODIES[path])),
                                       **{"Content-Encoding": coding})
        assert status == 200, (path, answer)
        prefill, decode = router.workers
        sent = decode.bodies(path)[-1]
        assert {k: sent[k] for k in BODIES[path]} == BODIES[path]  # the worker got the decoded body


BAD_CODINGS = [
    ("gzip", b'{"text": "not gzip at all"}', 400),
    ("deflate", b"\x78\x9cnot deflate", 400),
    ("br", b"\x1b\x03junk that is not brotli", 400),
    ("zstd", b"\x28\xb5\x2f\xfdjunk", 400),
    ("compress", b"x", 400),
    ("gzip, br", b"x", 400),
    ("gzip", gzip.compress(b'{"text": "cut off here"}')[:-6], 400),  # truncated
    ("gzip", gzip.compress(b" " * (LIMIT * 4) + b"{}"), 413),  # decodes to more than the bound
]


@pytest.mark.parametrize("coding, data, expected", BAD_CODINGS,
                         ids=["gzip-junk", "deflate-junk", "br", "zstd", "compress", "stacked", "truncated", "bomb"])
async def test_a_body_its_coding_does_not_describe_is_a_json_error(router, coding, data, expected):
    for path in [*GENERATION, "/abort_request", "/update_weights_from_disk", "/workers"]:
        status, content_type, answer = await post(router, path, data, **{"Content-Encoding": coding})
        assert status == expected, (path, answer)
        assert content_type == "application/json"
        assert answer["error"]["message"]
        if expected == 400 and coding not in ("gzip", "deflate"):
            assert "identity, gzip, deflate" in answer["error"]["message"]  # says what is accepted
    assert sum(sum(w.calls.values()) - w.calls["/health"] - w.calls["/v1/loads"] for w in router.workers) \
        == _startup_calls(router)


def _startup_calls(router) -> int:
    """Calls the workers had before the test's request: reading their live state at start-up."""
    return sum(w.calls[p] for w in router.workers for p in ("/model_info", "/server_info", "/ready",
                                                             "/get_model_info", "/get_server_info"))


async def test_an_admin_body_in_gzip_is_decoded(router):
    status, _, answer = await post(router, "/abort_request", gzip.compress(b'{"rid": "nobody"}'),
                                   **{"Content-Encoding": "gzip"})
    assert status == 200, answer
    assert all(w.aborts[-1] == {"rid": "nobody"} for w in router.workers)


async def test_json_nested_deeper_than_the_router_can_forward_is_400(router):
    for path in GENERATION:
        data = orjson.dumps(BODIES[path])[:-1] + b', "extra": ' + nested(300) + b"}"
        status, content_type, answer = await post(router, path, data)
        assert status == 400, answer
        assert content_type == "application/json" and "nested deeper" in answer["error"]["message"]
        assert sum(w.calls[path] for w in router.workers) == 0
        # nesting the router can forward is forwarded
        data = orjson.dumps(BODIES[path])[:-1] + b', "extra": ' + nested(200) + b"}"
        status, _, answer = await post(router, path, data)
        assert status == 200, answer


async def test_json_nested_too_deep_is_400_on_every_route_that_takes_a_body(router):
    """The RL relay, the weight updates, the worker API: every admin route, whatever it does with its body."""
    routes = [(m, p) for m, p in routes_by_access(router.app)[Access.ADMIN] if m in ("POST", "PUT", "PATCH")]
    assert ("POST", "/update_weights_from_disk") in routes and any(p.startswith("/v1/rl/") for _, p in routes)
    deep = b'{"model_path": "/m", "url": "http://h:1", "a": ' + nested(300) + b"}"
    for method, path in routes:
        concrete = path.replace("{worker_id}", "w1").replace("{worker_id:.+}", "w1").replace(
            "{path:.+}", "update_weights_from_disk").replace("{op_id}", "x").replace("{conversion_id}", "x")
        async with router.request(method, concrete, data=deep, headers={"Content-Type": "application/json"}) as resp:
            body = await resp.read()
            assert resp.status == 400, (method, concrete, resp.status, body)
            assert "nested deeper" in orjson.loads(body)["error"]["message"], (method, concrete, body)
