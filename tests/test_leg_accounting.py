"""Router-side load counts: a streaming request's prefill leg stops counting against its prefill worker when
the prefill answer ends, not when decode's stream does."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from router.core.registry import Role

from .helpers import wait_for


class GatedDecode:
    """A decode stand-in: streams its first event at once, the rest when the test opens the gate."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.url = ""
        self.bootstrap_port = None

    async def generate(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"text": " a", "meta_info": {"id": "x"}}\n\n')
        await self.gate.wait()
        await response.write(b'data: {"text": " a b", "meta_info": {"id": "x"}}\n\ndata: [DONE]\n\n')
        await response.write_eof()
        return response

    async def ok(self, request: web.Request) -> web.Response:
        return web.json_response({})


@pytest.fixture
async def gated_decode(aiohttp_server):
    decode = GatedDecode()
    app = web.Application()
    app.router.add_post("/generate", decode.generate)
    app.router.add_get("/health", decode.ok)
    server = await aiohttp_server(app)
    decode.url = str(server.make_url("")).rstrip("/")
    yield decode
    decode.gate.set()


async def test_prefill_leg_is_released_while_decode_still_streams(fake_fleet, make_router, gated_decode):
    (prefill_fake,) = await fake_fleet(1, 0)
    prefill_fake.behaviour.delay_s = 0.3  # prefill's answer ends after decode's first event
    client = await make_router([prefill_fake], [gated_decode])
    prefill = client.registry.workers(Role.PREFILL)[0]
    decode = client.registry.workers(Role.DECODE)[0]
    resp = await client.post("/generate", json={"text": "hold the stream", "stream": True})
    assert resp.status == 200
    assert (await resp.content.readline()).startswith(b"data: ")
    await wait_for(lambda: prefill.inflight == 0, timeout=5, message="prefill leg released")
    assert decode.inflight == 1  # the stream is still open
    gated_decode.gate.set()
    rest = await asyncio.wait_for(resp.read(), 10)
    assert rest.rstrip().endswith(b"data: [DONE]")
    await wait_for(lambda: decode.inflight == 0)
