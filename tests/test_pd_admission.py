"""SMG's PD admission in front of a simulated 1P+1D fleet: --prefill-max-inflight-requests-per-worker with its
FIFO queue (--prefill-queue-size: 429 when full; --prefill-queue-timeout-secs: 429 after), and
--pd-admission-wait-secs (a decode at its running window: 503 after the wait); a client that leaves while
queued leaves nothing behind."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from aiohttp.test_utils import TestClient, TestServer

from router.core.config import ConfigError
from router.core.keys import REGISTRY
from router.dataplane.admission import ADMISSION
from router.dataplane.proxy import PROXY
from router.server.app import create_app
from router.server.cli import config_from_args
from simulator.fleet import Fleet

from .conftest import RUNNER_KWARGS
from .helpers import wait_for
from .sim_support import FAST

BODY = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}


@contextlib.asynccontextmanager
async def _router(fleet: Fleet, *flags: str):
    config = config_from_args(["--prefill", fleet.prefill[0].url, str(fleet.prefill[0].bootstrap_port),
                               "--decode", fleet.decode[0].url, *flags], env={})
    server = TestServer(create_app(config))
    await server.start_server(**RUNNER_KWARGS)  # the test server cancels a handler whose client leaves
    client = TestClient(server)
    await client.start_server()
    try:
        yield client
    finally:
        await client.close()


async def _post(router) -> tuple[int, dict]:
    resp = await router.post("/generate", json=BODY)
    return resp.status, await resp.json()


async def test_prefill_admission_queues_refuses_times_out_and_leaks_nothing(fleet):
    async with _router(fleet, "--prefill-max-inflight-requests-per-worker", "1", "--prefill-queue-size", "1",
                       "--prefill-queue-timeout-secs", "0.5") as router:
        queue = router.app[PROXY].pd_admission.prefill
        prefill = router.app[REGISTRY].find(fleet.prefill[0].url)
        await fleet.set_faults(fleet.prefill[0], hang=True)  # the first request holds the prefill
        first = asyncio.ensure_future(_post(router))
        await wait_for(lambda: prefill.inflight == 1, message="the first request on the prefill")
        second = asyncio.ensure_future(_post(router))
        await wait_for(lambda: queue.waiting == 1, message="the second request queued")
        status, body = await _post(router)  # the queue (1) is full
        assert status == 429 and body["error"]["type"] == "pd_prefill_queue_full"
        status, body = await second  # waited 0.5 s for the prefill
        assert status == 429 and body["error"]["type"] == "pd_prefill_queue_timeout"
        assert prefill.inflight == 1 and queue.waiting == 0

        leaving = asyncio.ensure_future(_post(router))  # a client that leaves while queued
        await wait_for(lambda: queue.waiting == 1, message="the leaving request queued")
        leaving.cancel()
        await wait_for(lambda: queue.waiting == 0 and router.app[ADMISSION].active == 1,
                       message="the queue and the in-flight count without it")

        await fleet.set_faults(fleet.prefill[0], hang=False)
        waiting = asyncio.ensure_future(_post(router))
        await wait_for(lambda: queue.waiting == 1, message="a request queued behind the hung one")
        first.cancel()  # its client leaves: the prefill leg is aborted, its room goes to the queue's head
        status, body = await waiting
        assert status == 200 and body["meta_info"]["completion_tokens"] == 2
        await wait_for(lambda: prefill.inflight == 0 and router.app[ADMISSION].active == 0,
                       message="nothing left in flight")
        for task in (first, leaving):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        metrics = await (await router.get("/metrics")).text()
        assert 'pd_router_pd_admission_rejected_total{reason="pd_prefill_queue_full"} 1.0' in metrics


async def test_a_decode_at_its_running_window_sheds_after_the_admission_wait():
    async with Fleet(1, 1, decode_overrides={"max_running_requests": 1}, **FAST) as fleet:
        async with _router(fleet, "--pd-admission-wait-secs", "0.3", "--load-poll-interval-secs", "0.05") as router:
            decode = router.app[REGISTRY].find(fleet.decode[0].url)
            await wait_for(lambda: decode.server_load is not None and decode.server_load.report.running_window == 1,
                           message="the decode's running window read")
            await fleet.set_faults(fleet.decode[0], hang=True)
            held = asyncio.ensure_future(_post(router))
            await wait_for(lambda: decode.inflight == 1, message="a request on the decode")
            status, body = await _post(router)
            assert status == 503 and body["error"]["type"] == "worker_overload_protection_shed"
            await fleet.set_faults(fleet.decode[0], hang=False)
            later = asyncio.ensure_future(_post(router))  # waits for room: the held request's client leaves
            held.cancel()
            status, body = await later
            assert status == 200 and body["meta_info"]["completion_tokens"] == 2
            with contextlib.suppress(asyncio.CancelledError):
                await held


def test_the_queue_flags_need_the_per_worker_bound():
    with pytest.raises(ConfigError, match="need --prefill-max-inflight-requests-per-worker"):
        config_from_args(["--prefill-queue-size", "10"], env={})
    with pytest.raises(ConfigError, match="--pd-admission-wait-secs must not be negative"):
        config_from_args(["--pd-admission-wait-secs", "-1"], env={})
    off = config_from_args(["--prefill-max-inflight-requests-per-worker", "-1"], env={})  # SMG's default
    assert not off.pd_admission.prefill_bounded


async def test_queued_requests_end_at_once_when_the_prefill_is_killed(tmp_path):
    async with Fleet(1, 1, processes=True, **FAST) as fleet:
        async with _router(fleet, "--prefill-max-inflight-requests-per-worker", "1", "--prefill-queue-timeout-secs",
                           "60", "--health-check-interval-secs", "0.05", "--health-failure-threshold", "1",
                           "--retry-max-retries", "1") as router:
            queue = router.app[PROXY].pd_admission.prefill
            prefill = router.app[REGISTRY].find(fleet.prefill[0].url)
            await fleet.set_faults(fleet.prefill[0], hang=True)
            held = asyncio.ensure_future(_post(router))
            await wait_for(lambda: prefill.inflight == 1, message="a request on the prefill")
            queued = [asyncio.ensure_future(_post(router)) for _ in range(3)]
            await wait_for(lambda: queue.waiting == 3, message="three requests queued")
            fleet.kill(fleet.prefill[0])  # SIGKILL: its request fails, the queue must not wait out its 60 s
            answers = await asyncio.wait_for(asyncio.gather(held, *queued), 20)
            assert all(status in (502, 503) and "error" in body for status, body in answers), answers
            assert queue.waiting == 0 and router.app[ADMISSION].active == 0 and prefill.inflight == 0
