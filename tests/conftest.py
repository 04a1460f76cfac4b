from __future__ import annotations

import os
import sys

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from router.server.app import create_app
from router.core.config import DISCOVER, RouterConfig, WorkerSpec
from router.core.keys import REGISTRY

from simulator.fleet import Fleet

from .fakes import FakeWorker
from .sim_support import FAST, SimulatedWorker
from .tiers import PROCESS, TierGuard, tier_of

# As router/server/serving.py runs the app (the test server cancels a handler whose client leaves, as it does):
# bodies are decoded by the app. These go to the runner: `aiohttp_client(app, server_kwargs=...)` drops them.
RUNNER_KWARGS = {"auto_decompress": False}
REAL_TIER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "real")


# The real-server tier's switch lives here, not in tests/real/conftest.py: pytest reads options only from the
# conftest files it loads first, and `pytest --real` from the checkout root would not load that one in time.
def pytest_addoption(parser):
    parser.addoption("--real", action="store_true", default=False,
                     help="run the real-SGLang-server tier (tests/real; also env PDR_REAL=1)")


def real_tier_enabled(config) -> bool:
    return bool(config.getoption("--real", default=False)) or os.environ.get("PDR_REAL") == "1"


# What this session's own collection imported, when it collected the whole tests/ tree (tests/test_no_gevent_in_pytest
# reads it instead of collecting the tree again in a child process); None when it collected less.
COLLECTION_IMPORTS: dict | None = None
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


def pytest_collection_finish(session):
    global COLLECTION_IMPORTS
    config = session.config
    args = [os.path.abspath(str(a).split("::")[0]) for a in config.args]
    whole = (args and all(a in (TESTS_DIR, os.path.dirname(TESTS_DIR)) for a in args)
             and not config.getoption("ignore") and not config.getoption("ignore_glob"))
    COLLECTION_IMPORTS = {"patched": [m for m in ("gevent", "locust") if m in sys.modules]} if whole else None


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="real-server tier: pass --real or set PDR_REAL=1")
    enabled = real_tier_enabled(config)
    for item in items:
        if str(item.fspath).startswith(REAL_TIER + os.sep):
            item.add_marker(pytest.mark.real)
            if not enabled:
                item.add_marker(skip)
        item.add_marker(getattr(pytest.mark, tier_of_item(item)))


CHECKOUT = os.path.dirname(TESTS_DIR)


def tier_of_item(item) -> str:
    path = os.path.relpath(str(item.fspath), CHECKOUT)
    return PROCESS if path.startswith("tests/real/") else tier_of(path)


@pytest.fixture(autouse=True)
def tier_guard(request):
    """What the test's tier forbids raises while it runs (tests/tiers.py)."""
    with TierGuard(tier_of_item(request.node), os.path.relpath(str(request.node.fspath), CHECKOUT)):
        yield


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
async def sim_workers():
    """Start simulated workers in this process (fast PD timings, each keeping a record of what it received):
    `p1, p2, d1 = await sim_workers(prefill=2, decode=1)`; other keywords are WorkerConfig fields."""
    fleets: list[Fleet] = []

    async def start(prefill: int = 1, decode: int = 1, **config) -> list[SimulatedWorker]:
        fleet = Fleet(prefill, decode, record_requests=True, **{**FAST, **config})
        fleets.append(fleet)
        await fleet.start()
        return [SimulatedWorker(handle) for handle in fleet.workers]

    yield start
    for fleet in fleets:
        await fleet.stop()


@pytest.fixture
async def make_router(aiohttp_client):
    """Build a router in front of the given workers and return a test client for it."""

    async def build(prefills=(), decodes=(), *, discover: bool = False, **overrides):
        config = RouterConfig(
            prefill=tuple(WorkerSpec(w.url, DISCOVER if discover else w.bootstrap_port) for w in prefills),
            decode=tuple(WorkerSpec(w.url) for w in decodes),
            **overrides,
        ).validated()
        server = TestServer(create_app(config))
        await server.start_server(**RUNNER_KWARGS)
        client = await aiohttp_client(server)
        client.registry = client.app[REGISTRY]
        return client

    return build


@pytest.fixture
async def session():
    """A client session for talking to servers directly (simulated workers, routers)."""
    async with aiohttp.ClientSession() as s:
        yield s


@pytest.fixture
async def fleet():
    """A simulated 1P+1D fleet with fast timings; a test module that needs another fleet defines its own."""
    async with Fleet(1, 1, **FAST) as f:
        yield f
