"""/metrics: request counts and latencies, worker state read at scrape time, flow hooks, the exporter port."""

from __future__ import annotations

import asyncio

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from router.core.config import BreakerConfig, HealthConfig, RetryConfig
from router.obs.metrics import METRICS

from .helpers import free_port, wait_for

NO_PROBES = HealthConfig(enabled=False)


async def scrape(client, path: str = "/metrics") -> dict:
    resp = await client.get(path)
    assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/plain")
    return parse(await resp.text())


def parse(text: str) -> dict:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


async def test_requests_latencies_and_worker_state(sim_workers, make_router):
    p, d = await sim_workers(1, 1)
    client = await make_router([p], [d], health=NO_PROBES)
    for _ in range(3):
        assert (await client.post("/generate", json={"text": "x"})).status == 200
    resp = await client.post("/generate", json={"text": "x", "stream": True})
    await resp.read()
    assert (await client.post("/generate", data=b"{bad", headers={"Content-Type": "application/json"})).status == 400
    assert (await client.get("/no/such/route")).status == 404
    await wait_for(lambda: all(w.inflight == 0 for w in client.registry.workers()))
    m = await scrape(client)
    assert value(m, "pd_router_requests_total", route="/generate", status="200") == 4
    assert value(m, "pd_router_requests_total", route="/generate", status="400") == 1
    assert value(m, "pd_router_requests_total", route="unmatched", status="404") == 1
    assert value(m, "pd_router_request_duration_seconds_count", route="/generate") == 5
    assert value(m, "pd_router_time_to_first_token_seconds_count", route="/generate") == 1
    assert value(m, "pd_router_inter_token_latency_seconds_count", route="/generate") == 1
    for fake, role in ((p, "prefill"), (d, "decode")):
        assert value(m, "pd_router_worker_inflight", worker=fake.url, role=role) == 0
        assert value(m, "pd_router_worker_healthy", worker=fake.url, role=role) == 1
        assert value(m, "pd_router_worker_state", worker=fake.url, role=role, state="active") == 1
        assert value(m, "pd_router_worker_state", worker=fake.url, role=role, state="draining") == 0
        assert value(m, "pd_router_worker_requests_total", worker=fake.url, role=role) == 4
    assert value(m, "pd_router_pool_routable_workers", role="decode") == 1
    assert value(m, "pd_router_queue_length") == 0 and value(m, "pd_router_requests_in_flight") == 0


async def test_inflight_is_visible_while_a_request_runs(sim_workers, make_router):
    p, d = await sim_workers(1, 1)
    d.set_faults(hang_after_tokens=1)  # the decode stalls after the prefill's token
    client = await make_router([p], [d], health=NO_PROBES)
    pending = asyncio.ensure_future(client.post("/generate", json={"text": "x"}))
    await wait_for(lambda: d.in_handler == 1)
    m = await scrape(client)
    assert value(m, "pd_router_worker_inflight", worker=d.url, role="decode") == 1
    assert value(m, "pd_router_requests_in_flight") == 1
    d.set_faults(hang_after_tokens=None)
    assert (await pending).status == 200
    await wait_for(lambda: all(w.inflight == 0 for w in client.registry.workers()))
    m = await scrape(client)
    assert value(m, "pd_router_worker_inflight", worker=d.url, role="decode") == 0


async def test_retries_and_breaker_transitions_are_counted(sim_workers, make_router):
    p, d1, d2 = await sim_workers(1, 2)
    client = await make_router([p], [d1, d2], health=NO_PROBES,
                               breaker=BreakerConfig(failure_threshold=1, timeout_secs=60),
                               retry=RetryConfig(initial_backoff_ms=1))
    d1.set_faults(error_rate=1.0, error_status=503)
    for i in range(10):
        assert (await client.post("/generate", json={"text": f"{i}"})).status == 200
    m = await scrape(client)
    assert value(m, "pd_router_retries_total", route="/generate", reason="failure") == 1
    assert value(m, "pd_router_breaker_transitions_total", worker=d1.url, role="decode", phase="open") == 1
    assert value(m, "pd_router_worker_health_changes_total", worker=d1.url, role="decode", healthy="false") == 1
    assert value(m, "pd_router_worker_breaker_phase", worker=d1.url, role="decode") == 2
    assert value(m, "pd_router_worker_routable", worker=d1.url, role="decode") == 0


async def test_flow_hooks(sim_workers, make_router):
    p, d = await sim_workers(1, 1)
    client = await make_router([p], [d], health=NO_PROBES)
    metrics = client.app[METRICS]
    metrics.observe_conversion("converted", 3.2)
    metrics.observe_conversion("failed", 0.4)
    metrics.observe_weight_update("success", 12.0)
    metrics.observe_abort("weight_update", 7)
    m = await scrape(client)
    assert value(m, "pd_router_conversions_total", outcome="converted") == 1
    assert value(m, "pd_router_conversion_duration_seconds_sum", outcome="converted") == 3.2
    assert value(m, "pd_router_conversion_duration_seconds_count", outcome="failed") == 1
    assert value(m, "pd_router_weight_updates_total", outcome="success") == 1
    assert value(m, "pd_router_weight_update_duration_seconds_bucket", outcome="success", le="30.0") == 1
    assert value(m, "pd_router_aborts_total", reason="weight_update") == 7


async def test_two_routers_in_one_process_keep_their_own_counts(sim_workers, make_router):
    p, d = await sim_workers(1, 1)
    a = await make_router([p], [d], health=NO_PROBES)
    b = await make_router([p], [d], health=NO_PROBES)
    await a.post("/generate", json={"text": "x"})
    await a.post("/generate", json={"text": "x"})
    await b.post("/generate", json={"text": "x"})
    assert value(await scrape(a), "pd_router_requests_total", route="/generate", status="200") == 2
    assert value(await scrape(b), "pd_router_requests_total", route="/generate", status="200") == 1


async def test_metrics_on_the_prometheus_port_and_public_under_api_key(sim_workers, make_router):
    p, d = await sim_workers(1, 1)
    port = free_port()
    client = await make_router([p], [d], health=NO_PROBES, prometheus_port=port, prometheus_host="127.0.0.1",
                               api_key="k")
    assert (await client.post("/generate", json={"text": "x"})).status == 401
    main = await scrape(client)  # public on the main port too, like /health
    assert value(main, "pd_router_requests_total", route="/generate", status="401") == 1
    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://127.0.0.1:{port}/metrics") as resp:
            assert resp.status == 200
            exported = parse(await resp.text())
    assert value(exported, "pd_router_requests_total", route="/generate", status="401") == 1


def test_hot_histogram_buckets_are_cumulative_and_inclusive():
    from router.obs.metrics import HotHistogram

    hist = HotHistogram("h", "help", ("route",), (0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 1.0, 7.0):
        hist.observe(("/g",), v)
    (family,) = [hist.family()]
    samples = {(s.name, s.labels.get("le")): s.value for s in family.samples}
    assert samples[("h_bucket", "0.1")] == 2  # le: a value on the bound counts in that bucket
    assert samples[("h_bucket", "1.0")] == 4
    assert samples[("h_bucket", "+Inf")] == 5
    assert samples[("h_count", None)] == 5 and samples[("h_sum", None)] == 8.65


async def test_weight_updates_and_their_aborts_are_counted(make_router):
    """The weight-update flow reports every finished operation to app[METRICS]."""
    from simulator.fleet import Fleet
    from tests.sim_support import FAST

    async with Fleet(1, 1, **FAST) as fleet:
        client = await make_router(fleet.prefill, fleet.decode, health=NO_PROBES)
        assert (await client.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 2}})
                ).status == 200
        resp = await client.post("/update_weights_from_disk", json={"model_path": "sim/x", "weight_version": "v2"})
        assert resp.status == 200, await resp.text()
        resp = await client.post("/update_weights_from_disk", json={"model_path": "/nonexistent/model"})
        assert resp.status >= 400
        m = await scrape(client)
        assert value(m, "pd_router_weight_updates_total", outcome="succeeded") == 1
        assert value(m, "pd_router_weight_updates_total", outcome="failed") == 1
        assert value(m, "pd_router_weight_update_duration_seconds_count", outcome="succeeded") == 1
        await client.close()
