"""Prometheus metrics: one `CollectorRegistry` per app (tests and replicas in one process never collide).

What is counted where, to keep the request path cheap (prometheus-client's own Counter and Histogram take a
lock per increment and scan buckets in Python: several microseconds per request):
- the request middleware counts every request by route and status, and the proxy's request observer adds
  end-to-end latency, TTFT, mean inter-token latency and retries, into plain ints and lists (`HotCounter`,
  `HotHistogram`: a dict lookup, a `bisect`, two additions) that a collector turns into Prometheus families
  at scrape time; everything runs on the event loop's thread, so no lock is needed;
- everything that is state (in-flight per worker, worker state, health, breaker, queue length) is read
  from the registry and admission at scrape time by a collector: nothing on the hot path;
- registry events count health and breaker transitions;
- flows report through `observe_conversion(outcome, seconds)`, `observe_weight_update(outcome, seconds)`
  and `observe_abort(reason, count)` on `app[METRICS]`.
"""

from __future__ import annotations

import contextlib
import logging
from bisect import bisect_left

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from router.core.config import RouterConfig
from router.core.errors import ListenError
from router.core.local_resources import DescriptorBudget, LocalResourceErrors
from router.core.registry import Registry, Role, Worker, WorkerState, rank_rows
from router.dataplane.admission import Admission
from router.dataplane.leg_room import LegRoom

logger = logging.getLogger(__name__)

PREFIX = "pd_router"
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0, 1800.0)
FLOW_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
BREAKER_PHASES = {"closed": 0, "half_open": 1, "open": 2}
UNMATCHED = "unmatched"  # the route label of requests no route matched (404/405)


class HotCounter:
    """A labelled counter for the request path: plain ints, exported at scrape time."""

    __slots__ = ("name", "help", "labels", "values")

    def __init__(self, name: str, help_text: str, labels: tuple[str, ...]) -> None:
        self.name, self.help, self.labels = name, help_text, labels
        self.values: dict[tuple, float] = {}

    def inc(self, key: tuple, amount: float = 1) -> None:
        values = self.values
        values[key] = values.get(key, 0) + amount

    def family(self) -> CounterMetricFamily:
        family = CounterMetricFamily(self.name, self.help, labels=self.labels)
        for key, value in self.values.items():
            family.add_metric([str(k) for k in key], value)
        return family


class HotHistogram:
    """A labelled histogram for the request path: per label set, bucket counts, sum and count."""

    __slots__ = ("name", "help", "labels", "bounds", "series")

    def __init__(self, name: str, help_text: str, labels: tuple[str, ...], bounds: tuple[float, ...]) -> None:
        self.name, self.help, self.labels, self.bounds = name, help_text, labels, bounds
        self.series: dict[tuple, list] = {}  # key -> [bucket counts (last: +Inf), sum]

    def observe(self, key: tuple, value: float) -> None:
        series = self.series.get(key)
        if series is None:
            series = self.series[key] = [[0] * (len(self.bounds) + 1), 0.0]
        series[0][bisect_left(self.bounds, value)] += 1
        series[1] += value

    def family(self) -> HistogramMetricFamily:
        family = HistogramMetricFamily(self.name, self.help, labels=self.labels)
        for key, (counts, total) in self.series.items():
            cumulative, buckets = 0, []
            for bound, count in zip((*self.bounds, float("inf")), counts):
                cumulative += count
                buckets.append((floatToGoString(bound), cumulative))
            family.add_metric([str(k) for k in key], buckets, total)
        return family


class _HotCollector:
    def __init__(self, metrics: list) -> None:
        self.metrics = metrics

    def describe(self):
        return []

    def collect(self):
        for metric in self.metrics:
            yield metric.family()


class RouterMetrics:
    def __init__(self, registry: Registry, admission: Admission, duration_buckets: tuple[float, ...] = ()) -> None:
        self.registry = registry
        self.admission = admission
        self.prometheus = CollectorRegistry(auto_describe=True)
        reg = self.prometheus
        self.requests = HotCounter(f"{PREFIX}_requests", "HTTP requests by route and status",
                                   ("route", "status"))
        self.e2e = HotHistogram(f"{PREFIX}_request_duration_seconds",
                                "end-to-end latency of generation requests (until the last byte)", ("route",),
                                duration_buckets or E2E_BUCKETS)  # --prometheus-duration-buckets
        self.ttft = HotHistogram(f"{PREFIX}_time_to_first_token_seconds",
                                 "time until decode's first event reached the client (streaming)", ("route",),
                                 TTFT_BUCKETS)
        self.itl = HotHistogram(f"{PREFIX}_inter_token_latency_seconds",
                                "mean gap between streamed events, one sample per request", ("route",),
                                ITL_BUCKETS)
        self.retries = HotCounter(f"{PREFIX}_retries", "attempts re-sent to another pair", ("route", "reason"))
        self.outcomes = HotCounter(f"{PREFIX}_request_outcomes", "generation requests that did not succeed, "
                                   "by outcome", ("route", "outcome"))
        self.aborts = HotCounter(f"{PREFIX}_aborts", "requests aborted on the servers, by reason", ("reason",))
        reg.register(_HotCollector([self.requests, self.e2e, self.ttft, self.itl, self.retries, self.outcomes,
                                    self.aborts]))
        self.conversions = Counter(f"{PREFIX}_conversions", "role conversions by outcome", ["outcome"],
                                   registry=reg)
        self.conversion_seconds = Histogram(f"{PREFIX}_conversion_duration_seconds",
                                            "role conversion duration by outcome", ["outcome"],
                                            buckets=FLOW_BUCKETS, registry=reg)
        self.weight_updates = Counter(f"{PREFIX}_weight_updates", "fleet weight updates by outcome",
                                      ["outcome"], registry=reg)
        self.weight_update_seconds = Histogram(f"{PREFIX}_weight_update_duration_seconds",
                                               "fleet weight update duration by outcome", ["outcome"],
                                               buckets=FLOW_BUCKETS, registry=reg)
        self.health_changes = Counter(f"{PREFIX}_worker_health_changes", "workers turning healthy/unhealthy",
                                      ["worker", "role", "healthy"], registry=reg)
        self.breaker_changes = Counter(f"{PREFIX}_breaker_transitions", "circuit breaker phase changes",
                                       ["worker", "role", "phase"], registry=reg)
        self.worker_events = Counter(f"{PREFIX}_worker_events", "registry events (added, removed, moved, state)",
                                     ["event"], registry=reg)
        reg.register(_StateCollector(registry, admission))
        self._last_health: dict[str, tuple[bool, str]] = {}  # per worker id, to count transitions
        registry.subscribe(self._on_registry_event)

    # ---- hot path ------------------------------------------------------------------------------------------
    def count_request(self, route: str, status: int) -> None:
        self.requests.inc((route, status))

    def observe_request(self, record) -> None:
        """A `Proxy.request_observers` entry: one `RequestRecord` per generation request."""
        key = (record.route,)
        self.e2e.observe(key, record.e2e_s)
        if record.ttft_s is not None:
            self.ttft.observe(key, record.ttft_s)
        if record.itl_s is not None:
            self.itl.observe(key, record.itl_s)
        if record.outcome != "success":
            self.outcomes.inc((record.route, record.outcome))
            if record.outcome == "client_disconnect":
                self.aborts.inc(("client_disconnect",))
            elif record.status == 504:
                self.aborts.inc(("timeout",))
        if record.attempts > 1:
            retries = record.attempts - 1 - record.retries_aborted
            if retries > 0:
                self.retries.inc((record.route, "failure"), retries)
            if record.retries_aborted:
                self.retries.inc((record.route, "router_abort"), record.retries_aborted)

    # ---- flows (called by router/flows/*) ---------------------------------------------------------------
    def observe_conversion(self, outcome: str, seconds: float) -> None:
        """One finished role conversion: outcome e.g. converted | failed | refused | cancelled."""
        self.conversions.labels(str(outcome)).inc()
        self.conversion_seconds.labels(str(outcome)).observe(max(seconds, 0.0))

    def observe_weight_update(self, outcome: str, seconds: float) -> None:
        """One finished fleet weight update: outcome e.g. success | failed | rolled_back."""
        self.weight_updates.labels(str(outcome)).inc()
        self.weight_update_seconds.labels(str(outcome)).observe(max(seconds, 0.0))

    def observe_abort(self, reason: str, count: int = 1) -> None:
        """Requests the router aborted on the servers (e.g. reason=conversion, weight_update, admin)."""
        if count > 0:
            self.aborts.inc((str(reason),), count)

    # ---- registry events ------------------------------------------------------------------------------
    def _on_registry_event(self, event: str, worker: Worker, details: dict) -> None:
        self.worker_events.labels(event).inc()
        if event == "health":
            role = worker.role.value
            healthy, phase = self._last_health.get(worker.id, (True, "closed"))
            if worker.healthy is not healthy:
                self.health_changes.labels(worker.url, role, "true" if worker.healthy else "false").inc()
            if worker.breaker != phase:
                self.breaker_changes.labels(worker.url, role, worker.breaker).inc()
            self._last_health[worker.id] = (worker.healthy, worker.breaker)
        elif event == "removed":
            # Its series go with it: a fleet that churns workers must not grow /metrics without bound.
            self._last_health.pop(worker.id, None)
            for role in Role:
                for healthy in ("true", "false"):
                    self.health_changes.remove(worker.url, role.value, healthy)
                for phase in BREAKER_PHASES:
                    self.breaker_changes.remove(worker.url, role.value, phase)

    def render(self) -> bytes:
        return generate_latest(self.prometheus)


class _StateCollector:
    """State read at scrape time: nothing is updated on the request path for these."""

    def __init__(self, registry: Registry, admission: Admission) -> None:
        self.registry = registry
        self.admission = admission

    def describe(self):
        return []

    def collect(self):
        labels = ["worker", "role"]
        inflight = GaugeMetricFamily(f"{PREFIX}_worker_inflight",
                                     "requests holding the worker (selection until last byte)", labels=labels)
        healthy = GaugeMetricFamily(f"{PREFIX}_worker_healthy", "1 when probes pass and the breaker is not open",
                                    labels=labels)
        routable = GaugeMetricFamily(f"{PREFIX}_worker_routable", "1 when active and healthy", labels=labels)
        breaker = GaugeMetricFamily(f"{PREFIX}_worker_breaker_phase", "0 closed, 1 half-open, 2 open",
                                    labels=labels)
        state = GaugeMetricFamily(f"{PREFIX}_worker_state", "1 for the worker's current state",
                                  labels=labels + ["state"])
        served = CounterMetricFamily(f"{PREFIX}_worker_requests", "legs sent to the worker", labels=labels)
        failed = CounterMetricFamily(f"{PREFIX}_worker_failures", "legs that ended in error", labels=labels)
        ranks = GaugeMetricFamily(f"{PREFIX}_worker_dp_ranks", "data-parallel ranks (dp_size x attn_dp_size)",
                                  labels=labels)
        rank_labels = labels + ["dp_rank"]
        rank_inflight = GaugeMetricFamily(f"{PREFIX}_worker_rank_inflight",
                                          "requests the router sent to the rank (--dp-aware)", labels=rank_labels)
        rank_requests = GaugeMetricFamily(f"{PREFIX}_worker_rank_requests",
                                          "running + waiting requests the rank last reported (/v1/loads)",
                                          labels=rank_labels)
        for w in self.registry.workers():
            key = [w.url, w.role.value]
            inflight.add_metric(key, w.inflight)
            healthy.add_metric(key, 1 if w.healthy else 0)
            routable.add_metric(key, 1 if w.routable else 0)
            breaker.add_metric(key, BREAKER_PHASES.get(w.breaker, 0))
            for s in WorkerState:
                state.add_metric(key + [s.value], 1 if w.state is s else 0)
            served.add_metric(key, w.requests_total)
            failed.add_metric(key, w.failures_total)
            ranks.add_metric(key, w.dp_ranks)
            for row in rank_rows(w, single=True):
                rank_key = key + [str(row["dp_rank"])]
                rank_inflight.add_metric(rank_key, row["inflight"])
                if row["running"] is not None:
                    rank_requests.add_metric(rank_key, row["running"] + row["waiting"])
        pools = GaugeMetricFamily(f"{PREFIX}_pool_routable_workers", "routable workers per pool", labels=["role"])
        for role in Role:
            pools.add_metric([role.value], len(self.registry.routable(role)))
        a = self.admission
        yield from (inflight, healthy, routable, breaker, state, served, failed, ranks, rank_inflight, rank_requests,
                    pools)
        yield GaugeMetricFamily(f"{PREFIX}_queue_length", "requests waiting for admission", value=a.waiting)
        yield GaugeMetricFamily(f"{PREFIX}_requests_in_flight", "admitted requests not finished", value=a.active)
        yield GaugeMetricFamily(f"{PREFIX}_fleet_held", "1 while a fleet-wide hold (weight update) is on",
                                value=0 if a.is_open else 1)
        yield CounterMetricFamily(f"{PREFIX}_admission_rejected", "requests refused by admission (429/503)",
                                  value=a.rejected_total)
        yield CounterMetricFamily(f"{PREFIX}_admission_queued", "requests that had to wait for admission",
                                  value=a.held_total)


class BurstLimitsCollector:
    """The router's own limits (docs/ROLLOUT_BURSTS.md), read at scrape time: its open-files budget, its leg
    queue, and the times it ran out of its own resources (by errno name: EMFILE, ENFILE, EADDRNOTAVAIL,
    ENOBUFS)."""

    def __init__(self, errors: LocalResourceErrors, budget: DescriptorBudget, leg_room: LegRoom) -> None:
        self.errors, self.budget, self.leg_room = errors, budget, leg_room

    def describe(self):
        return []

    def collect(self):
        errors = CounterMetricFamily(f"{PREFIX}_local_resource_errors",
                                     "the router ran out of its own descriptors, ports or buffers (no server "
                                     "blamed)", labels=["kind"])
        for kind, count in sorted(self.errors.counts.items()):
            errors.add_metric([kind], count)
        yield errors
        yield GaugeMetricFamily(f"{PREFIX}_open_files_limit", "the router's soft RLIMIT_NOFILE at start-up",
                                value=self.budget.limit)
        yield GaugeMetricFamily(f"{PREFIX}_leg_queue_length", "requests waiting for room for their legs "
                                "(--max-connections, --max-connections-per-worker)", value=self.leg_room.waiting)
        yield CounterMetricFamily(f"{PREFIX}_leg_queue_waited", "requests that had to wait for room for their legs",
                                  value=self.leg_room.waited_total)


# ---- wiring (the main app's /metrics route and middleware: router/api/metrics_view.py) -----------------------
def metrics_handler(metrics: RouterMetrics):
    """A handler serving `metrics` in Prometheus's text format."""

    async def metrics_endpoint(request: web.Request) -> web.Response:
        return web.Response(body=metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    return metrics_endpoint


@contextlib.asynccontextmanager
async def metrics_port(metrics: RouterMetrics, config: RouterConfig):
    """`--prometheus-port`: the same registry on its own port (open, like sgl-router's exporter), while the
    context lasts; nothing without the flag."""
    if config.prometheus_port is None:
        yield
        return
    exporter = web.Application()
    exporter.router.add_get("/metrics", metrics_handler(metrics))
    runner = web.AppRunner(exporter, access_log=None)
    await runner.setup()
    host = config.prometheus_host or config.host
    site = web.TCPSite(runner, host, config.prometheus_port)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise ListenError("--prometheus-port", host, config.prometheus_port, exc) from None
    logger.info("metrics on http://%s:%d/metrics", host, config.prometheus_port)
    try:
        yield
    finally:
        await runner.cleanup()


METRICS = web.AppKey("metrics", RouterMetrics)
