"""The load monitor against real loopback servers: /v1/loads, the /get_load fallback, failures, staleness."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web

from router.core.config import LoadMonitorConfig
from router.control.load_monitor import LoadMonitor
from router.core.registry import Registry, Role, WorkerState
from router.control.upstream import Upstream

from .helpers import free_port, wait_for


class LoadServer:
    """Answers /v1/loads (0.5.23 shape) or only /get_load (0.4.x shape), with a gate to hold an answer."""

    def __init__(self, *, v1: list[dict] | None = None, legacy: list[dict] | None = None, status: int = 200):
        self.v1, self.legacy, self.status = v1, legacy, status
        self.gate: asyncio.Event | None = None
        self.asked = 0
        self.url = ""

    async def _v1(self, request):
        self.asked += 1
        if self.gate is not None:
            await self.gate.wait()
        if self.v1 is None:
            raise web.HTTPNotFound()
        if self.status != 200:
            return web.Response(status=self.status, text="boom")
        return web.json_response({"timestamp": "t", "version": "0.5.23", "loads": self.v1})

    async def _legacy(self, request):
        if self.legacy is None:
            raise web.HTTPNotFound()
        return web.json_response(self.legacy)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/loads", self._v1)
        app.router.add_get("/get_load", self._legacy)
        return app


@pytest.fixture
async def monitor_for(aiohttp_server):
    sessions = []

    async def build(*servers: LoadServer, timeout: float = 2.0):
        registry = Registry()
        for i, server in enumerate(servers):
            httpd = await aiohttp_server(server.app())
            server.url = str(httpd.make_url("")).rstrip("/")
            registry.add(server.url, Role.PREFILL if i % 2 == 0 else Role.DECODE, 9000 + i)
        session = aiohttp.ClientSession()
        sessions.append(session)
        return registry, LoadMonitor(registry, Upstream(session), LoadMonitorConfig(timeout_secs=timeout))

    yield build
    for session in sessions:
        await session.close()


RANK = {"dp_rank": 0, "num_running_reqs": 3, "num_waiting_reqs": 2, "num_used_tokens": 100,
        "max_total_num_tokens": 1000, "token_usage": 0.1}


async def test_v1_loads_are_summed_over_dp_ranks_and_stored_on_the_worker(monitor_for):
    server = LoadServer(v1=[RANK, {**RANK, "dp_rank": 1, "num_running_reqs": 1, "token_usage": 0.4}])
    registry, monitor = await monitor_for(server)
    (worker,) = registry.workers()
    worker.inflight = 2
    await monitor.poll_once()
    load = worker.server_load
    assert (load.running, load.waiting, load.token_usage, load.inflight_at) == (4, 4, 0.4, 2)
    assert monitor.state()["rounds"] == 1 and monitor.state()["failures"] == 0


async def test_old_servers_fall_back_to_get_load(monitor_for):
    server = LoadServer(legacy=[{"load": 50, "num_reqs": 2, "num_waiting_reqs": 1}])
    registry, monitor = await monitor_for(server)
    await monitor.poll_once()
    load = registry.workers()[0].server_load
    assert (load.running, load.waiting, load.token_usage) == (2, 1, None)


async def test_a_failing_poll_clears_the_snapshot(monitor_for):
    server = LoadServer(v1=[RANK])
    registry, monitor = await monitor_for(server)
    await monitor.poll_once()
    worker = registry.workers()[0]
    assert worker.server_load is not None
    server.v1 = None  # neither endpoint answers now
    await monitor.poll_once()
    assert worker.server_load is None and monitor.failures == 1


async def test_an_unreachable_or_hanging_server_is_bounded_by_the_timeout(monitor_for):
    hanging = LoadServer(v1=[RANK])
    hanging.gate = asyncio.Event()
    registry, monitor = await monitor_for(hanging, timeout=0.3)
    registry.add(f"http://127.0.0.1:{free_port()}", Role.DECODE, None)  # nobody listens there
    await asyncio.wait_for(monitor.poll_once(), 5)
    assert [w.server_load for w in registry.workers()] == [None, None]
    assert monitor.failures == 2
    hanging.gate.set()


async def test_an_answer_about_a_changed_worker_is_dropped(monitor_for):
    server = LoadServer(v1=[RANK])
    server.gate = asyncio.Event()
    registry, monitor = await monitor_for(server)
    worker = registry.workers()[0]
    poll = asyncio.ensure_future(monitor.poll_once())
    await wait_for(lambda: server.asked == 1)
    registry.set_state(worker, WorkerState.CONVERTING, "switching role")  # revision moves meanwhile
    server.gate.set()
    await poll
    assert worker.server_load is None


async def test_pending_and_failed_workers_are_not_polled(monitor_for):
    server = LoadServer(v1=[RANK])
    registry, monitor = await monitor_for(server)
    registry.set_state(registry.workers()[0], WorkerState.FAILED, "left unsafe")
    await monitor.poll_once()
    assert server.asked == 0


def test_config_problems():
    assert len(LoadMonitorConfig(interval_secs=0, timeout_secs=-1).problems()) == 2
