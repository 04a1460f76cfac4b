"""A removed worker leaves nothing behind: its metric series, its connections in the legs' pool, its discovery
watch and its policy state go with it."""

from __future__ import annotations

from urllib.parse import quote

from router.core.config import BreakerConfig, HealthConfig, RetryConfig
from router.control.live_state import LIVE_STATE
from router.dataplane.proxy import PROXY

from .helpers import free_port, wait_for
from .test_metrics import scrape

NO_PROBES = HealthConfig(enabled=False)


def series_of(samples: dict, url: str) -> list:
    return [key for key in samples if ("worker", url) in key[1]]


async def test_removing_a_worker_drops_its_metric_series_and_its_pooled_connections(sim_workers, make_router):
    p, d1, d2 = await sim_workers(1, 2)
    client = await make_router([p], [d1, d2], health=NO_PROBES, decode_policy="round_robin",
                               breaker=BreakerConfig(failure_threshold=1, timeout_secs=60),
                               retry=RetryConfig(initial_backoff_ms=1))
    d1.set_faults(error_rate=1.0, error_status=503)  # opens its breaker: its transition and health-change counters get series
    for i in range(4):
        assert (await client.post("/generate", json={"text": f"{i}"})).status == 200
    d1.set_faults(error_rate=0.0)
    legs = client.app[PROXY].dispatcher.upstream
    assert legs.knows(d1.url) and legs.knows(d2.url)
    before = await scrape(client)
    assert {name for name, _ in series_of(before, d1.url)} >= {
        "pd_router_breaker_transitions_total", "pd_router_worker_health_changes_total", "pd_router_worker_inflight"}

    resp = await client.delete(f"/workers/{quote(d1.url, safe='')}")
    assert resp.status == 200, await resp.text()

    after = await scrape(client)
    assert series_of(after, d1.url) == []
    assert series_of(after, d2.url), "the other worker keeps its series"
    assert not legs.knows(d1.url) and legs.idle_connections(d1.url) == 0
    assert legs.knows(d2.url)
    await wait_for(lambda: not any(c.endpoint.forgotten for c in legs._connections),
                   message="its idle connections closed")
    assert (await client.post("/generate", json={"text": "after"})).status == 200
    assert not legs.knows(d1.url), "nothing is sent to a removed worker"


async def test_removing_a_pending_worker_cancels_its_discovery_watch(sim_workers, make_router):
    p, d = await sim_workers(1, 1)
    client = await make_router([p], [d], health=NO_PROBES)
    unreachable = f"http://127.0.0.1:{free_port()}"
    added = await client.post("/workers", json={"url": unreachable, "worker_type": "prefill"})
    assert added.status == 200, await added.text()
    discovery = client.app[LIVE_STATE]
    worker = client.registry.get(unreachable)
    assert discovery.watching == [worker.id]
    task = discovery._tasks[worker.id]
    assert (await client.delete(f"/workers/{worker.id}")).status == 200
    assert discovery.watching == []
    await wait_for(lambda: task.done(), message="the watch ended at once, not at its next retry")
    assert task.cancelled()
