"""A rollout burst never loses a sample to the router's own limits (issue 35).

- A leg the router cannot open for want of its own descriptors (EMFILE) blames no worker: no breaker verdict,
  no failure counted, the request waits and goes again on the same pair, and the metric counts it by kind.
- The leg queue: beyond --max-connections-per-worker a request waits, holding no worker; past its deadline it
  gets 503 with Retry-After, and nothing reached a server.
- A real router process started with a low soft open-files limit serves a burst several times larger than that
  limit: every sample answered in full, no worker failure, no breaker opened (with the hard limit low too, it
  bounds itself; with a higher hard limit, it raises its soft limit first).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import resource

import aiohttp
import orjson
import pytest

from router.control.health import HEALTH
from router.core.config import ConnectionTimeouts, HealthConfig
from router.core.keys import LOCAL_RESOURCES
from router.core.local_resources import DescriptorBudget
from router.core.registry import Role
from router.dataplane.proxy import PROXY
from simulator.fleet import Fleet

from .helpers import wait_for
from .router_process import RouterProcess, generate
from .test_metrics import parse, value

NO_PROBES = HealthConfig(enabled=False)
NOT_REUSED = 1e-6  # --upstream-pool-idle-timeout-secs: every leg opens a fresh connection


@contextlib.contextmanager
def descriptors_exhausted():
    """This process can open no descriptor (every socket() or open() fails with EMFILE) until the block ends:
    the soft limit is lowered to what is open now, and what is left below it is taken."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    taken: list[int] = []
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 8, hard))
    try:
        while True:
            try:
                taken.append(os.open(os.devnull, os.O_RDONLY))
            except OSError as exc:
                assert exc.errno == errno.EMFILE
                break
        yield
    finally:
        for fd in taken:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


async def test_a_leg_the_router_cannot_open_blames_no_worker_and_goes_again_on_the_same_pair(sim_workers,
                                                                                          make_router):
    p, d = await sim_workers(1, 1)
    client = await make_router([p], [d], health=NO_PROBES,
                               connections=ConnectionTimeouts(upstream_pool_idle_timeout_secs=NOT_REUSED))
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 3}}
    first = await client.post("/generate", json=body)  # the client's keep-alive connection is open from here
    assert first.status == 200
    await first.read()
    errors = client.app[LOCAL_RESOURCES]
    verdicts: list = []
    client.app[PROXY].dispatcher.leg_observers += (lambda worker, verdict: verdicts.append((worker.role, verdict)),)

    with descriptors_exhausted():
        pending = asyncio.ensure_future(client.post("/generate", json=body))
        await wait_for(lambda: errors.counts.get("EMFILE", 0) >= 2, timeout=10,
                       message="the router's legs failing for want of descriptors")
        assert not pending.done()  # waiting for a descriptor, not answered with an error
    resp = await pending  # descriptors are free again: the request went again on its pair
    assert resp.status == 200, await resp.text()
    assert (await resp.json())["meta_info"]["finish_reason"]["type"] == "length"

    assert (Role.PREFILL, False) not in verdicts and (Role.DECODE, False) not in verdicts
    for worker in client.registry.workers():
        assert worker.failures_total == 0 and worker.breaker == "closed" and worker.routable
        assert worker.inflight == 0
    assert len(p.bodies()) == 2 and len(d.bodies()) == 2  # the burst's request reached each server once
    samples = parse(await (await client.get("/metrics")).text())
    assert value(samples, "pd_router_local_resource_errors_total", kind="EMFILE") == errors.counts["EMFILE"]
    assert value(samples, "pd_router_worker_failures_total", worker=d.url, role="decode") == 0


async def test_a_health_probe_the_router_cannot_open_gives_no_verdict(sim_workers, make_router):
    p, d = await sim_workers(1, 1)
    client = await make_router([p], [d], health=HealthConfig(interval_secs=3600, failure_threshold=1),
                               connections=ConnectionTimeouts(upstream_pool_idle_timeout_secs=NOT_REUSED))
    errors, monitor = client.app[LOCAL_RESOURCES], client.app[HEALTH]
    decode = client.registry.routable(Role.DECODE)[0]
    record = monitor.record(decode)
    await wait_for(lambda: record.probe_task is not None and record.probe_task.done() and record.probes == 1,
                   message="the first probe (its connection closed after it: not reused)")
    with descriptors_exhausted():
        failed = errors.counts["EMFILE"]
        await monitor._probe(record)  # the probe a round would make now, its connection refused here
        assert errors.counts["EMFILE"] == failed + 1
        # one failed probe would take it out (failure_threshold 1): this one says nothing of the server
        assert decode.healthy and decode.routable, decode.health_reason
        assert record.probe.failures == 0 and record.probes == 1
    await monitor._probe(record)
    assert record.probes == 2 and decode.healthy


async def test_past_its_deadline_a_request_waiting_for_room_gets_503_with_retry_after(fake_fleet, make_router):
    p, d = await fake_fleet(1, 1)
    p.behaviour.hang = True  # the prefill leg lingers after decode answered: its one place stays taken
    client = await make_router([p], [d], health=NO_PROBES, max_connections_per_worker=1, request_timeout_secs=1.0)
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 3}}
    first = await client.post("/generate", json=body)
    assert first.status == 200
    await first.read()
    prefill = client.registry.routable(Role.PREFILL)[0]
    assert prefill.inflight == 1

    refused = await client.post("/generate", json=body)
    assert refused.status == 503
    assert refused.headers["Retry-After"] == "1"
    assert "no room for the request's legs" in (await refused.json())["error"]["message"]
    assert len(d.bodies()) == 1  # the refused request reached no server

    p.release.set()  # the lingering leg ends: its place frees
    p.behaviour.hang = False
    await wait_for(lambda: prefill.inflight == 0, message="the lingering prefill leg to end")
    again = await client.post("/generate", json=body)
    assert again.status == 200
    await again.read()
    room = client.app[PROXY].leg_room
    assert room.waiting == 0 and room.waited_total == 1
    assert all(w.inflight == 0 for w in client.registry.workers())


def test_the_descriptor_budget_keeps_a_request_in_flight_within_the_limit():
    for limit in (256, 1024, 20000, 1 << 20):
        budget = DescriptorBudget.of(limit, max_legs=8192)
        assert budget.reserve + budget.clients + budget.legs <= limit
        assert budget.concurrency * 2 <= budget.legs <= 8192 and budget.concurrency >= 1
        assert budget.clients >= budget.concurrency  # every request on the servers has its client's connection
    assert DescriptorBudget.of(1024, 8192).concurrency < DescriptorBudget.of(20000, 8192).concurrency
    assert DescriptorBudget.of(20000, 64).legs == 64  # --max-connections bounds the legs; clients get the rest
    assert DescriptorBudget.of(20000, 64).clients > DescriptorBudget.of(20000, 8192).clients


SIM = dict(health_check_s=0.0, decode_step_s=0.002, bootstrap_retries=3, bootstrap_retry_interval_s=0.02,
           deferred_release_s=0.0)
SOFT = 256
BURST = 768  # three times the soft limit: one descriptor per client connection, one per leg


@pytest.mark.parametrize("hard", ["machine", "same"], ids=["soft-256-raised", "hard-256-bounded"])
async def test_a_burst_under_a_low_open_files_limit_loses_nothing_and_opens_no_breaker(tmp_path, hard):
    machine_hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    limit = (SOFT, machine_hard if hard == "machine" else SOFT)
    async with Fleet(2, 2, **SIM) as fleet, \
            RouterProcess(fleet, "--log-level", "info", "--health-check-interval-secs", "0.5",
                          log_path=tmp_path / "router.log", nofile=limit) as router:
        connector = aiohttp.TCPConnector(limit=0, force_close=True)  # one connection per sample, all at once
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as burst:
            seen = await asyncio.gather(*(generate(burst, router.url, f"burst-{i}", 8, stream=i % 4 == 0)
                                          for i in range(BURST)))
        lost = [s for s in seen if s["status"] != 200 or s.get("finish") != "length" or s.get("tokens") != 8
                or (s.get("done") is False)]
        assert not lost, f"{len(lost)} of {BURST} samples lost, e.g. {lost[:3]}\n{router.log()[-3000:]}"

        async with router.session.get(router.url + "/metrics") as resp:
            samples = parse(await resp.text())
        async with router.session.get(router.url + "/workers") as resp:
            workers = orjson.loads(await resp.read())["workers"]
        assert len(workers) == 4 and all(w["is_healthy"] for w in workers)
        for w in workers:
            labels = {"worker": w["url"], "role": w["worker_type"]}
            assert value(samples, "pd_router_worker_failures_total", **labels) == 0, router.log()[-3000:]
            assert value(samples, "pd_router_worker_breaker_phase", **labels) == 0
        assert "breaker open" not in router.log() and "no routable" not in router.log()
        assert value(samples, "pd_router_open_files_limit") == limit[1]  # the soft limit, raised to the hard one
        if hard == "same":  # it could not raise it: it bounded itself, and the queue took the rest
            assert value(samples, "pd_router_leg_queue_waited_total") > 0
        for kind in ("EMFILE", "ENFILE", "EADDRNOTAVAIL", "ENOBUFS"):  # within its budget: it never ran out
            assert value(samples, "pd_router_local_resource_errors_total", kind=kind) == 0, router.log()[-3000:]
