from __future__ import annotations

import pytest

from router.app import create_app
from router.config import DISCOVER, RouterConfig, WorkerSpec
from router.keys import REGISTRY

from .fakes import FakeWorker


@pytest.fixture
async def fake_fleet():
    """Start fake workers: `p1, p2, d1 = await fake_fleet(prefill=2, decode=1)`."""
    started: list[FakeWorker] = []

    async def start(prefill: int = 1, decode: int = 1, **kw) -> list[FakeWorker]:
        workers = []
        for i in range(prefill):
            workers.append(await FakeWorker("prefill", bootstrap_port=9000 + i, **kw).start())
        for _ in range(decode):
            workers.append(await FakeWorker("decode", bootstrap_port=None, **kw).start())
        started.extend(workers)
        return workers

    yield start
    for worker in started:
        await worker.stop()


@pytest.fixture
async def make_router(aiohttp_client):
    """Build a router in front of the given workers and return a test client for it."""

    async def build(prefills=(), decodes=(), *, discover: bool = False, **overrides):
        config = RouterConfig(
            prefill=tuple(WorkerSpec(w.url, DISCOVER if discover else w.bootstrap_port) for w in prefills),
            decode=tuple(WorkerSpec(w.url) for w in decodes),
            **overrides,
        ).validated()
        client = await aiohttp_client(create_app(config), server_kwargs={"handler_cancellation": True})
        client.registry = client.app[REGISTRY]
        return client

    return build
