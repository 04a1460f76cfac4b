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


def decode_rank(moments, running=4, transfer=3, prealloc=2, ready=1, waiting_queue=1):
    return {"dp_rank": 0, "num_running_reqs": running, "num_waiting_reqs": waiting_queue + prealloc + transfer,
            "num_used_tokens": 400, "num_active_tokens": 250, "max_total_num_tokens": 1000, "token_usage": 0.4,
            "total_prefill_busy_us": 0, "decode_moments": moments,
            "disaggregation": {"mode": "decode", "prefill_bootstrap_queue_reqs": 0, "prefill_inflight_queue_reqs": 0,
                               "decode_prealloc_queue_reqs": prealloc, "decode_transfer_queue_reqs": transfer,
                               "decode_retracted_queue_reqs": 0},
            "queues": {"waiting": waiting_queue, "grammar": 0, "paused": 0, "retracted": 0, "prealloc_ready": ready}}


async def test_the_pd_queues_and_rates_between_two_polls(monitor_for):
    """The whole 0.5.23 report is kept (each PD queue apart), and two polls give the mean decode step and batch
    of the steps made between them, and a prefill's share of time in forwards."""
    clock = [100.0]
    decode = LoadServer(v1=[decode_rank([10, 20, 500_000, 40, 1_000_000, 20])])
    prefill = LoadServer(v1=[{**RANK, "num_running_reqs": 0, "total_prefill_busy_us": 1_000_000,
                              "disaggregation": {"mode": "prefill", "prefill_bootstrap_queue_reqs": 1,
                                                 "prefill_inflight_queue_reqs": 2},
                              "queues": {"waiting": 1, "prealloc_ready": 0}}])
    registry, monitor = await monitor_for(prefill, decode)
    monitor.clock = lambda: clock[0]
    await monitor.poll_once()
    p, d = registry.workers()
    assert d.server_load.decode_step_s is None and p.server_load.prefill_busy is None  # one poll: no rate
    report = d.server_load.report
    assert (report.transfer, report.prealloc, report.prealloc_ready, report.waiting_queue) == (3, 2, 1, 1)
    assert report.own_kv_usage == 0.25 and report.mode == "decode" and report.pd_queued == 5
    assert (p.server_load.report.bootstrap, p.server_load.report.inflight) == (1, 2)
    clock[0] = 102.0
    decode.v1 = [decode_rank([30, 100, 2_500_000, 360, 11_000_000, 100])]  # 20 steps of batch 4, 100 ms each
    prefill.v1[0]["total_prefill_busy_us"] = 2_500_000  # 1.5 s of the 2 s in forwards
    await monitor.poll_once()
    assert d.server_load.decode_step_s == pytest.approx(0.1) and d.server_load.decode_batch == pytest.approx(4)
    assert p.server_load.prefill_busy == pytest.approx(0.75)
    clock[0] = 103.0
    decode.v1 = [decode_rank([5, 5, 50_000, 5, 50_000, 5])]  # counters went back: restarted, no rate
    await monitor.poll_once()
    assert d.server_load.decode_step_s is None


def test_rates_need_the_same_role_on_both_polls():
    from policies import ServerLoad
    from policies.load_report import parse_loads
    from router.control.load_monitor import rates

    before = ServerLoad(1, 0, taken_at=0.0, report=parse_loads([decode_rank([10, 20, 1e6, 40, 2e6, 20])]))
    as_prefill = {**decode_rank(None), "disaggregation": {"mode": "prefill"}, "total_prefill_busy_us": 10}
    assert rates(before, parse_loads([as_prefill]), 1.0) == {}
    assert rates(None, before.report, 1.0) == {}


def test_the_last_published_decode_step_stands_until_the_row_is_republished():
    """A 0.5.23 decode running batches republishes its row every 15 steps: polls in between see the same
    moments. The rate of the steps last published stands while the row shows a running batch (at least the
    row's age over the publish interval: fewer steps were made since), and goes when the server reports an
    idle row (or its counters move again)."""
    from policies import ServerLoad
    from policies.load_report import parse_loads
    from router.control.load_monitor import rates

    first = parse_loads([decode_rank([10, 40, 1e6, 160, 4e6, 40], running=4)])
    second = parse_loads([decode_rank([25, 100, 4e6, 400, 16e6, 100], running=4)])  # 15 steps of 0.2 s, batch 4
    got = rates(ServerLoad(4, 0, taken_at=0.0, report=first), second, 1.0)
    got = {k: got[k] for k in ("decode_step_s", "decode_batch")}
    assert got == {"decode_step_s": pytest.approx(0.2), "decode_batch": pytest.approx(4.0)}
    held = ServerLoad(4, 0, taken_at=1.0, report=second, **got)
    again = rates(held, second, 2.0)
    assert (again["decode_step_s"], again["decode_batch"]) == (0.2, 4.0)  # the same row: its rate stands
    idle = parse_loads([decode_rank([25, 100, 4e6, 400, 16e6, 100], running=0)])
    assert "decode_step_s" not in rates(held, idle, 2.0)  # nothing running: no latency to report
    unknown = ServerLoad(4, 0, taken_at=1.0, report=second)
    assert "decode_step_s" not in rates(unknown, second, 2.0)  # nothing to carry
    # the same row 6 s old, still running: fewer than 15 steps in 6 s, so a step now takes at least 0.4 s
    stale = parse_loads({"timestamp": "2026-01-01T00:00:06+00:00", "loads": [
        {**decode_rank([25, 100, 4e6, 400, 16e6, 100], running=4), "timestamp": 1767225600.0}]})
    assert stale.age_s == pytest.approx(6.0)
    assert rates(held, stale, 7.0)["decode_step_s"] == pytest.approx(6.0 / 15)
    # a server seen publishing every 30 steps: the floor is age / 30, never under 15 steps
    third = parse_loads([decode_rank([55, 220, 10e6, 880, 40e6, 220], running=4)])
    every30 = rates(held, third, 3.0)
    assert every30["decode_publish_steps"] == 30 and every30["decode_step_s"] == pytest.approx(0.2)
    held30 = ServerLoad(4, 0, taken_at=3.0, report=third, **every30)
    stale30 = parse_loads({"timestamp": "2026-01-01T00:00:09+00:00", "loads": [
        {**decode_rank([55, 220, 10e6, 880, 40e6, 220], running=4), "timestamp": 1767225600.0}]})
    assert rates(held30, stale30, 9.0)["decode_step_s"] == pytest.approx(9.0 / 30)
    first_seen = rates(ServerLoad(4, 0, taken_at=0.0, report=parse_loads([decode_rank(None)])), third, 1.0)
    assert first_seen["decode_publish_steps"] == 15  # steps since the server started say nothing of it


def test_the_step_line_is_fitted_on_the_moments_and_only_when_they_can_tell():
    from router.control.load_monitor import step_fit

    def moments(batches, fixed=0.04, per_request=0.008):
        times = [(fixed + per_request * b) * 1e6 for b in batches]
        return (len(batches), sum(batches), sum(times), sum(b * b for b in batches),
                sum(b * t for b, t in zip(batches, times)), sum(batches))

    fit = step_fit(moments([1, 5, 10, 20, 40] * 20))
    assert fit == {"decode_step_fixed_s": pytest.approx(0.04), "decode_step_per_request_s": pytest.approx(0.008)}
    assert step_fit(moments([8] * 200)) == {}  # one batch size: what one more request costs is unknown
    assert step_fit(moments([1, 20] * 10)) == {}  # too few steps
    assert step_fit(moments([1, 20] * 50, per_request=-0.001)) == {}  # steps shorter with more: no line
    assert step_fit(None) == {}


def test_a_report_without_breakdown_leaves_the_queues_unknown():
    from policies.load_report import parse_loads

    report = parse_loads({"loads": [RANK]})
    assert (report.running, report.waiting, report.transfer, report.waiting_queue, report.mode) == (3, 2, None, None, None)
    assert report.pd_queued == 0 and report.own_kv_usage == 0.1
    assert parse_loads({"loads": []}) is None and parse_loads({"detail": "Not Found"}) is None
    assert parse_loads([{"dp_rank": 0, "num_running_reqs": "x", "num_waiting_reqs": True}]).running == 0


def test_a_rows_age_is_the_answers_timestamp_less_the_oldest_rows_on_the_servers_clock():
    from policies.load_report import parse_loads

    answered = "2026-12-01T13:40:05.500000+00:00"  # 0.5.23: the answer's time, ISO-8601, UTC
    published = 1796132400.0 + 5.5 - 4.0  # epoch seconds: 4 s before the answer (a decode 15 steps back)
    report = parse_loads({"timestamp": answered, "loads": [{**RANK, "timestamp": published},
                                                           {**RANK, "timestamp": published + 3.0}]})
    assert report.age_s == pytest.approx(4.0)
    assert parse_loads({"timestamp": answered, "loads": [{**RANK, "timestamp": published + 60}]}).age_s == 0.0
    for bad in ({"loads": [{**RANK, "timestamp": published}]},  # no answer time
                {"timestamp": "yesterday", "loads": [{**RANK, "timestamp": published}]},
                {"timestamp": answered, "loads": [{**RANK, "timestamp": "x"}]},
                {"timestamp": answered, "loads": [RANK]}):
        assert parse_loads(bad).age_s is None
