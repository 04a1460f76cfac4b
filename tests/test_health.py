"""The health monitor against simulated workers with health faults: probes, flapping, hangs, the breaker, rejoining."""

from __future__ import annotations

from router.core.config import BreakerConfig, HealthConfig, RetryConfig
from router.control.health import HEALTH
from router.core.registry import Role, WorkerState

from .helpers import wait_for

FAST_PROBES = HealthConfig(interval_secs=0.05, timeout_secs=0.5, failure_threshold=2, success_threshold=2)
NO_PROBES = HealthConfig(enabled=False)
FAST_RETRY = RetryConfig(initial_backoff_ms=1, max_backoff_ms=5)


def inflight(client) -> list[int]:
    return [w.inflight for w in client.registry.workers()]


def worker_of(client, fake):
    return client.registry.get(fake.url)


def health_events(client) -> list[tuple[str, bool]]:
    events: list[tuple[str, bool]] = []
    client.registry.subscribe(lambda event, worker, details: events.append((worker.url, details["healthy"]))
                              if event == "health" and "healthy" in details else None)
    return events


async def test_failing_probes_take_a_worker_out_and_passing_ones_bring_it_back(sim_workers, make_router):
    p, d1, d2 = await sim_workers(1, 2)
    client = await make_router([p], [d1, d2], health=FAST_PROBES)
    w1 = worker_of(client, d1)
    await wait_for(lambda: d1.health_calls >= 2, message="probes running")
    d1.set_faults(unhealthy=True)
    await wait_for(lambda: not w1.healthy, message="d1 out")
    assert w1 not in client.registry.routable(Role.DECODE)
    assert "failed health probe" in w1.health_reason
    served_before = len(d1.bodies())
    for i in range(6):
        assert (await client.post("/generate", json={"text": f"q{i}"})).status == 200
    assert len(d1.bodies()) == served_before, "no request routed to an unhealthy worker"
    d1.set_faults(unhealthy=False)
    await wait_for(lambda: w1.healthy, message="d1 rejoined by itself")
    assert w1 in client.registry.routable(Role.DECODE)
    listing = await (await client.get("/workers")).json()
    entry = next(w for w in listing["workers"] if w["url"] == d1.url)
    assert entry["is_healthy"] is True and entry["breaker"] == "closed"
    await wait_for(lambda: inflight(client) == [0, 0, 0])


async def test_flapping_health_does_not_flap_routing(sim_workers, make_router):
    """Probes alternating pass/fail never reach the failure threshold (2): the worker stays routable."""
    p, d = await sim_workers(1, 1)
    client = await make_router([p], [d], health=FAST_PROBES)
    worker = worker_of(client, d)
    events = health_events(client)
    await wait_for(lambda: client.app[HEALTH].record(worker).probe.proven, message="first probe passed")
    d.set_faults(health_script=[503, 200] * 8)
    await wait_for(lambda: not d.health_script, message="the flapping script was probed")
    assert worker.healthy
    assert events == []
    # Two failures in a row do take it out; then two passes in a row bring it back.
    d.set_faults(unhealthy=True)
    await wait_for(lambda: not worker.healthy)
    d.set_faults(unhealthy=False)
    await wait_for(lambda: worker.healthy)
    assert events == [(d.url, False), (d.url, True)]


class ConcurrentProbes:
    """Wraps the monitor's upstream client: counts probes of one URL in flight at once."""

    def __init__(self, monitor, url: str) -> None:
        self.real, self.url = monitor.upstream, url
        self.now = self.max = self.started = 0
        monitor.upstream = self

    async def health(self, url, *args, **kwargs):
        if url != self.url:
            return await self.real.health(url, *args, **kwargs)
        self.now += 1
        self.started += 1
        self.max = max(self.max, self.now)
        try:
            return await self.real.health(url, *args, **kwargs)
        finally:
            self.now -= 1

    def __getattr__(self, name):
        return getattr(self.real, name)


async def test_hanging_health_endpoint_times_out_with_one_probe_in_flight(sim_workers, make_router):
    p, d1, d2 = await sim_workers(1, 2)
    health = HealthConfig(interval_secs=0.02, timeout_secs=0.3, failure_threshold=2, success_threshold=1)
    client = await make_router([p], [d1, d2], health=health)
    w1 = worker_of(client, d1)
    monitor = client.app[HEALTH]
    await wait_for(lambda: monitor.record(w1).probe.proven)
    probes = ConcurrentProbes(monitor, d1.url)
    d1.set_faults(health_hang=True)
    rounds = monitor.rounds
    await wait_for(lambda: not w1.healthy, timeout=5, message="hung worker marked unhealthy")
    await wait_for(lambda: monitor.rounds >= rounds + 30, message="many probe rounds during the hang")
    # The interval (20 ms) is far shorter than the timeout (300 ms), yet probes never pile up. (Counted on
    # the router: the server may still be holding a probe the router already gave up on.)
    assert probes.max == 1 and probes.started >= 2
    resp = await client.post("/generate", json={"text": "x"})
    assert resp.status == 200 and d2.bodies()
    d1.set_faults(health_hang=False)
    await wait_for(lambda: w1.healthy, message="rejoined after the hang")
    await wait_for(lambda: inflight(client) == [0, 0, 0])


async def test_stale_probe_result_is_discarded(sim_workers, make_router):
    p, d = await sim_workers(1, 1)
    client = await make_router([p], [d], health=HealthConfig(interval_secs=0.02, timeout_secs=5,
                                                             failure_threshold=1, success_threshold=1))
    worker = worker_of(client, d)
    monitor = client.app[HEALTH]
    record = monitor.record(worker)
    await wait_for(lambda: record.probe.proven)
    d.set_faults(health_hang=True, unhealthy=True)
    await wait_for(lambda: d.health_in_flight == 1, message="a probe is in flight")
    d.set_faults(unhealthy=False)  # later probes pass; the held one answers 503
    # The worker changes while the probe is out: its answer describes the old worker.
    client.registry.set_state(worker, WorkerState.DRAINING, "test")
    client.registry.set_state(worker, WorkerState.ACTIVE, "test")
    stale = record.stale_probes
    d.set_faults(health_hang=False)
    await wait_for(lambda: record.stale_probes == stale + 1, message="stale result discarded")
    assert worker.healthy, "the stale failure did not count"


async def test_breaker_opens_on_request_failures_then_half_opens_and_closes(sim_workers, make_router):
    p, d1, d2 = await sim_workers(1, 2)
    breaker = BreakerConfig(failure_threshold=2, success_threshold=2, timeout_secs=0.3)
    client = await make_router([p], [d1, d2], health=NO_PROBES, breaker=breaker, retry=FAST_RETRY)
    w1, w2 = worker_of(client, d1), worker_of(client, d2)
    d1.set_faults(error_rate=1.0, error_status=503)
    # d1 answers 503: every request still succeeds (retried on d2) until d1's breaker opens.
    for i in range(12):
        resp = await client.post("/generate", json={"text": f"q{i}"})
        assert resp.status == 200
        if w1.breaker == "open":
            break
    assert w1.breaker == "open" and not w1.healthy and "breaker open" in w1.health_reason
    assert client.registry.routable(Role.DECODE) == (w2,)
    served = len(d1.bodies())
    for i in range(4):
        assert (await client.post("/generate", json={"text": f"r{i}"})).status == 200
    assert len(d1.bodies()) == served, "an open breaker keeps the worker out"
    d1.set_faults(error_rate=0.0)
    await wait_for(lambda: w1.breaker == "half_open" and w1.healthy, message="half-open after the timeout")
    for i in range(40):
        assert (await client.post("/generate", json={"text": f"s{i}"})).status == 200
        if w1.breaker == "closed":
            break
    assert w1.breaker == "closed" and w1.healthy
    await wait_for(lambda: inflight(client) == [0, 0, 0])


async def test_half_open_failure_reopens(sim_workers, make_router):
    p, d = await sim_workers(1, 1)
    breaker = BreakerConfig(failure_threshold=1, success_threshold=1, timeout_secs=0.2)
    client = await make_router([p], [d], health=NO_PROBES, breaker=breaker,
                               retry=RetryConfig(enabled=False))
    worker = worker_of(client, d)
    d.set_faults(error_rate=1.0, error_status=500)
    assert (await client.post("/generate", json={"text": "a"})).status == 500
    assert worker.breaker == "open"
    resp = await client.post("/generate", json={"text": "b"})
    assert resp.status == 503 and "no routable decode" in (await resp.json())["error"]["message"]
    await wait_for(lambda: worker.breaker == "half_open")
    assert (await client.post("/generate", json={"text": "c"})).status == 500
    assert worker.breaker == "open" and client.app[HEALTH].record(worker).breaker_opened == 2
    await wait_for(lambda: inflight(client) == [0, 0])


async def test_client_errors_do_not_count_against_the_worker(sim_workers, make_router):
    p, d = await sim_workers(1, 1)
    breaker = BreakerConfig(failure_threshold=1, success_threshold=1, timeout_secs=60)
    client = await make_router([p], [d], health=NO_PROBES, breaker=breaker)
    p.set_faults(error_rate=1.0, error_status=400)
    for _ in range(3):
        assert (await client.post("/generate", json={"text": "x"})).status == 400
    assert all(w.breaker == "closed" and w.healthy for w in client.registry.workers())
    await wait_for(lambda: inflight(client) == [0, 0])


async def test_returning_worker_with_other_weights_is_held_out(sim_workers, make_router):
    p, d1, d2 = await sim_workers(1, 2, weight_version="v2")
    client = await make_router([p], [d1, d2], health=FAST_PROBES)
    w1 = worker_of(client, d1)
    await wait_for(lambda: all(w.weight_version == "v2" for w in client.registry.workers()))
    d1.set_faults(unhealthy=True)
    await wait_for(lambda: not w1.healthy)
    d1.weight_version = "v1"  # restarted with old weights while the fleet moved on
    d1.set_faults(unhealthy=False)
    await wait_for(lambda: client.app[HEALTH].record(w1).refusal is not None, message="refused")
    assert not w1.healthy and "weight version 'v1'" in w1.health_reason
    d1.weight_version = "v2"
    await wait_for(lambda: w1.healthy, message="rejoins once its weights match")
    assert w1.weight_version == "v2"


async def test_removed_worker_stops_being_probed(sim_workers, make_router):
    p, d1, d2 = await sim_workers(1, 2)
    client = await make_router([p], [d1, d2], health=FAST_PROBES)
    w1 = worker_of(client, d1)
    monitor = client.app[HEALTH]
    d1.set_faults(health_hang=True)
    await wait_for(lambda: d1.health_in_flight == 1)
    record = monitor.record(w1)
    assert (await client.delete(f"/workers/{w1.id}")).status == 200
    assert monitor.record(w1) is None
    await wait_for(lambda: record.probe_task.done(), message="its probe was cancelled")
    calls, others = d1.health_calls, d2.health_calls
    await wait_for(lambda: d2.health_calls >= others + 3, message="three more probe rounds")
    assert d1.health_calls == calls


async def test_admin_health_state(sim_workers, make_router):
    p, d = await sim_workers(1, 1)
    client = await make_router([p], [d], health=FAST_PROBES)
    await wait_for(lambda: all(r["probes_total"] for r in client.app[HEALTH].state()["workers"]))
    body = await (await client.get("/admin/health")).json()
    assert body["probes"]["interval_secs"] == 0.05
    assert {w["url"] for w in body["workers"]} == {p.url, d.url}
    assert all(w["breaker"]["phase"] == "closed" for w in body["workers"])


async def test_no_probing_while_the_fleet_is_held(sim_workers, make_router):
    """During a weight update servers are paused and their /health would fail: probes wait for the hold."""
    from router.dataplane.admission import ADMISSION

    p, d = await sim_workers(1, 1)
    client = await make_router([p], [d], health=HealthConfig(interval_secs=0.02, timeout_secs=0.5,
                                                             failure_threshold=1, success_threshold=1))
    worker = worker_of(client, d)
    record = client.app[HEALTH].record(worker)
    await wait_for(lambda: record.probe.proven)
    admission = client.app[ADMISSION]
    d.set_faults(health_hang=True)
    await wait_for(lambda: d.health_in_flight == 1, message="a probe is in flight when the hold starts")
    admission.close_gate("weight update")
    d.set_faults(unhealthy=True)
    d.set_faults(health_hang=False)  # the held probe answers what it was given on arrival
    stale = record.stale_probes
    await wait_for(lambda: record.stale_probes == stale + 1, message="its answer is not counted")
    monitor = client.app[HEALTH]
    calls, other, rounds = d.health_calls, p.health_calls, monitor.rounds
    await wait_for(lambda: monitor.rounds >= rounds + 3, message="three probe rounds while held")
    assert (d.health_calls, p.health_calls) == (calls, other), "nobody probed during the hold"
    assert worker.healthy
    admission.open_gate("weight update")
    await wait_for(lambda: not worker.healthy, message="probing resumed (d answers 503 now)")


async def test_router_health_reports_pools_and_admission(sim_workers, make_router):
    p, d = await sim_workers(1, 1)
    client = await make_router([p], [d], health=FAST_PROBES)
    body = await (await client.get("/health")).json()
    assert body["status"] == "ok" and body["pools"]["decode"] == {"routable": 1, "total": 1, "unhealthy": 0,
                                                                   "breaker_open": 0}
    assert body["admission"] == {"in_flight": 0, "queued": 0, "held": False}
    d.set_faults(unhealthy=True)
    await wait_for(lambda: not worker_of(client, d).healthy)
    resp = await client.get("/health")
    body = await resp.json()
    assert resp.status == 503 and body["pools"]["decode"]["unhealthy"] == 1 and "decode" in body["message"]
