"""Request bodies a client can get wrong: declared sizes over the bound.

Each is a 4xx JSON error on every route that takes a body, never a wait for a body that never comes; and
nothing reaches a worker.
"""

from __future__ import annotations

import asyncio

import orjson
import pytest

from router.core.config import AdmissionConfig
from router.core.keys import ADMISSION

from ..helpers import wait_for

GENERATION = ["/generate", "/v1/completions", "/v1/chat/completions"]
LIMIT = 64 * 1024


@pytest.fixture
async def router(fake_fleet, make_router):
    p, d = await fake_fleet(1, 1)
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
