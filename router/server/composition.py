"""The composition root: every long-lived object of one router, built here and nowhere else.

Two steps. `build` makes the objects, top to bottom in the order they need each other, each with explicit
constructor arguments (its collaborators, and its observers as tuples: nothing is wired in afterwards), and
stores each under its typed key (declared beside its type); it opens no socket, starts no task and calls no
server. `start` then starts them (etcd, the fleet's servers, probes, loops, the metrics port), registering each
closing as it starts it, so the router closes in the reverse order and a start-up that fails half-way closes
what it started. Handlers only read the keys; `setup()` functions only add routes.

    lifecycle, tasks, admission, metrics    what everything else reports into
    session -> upstream; [tracing]          the control plane's client of the servers; --enable-trace's spans
    policies, legs, live, leg aborts,       the request path's parts the control plane needs too, and the
    eviction, leg room, [pd admission]      narrow face the flows see of it (traffic)
      -> traffic
    [cluster]                               replicas sharing the fleet: traffic becomes the fleet's holds,
                                            the coordinator etcd's; joined before any worker is registered
    live state, worker lifecycle, sources   the fleet's servers (one way in and out for the API, the
                                            sources and health), read before the router serves
    conversions                             live P/D role conversion
    health (live state, eviction)           probes and breakers; a worker found down is evicted
    load monitor, upkeep, rebalancer        what policies need beside the request path
    dispatcher (health), proxy (rebalancer, the request path, last: its observers exist by then
      metrics, access log)
    fleet control (conversions)             fleet-wide operations: updates, pauses, memory, aborts
    RL relay, shared answers                what handlers keep between calls

Adding a component: build it in `build` where what it needs exists, give it its key beside its class; start it
in `start`, registering its closing there; a route that shows it goes in its api module's `setup`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import ssl
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Coroutine

import aiohttp
from aiohttp import web

from policies import Policy, make_policy
from router.api.info import SHARED_ROUTES
from router.api.probes import SHARED_ROUTES as PROBE_ROUTES
from router.api.rl.engine_relay import RELAY, Relay
from router.api.rl.worker_rows import FACTS, LaunchFactsCache
from router.api.shared_answers import SHARED_ANSWERS, SharedAnswers
from router.control.live_state import LIVE_STATE, LiveStateReader
from router.control.health import HEALTH, HealthMonitor
from router.control.load_monitor import LOAD_MONITOR, LoadMonitor
from router.control.upstream import UPSTREAM, Upstream
from router.control.worker_sources import WORKER_SOURCES, WorkerSources
from router.core.allowlists import WorkerAllowList
from router.core.config import DISCOVER, RouterConfig
from router.core.coordination import Coordinator, FleetMembership, LocalCoordinator
from router.core.errors import RouterError
from router.core.keys import (CONFIG, COORDINATOR, DESCRIPTORS, LIFECYCLE, LOCAL_RESOURCES, POLICIES, REGISTRY,
                              SESSION, TASKS, TRAFFIC, WORKER_ALLOW)
from router.core.lifecycle import Lifecycle
from router.core.local_resources import DescriptorBudget, LocalResourceErrors
from router.core.registry import Registry, Role
from router.core.tasks import BackgroundTasks
from router.core.traffic import RequestPathControl
from router.core.worker_tls import worker_ssl_context
from router.core.worker_url import identity
from router.dataplane.admission import ADMISSION, Admission
from router.dataplane.dispatch import Dispatcher
from router.dataplane.eviction import Eviction
from router.dataplane.leg_aborts import LegAborts
from router.dataplane.leg_room import LegRoom
from router.dataplane.live import LiveRequests
from router.dataplane.path_control import DataplaneControl
from router.dataplane.pd_admission import PdAdmission, PdAdmissionCollector
from router.dataplane.proxy import PROXY, Proxy
from router.dataplane.rank_placement import RankPlacer
from router.dataplane.upstream_http import UpstreamPool
from router.flows.conversion import CONVERSIONS, Conversions
from router.flows.rebalancer import REBALANCER, FlowConverter, Rebalancer
from router.flows.fleet_control import FLEET_CONTROL, FleetControl
from router.flows.memory import MEMORY, MemoryOccupation
from router.flows.pauses import PAUSES, Pauses
from router.flows.request_aborts import ABORTS, RequestAborts
from router.flows.weight_updates import UPDATE_KINDS, UPDATES, WeightUpdates
from router.flows.worker_lifecycle import WORKER_LIFECYCLE, WorkerLifecycle
from router.obs import logs
from router.obs.metrics import METRICS, BurstLimitsCollector, RouterMetrics, metrics_port
from router.obs.policy_metrics import PolicyCollector
from router.server import policy_runtime, source_builder
from router.server.replica_info import REPLICA

if TYPE_CHECKING:
    from router.cluster.runtime import Cluster

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Assembly:
    """What `build` made that `start` starts or closes (each is also under its key, for the handlers)."""

    config: RouterConfig
    registry: Registry
    lifecycle: Lifecycle
    tasks: BackgroundTasks
    legs: UpstreamPool
    cluster: Cluster | None
    coordinator: Coordinator
    live_state: LiveStateReader
    sources: WorkerSources
    conversions: Conversions
    health: HealthMonitor
    loops: tuple[Callable[[], Coroutine], ...]  # run from start-up until the router closes
    metrics: RouterMetrics
    fleet: FleetControl
    updates: WeightUpdates
    answers: SharedAnswers


def build(app: web.Application, stack: contextlib.AsyncExitStack) -> Assembly:
    """Build and store every long-lived object of the router `app` serves (its CONFIG, REGISTRY and REPLICA
    are given), each with its collaborators and observers as constructor arguments. Nothing is started here:
    no socket, no task, no call to a server or etcd. `stack` gets the closing of what holds something from its
    construction on (the session's connector, the tracing exporter's thread)."""
    config, registry = app[CONFIG], app[REGISTRY]

    # ---- what everything reports into ------------------------------------------------------------------
    lifecycle = app[LIFECYCLE] = Lifecycle()
    tasks = app[TASKS] = BackgroundTasks()
    admission = app[ADMISSION] = Admission(config.admission)
    metrics = app[METRICS] = RouterMetrics(registry, admission, config.prometheus_duration_buckets)
    spawn = tasks.spawn
    # What the open-files limit allows (`__main__` raised it to the hard limit) and the router running out anyway.
    budget = app[DESCRIPTORS] = DescriptorBudget.current(config.max_connections)
    local_errors = app[LOCAL_RESOURCES] = LocalResourceErrors()

    # ---- the control plane's client ----------------------------------------------------------------------
    worker_tls = worker_ssl_context(config.client_cert_path, config.client_key_path, config.ca_cert_paths)
    session = app[SESSION] = make_session(config, worker_tls)
    stack.push_async_callback(session.close)
    upstream = app[UPSTREAM] = Upstream(session, api_key=config.worker_api_key, local_errors=local_errors)
    upstream.follow_credentials(registry)

    # ---- traces (--enable-trace): OpenTelemetry imported only then; closed last, after the legs -----------------
    tracing = None
    if config.trace.enabled:
        from router.obs.otel_tracing import TRACING, Tracing

        tracing = app[TRACING] = Tracing(config.trace)
        stack.push_async_callback(tracing.close)

    # ---- the request path's parts that the control plane needs too --------------------------------------------
    policies: dict[Role, Policy] = {Role.PREFILL: make_policy(config.prefill_policy, config.policy_params),
                                    Role.DECODE: make_policy(config.decode_policy, config.policy_params)}
    app[POLICIES] = policies
    legs = UpstreamPool(max_connections=config.max_connections, connect_timeout=config.connect_timeout_secs,
                        max_open=budget.legs, local_errors=local_errors,
                        silence_timeout=config.upstream_idle_timeout_secs, ssl_context=worker_tls,
                        idle_timeout=config.connections.upstream_pool_idle_timeout_secs or float("inf"))  # 0: ever
    registry.subscribe(_forget_removed(legs))
    live = LiveRequests()  # attempts in flight, by rid (the abort endpoint, the flows)
    leg_aborts = LegAborts(legs, spawn, config.worker_api_key)
    eviction = Eviction(registry, live, leg_aborts)  # health's answer to a worker found down
    # The legs' descriptors: at most the pool's bound in flight, --max-connections-per-worker on one server.
    leg_room = LegRoom(config.max_connections_per_worker, legs.max_connections, registry)
    metrics.prometheus.register(BurstLimitsCollector(local_errors, budget, leg_room))
    gates = PdAdmission(config.pd_admission, registry)  # SMG's PD admission gates
    pd_admission = gates if gates.enabled else None
    if pd_admission is not None:  # its queue and refusals on /metrics
        metrics.prometheus.register(PdAdmissionCollector(pd_admission))
    traffic: RequestPathControl = DataplaneControl(admission, live, legs, abort_on=leg_aborts.abort_on)
    coordinator: Coordinator = LocalCoordinator(registry, traffic)

    # ---- replicas sharing the fleet: joined by `start` before any worker of the command line is registered ----
    cluster = None
    if config.cluster.enabled:
        from router.cluster import view  # etcd's modules only where a cluster is configured
        from router.cluster.runtime import Cluster

        cluster = app[view.CLUSTER] = Cluster(config, registry, traffic, spawn, replica_id=app[REPLICA].id)
        traffic, coordinator = cluster.gate, cluster.coordinator  # the flows' holds and turns are the fleet's
        metrics.prometheus.register(view.ClusterCollector(cluster))
    app[TRAFFIC], app[COORDINATOR] = traffic, coordinator

    # ---- the fleet's servers: read by `start` before the router serves ----------------------------------------
    app[WORKER_ALLOW] = WorkerAllowList.parse(config.worker_allow)
    live_state = app[LIVE_STATE] = LiveStateReader(
        registry, upstream, spawn,
        retry_interval=config.worker_startup_check_interval_secs or config.health.interval_secs)
    worker_lifecycle = app[WORKER_LIFECYCLE] = WorkerLifecycle(config, registry, upstream, live_state, coordinator,
                                                                app[WORKER_ALLOW])
    sources = app[WORKER_SOURCES] = source_builder.build(config, registry, *_worker_api(worker_lifecycle, upstream,
                                                                                        config))

    # ---- live role conversion -------------------------------------------------------------------------------
    conversions = app[CONVERSIONS] = Conversions(
        registry, upstream, spawn, drain_timeout_s=config.drain_timeout_secs,
        switch_timeout_s=config.switch_timeout_secs, fleet_busy=_conversion_refusal(lifecycle, admission),
        coordinator=coordinator, traffic=traffic, observers=[_observe_conversion(metrics),
                                         *([tracing.flows.conversion_observer] if tracing is not None else [])])

    # ---- health: probes and breakers; a worker found down is evicted from the requests waiting on it ----------
    on_down = [eviction.evict, *([_remove_unhealthy(registry, worker_lifecycle, sources, spawn)]
                                 if config.health.remove_unhealthy else [])]
    health = app[HEALTH] = HealthMonitor(registry, upstream, config.health, config.breaker,
                                         is_held=lambda: not admission.is_open, refresh=live_state.refresh,
                                         on_down=on_down)

    # ---- what policies need beside the request path -----------------------------------------------------------
    load_monitor = app[LOAD_MONITOR] = LoadMonitor(registry, upstream, config.load_monitor)
    registry.subscribe(policy_runtime.forget_departed(policies))
    rebalancer = app[REBALANCER] = Rebalancer(
        registry, config.rebalance, converter=FlowConverter(conversions), spawn=spawn,
        leading=lambda: lifecycle.fleet_read and coordinator.leading)  # no decision while the fleet is read
    metrics.prometheus.register(PolicyCollector(registry, policies, load_monitor, rebalancer))
    loops = [rebalancer.run, *(functools.partial(policy_runtime.upkeep, p)
                               for p in {id(p): p for p in policies.values()}.values() if p.maintenance_interval)]
    if config.load_monitor.enabled and (not config.load_monitor.on_demand
                                        or policy_runtime.loads_read(config, policies)):
        loops.append(load_monitor.run)

    # ---- the request path: its legs' verdicts go to health, its records to the rebalancer, metrics, the log ---
    ranks = RankPlacer(config.dp_ranks.prefill_policy, config.dp_ranks.decode_policy) \
        if config.dp_ranks.aware else None  # --dp-aware
    dispatcher = Dispatcher(
        registry=registry, upstream=legs, policies=policies, spawn=spawn, aborts=leg_aborts, live=live,
        room=leg_room, pd_admission=pd_admission, retry_aborted=config.retry.retry_aborted,
        leg_observers=(health.on_leg,), linger_timeout=config.upstream_idle_timeout_secs or None,
        sse_keepalive=config.connections.sse_keepalive_secs or None)
    app[PROXY] = Proxy(config=config, registry=registry, policies=policies, admission=admission,
                       dispatcher=dispatcher, live=live, leg_room=leg_room, pd_admission=pd_admission,
                       tracer=tracing.requests if tracing is not None else None, ranks=ranks,
                       request_observers=(rebalancer.window.observe, metrics.observe_request, logs.log_request),
                       arrival_observers=(rebalancer.window.arrived,))

    # ---- fleet-wide operations, one at a time: their shared state, then each operation ------------------------
    fleet = app[FLEET_CONTROL] = FleetControl(config, registry, upstream, traffic, spawn, coordinator=coordinator,
                                              refusing=lifecycle.refusal, conversions_running=conversions.running,
                                              observers=[_observe_fleet_operation(metrics), *(
                                                  [tracing.flows.operation_observer] if tracing is not None else [])])
    updates = app[UPDATES] = WeightUpdates(fleet)
    app[PAUSES] = Pauses(fleet)
    app[MEMORY] = MemoryOccupation(fleet)
    app[ABORTS] = RequestAborts(traffic, upstream, fleet.targets, config.abort_timeout_secs, coordinator)

    # ---- what handlers keep between calls -------------------------------------------------------------------
    app[FACTS] = LaunchFactsCache(registry, upstream)
    app[RELAY] = Relay(upstream, config.rl_control_timeout_secs, config.rl_fanout_concurrency)
    answers = app[SHARED_ANSWERS] = SharedAnswers(registry, {**SHARED_ROUTES, **PROBE_ROUTES})
    return Assembly(config=config, registry=registry, lifecycle=lifecycle, tasks=tasks, legs=legs, cluster=cluster,
                    coordinator=coordinator, live_state=live_state, sources=sources, conversions=conversions,
                    health=health, loops=tuple(loops), metrics=metrics, fleet=fleet, updates=updates,
                    answers=answers)


async def start(built: Assembly, stack: contextlib.AsyncExitStack) -> None:
    """Start what `build` made: join the cluster, read the fleet's servers, then the probes, the loops, the
    metrics port and the fleet's upkeep. Each closing goes on `stack` as its part starts, so the router closes
    in the reverse order and a start-up that fails half-way closes what it started."""
    config = built.config
    stack.push_async_callback(built.legs.close)
    stack.push_async_callback(built.tasks.close)  # before the pools close: aborts and lingering legs use them
    if built.cluster is not None:  # joined before any worker of the command line is registered
        await built.cluster.start(config.worker_startup_timeout_secs)
        stack.push_async_callback(built.cluster.close)
    stack.push_async_callback(built.live_state.close)
    stack.push_async_callback(built.sources.close)
    stack.push_async_callback(built.health.close)  # it probes a server from the moment it is read
    await _read_fleet(built)
    stack.push_async_callback(built.conversions.close)
    built.health.start()
    stack.push_async_callback(_cancelled, [built.tasks.spawn(loop()) for loop in built.loops])
    await stack.enter_async_context(metrics_port(built.metrics, config))
    built.fleet.start()
    stack.push_async_callback(built.fleet.close)
    if built.cluster is not None:
        # the fleet's share of the fleet record (pause, released memory); the flows that recover orphans
        built.cluster.attach(built.fleet, {"conversion": built.conversions,
                                           **{kind: built.updates for kind in UPDATE_KINDS}})
    stack.callback(built.answers.close)


async def _read_fleet(built: Assembly) -> None:
    """The command line's workers and the worker sources' listings, each server read (within
    --worker-startup-timeout-secs: the unread stay pending, read again in the background); then the sources
    watch their listings."""
    config, sources = built.config, built.sources
    _register_command_line(config, built.registry, built.coordinator, built.live_state)
    await sources.load()
    if not sources.sources and (not config.prefill or not config.decode):
        logger.warning("started with %d prefill and %d decode workers; add workers through POST /workers",
                       len(config.prefill), len(config.decode))
    await built.live_state.start_up(config.worker_startup_timeout_secs)
    sources.start(built.tasks.spawn)
    built.lifecycle.fleet_read = True


async def router_context(app: web.Application):
    """The app's one clean-up context (`create_app` gives it): build, start, serve, close in reverse order."""
    async with contextlib.AsyncExitStack() as stack:
        await start(build(app, stack), stack)
        yield


def make_session(config: RouterConfig, worker_tls: ssl.SSLContext | None = None) -> aiohttp.ClientSession:
    """The control plane's one client; `worker_tls`: the context for https:// workers (None: the defaults)."""
    connector = aiohttp.TCPConnector(
        ssl=worker_tls if worker_tls is not None else True,
        limit=config.max_connections,
        limit_per_host=0,  # the total limit already bounds each worker; a per-host cap would stall bursts
        ttl_dns_cache=300,
        keepalive_timeout=config.connections.upstream_pool_idle_timeout_secs or None,  # 0: kept for ever
    )
    return aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=None, connect=config.connect_timeout_secs),
        auto_decompress=False,
        read_bufsize=2**17,
    )


# ---- the pieces' glue -----------------------------------------------------------------------------------------
def _forget_removed(legs: UpstreamPool):
    """A registry listener: a removed worker's connections are closed and its pool entry dropped."""

    def listener(event: str, worker, details: dict) -> None:
        if event == "removed":
            legs.forget(worker.url)

    return listener


def _known(registry: Registry, coordinator: FleetMembership, url: str, flag: str) -> bool:
    """Already in the fleet, or removed from it (router replicas: the command line seeds a cluster, it does not
    override it; the cluster's record, or its record of a removal, wins over the flag)."""
    worker = registry.find(url)
    url = identity(url)  # credentials apart: never shown
    if worker is not None:
        logger.info("%s is in the fleet already (as %s, %s): its command-line flag is not applied", url,
                    worker.role, worker.state)
        return True
    removal = coordinator.removal(url)
    if removal is not None:
        logger.warning("%s was %s: not added from %s. To bring it back on purpose: POST /workers {\"url\": \"%s\"} "
                       "at any replica (its live role is read; the removal is cleared)", url, removal, flag, url)
        return True
    return False


def _register_command_line(config: RouterConfig, registry: Registry, coordinator: FleetMembership,
                           live_state: LiveStateReader) -> None:
    """The command line's workers, pending until their servers have been read (`LiveStateReader.start_up`)."""
    for spec in config.prefill:
        given = spec.bootstrap_port is not DISCOVER
        if not _known(registry, coordinator, spec.url, "--prefill"):
            live_state.register(spec.url, Role.PREFILL, spec.bootstrap_port if given else None, port_given=given,
                               source="--prefill")
    for spec in config.decode:
        if not _known(registry, coordinator, spec.url, "--decode"):
            live_state.register(spec.url, Role.DECODE, None, port_given=True, source="--decode")


def _worker_api(lifecycle: WorkerLifecycle, upstream: Upstream, config: RouterConfig):
    """The worker lifecycle's calls, for the worker sources: a listed worker is registered and removed exactly
    as `POST /workers` and `DELETE /workers/{id}` would."""

    async def register(url: str, role: Role | None, bootstrap_port, source: str, read: bool, seed: bool,
                       settings: dict):
        # read in the background (a source does not wait for a server), or at start-up with the others
        return await lifecycle.register(url, role, bootstrap_port, source=source, settle=0.0 if read else None,
                                        seed=seed, settings=settings)

    async def unregister(worker, by: str) -> None:
        await lifecycle.unregister(worker, by=by)

    async def answers(url: str) -> str | None:
        health = config.health
        reply = await upstream.health(url, health.endpoint, timeout=health.timeout_secs)
        return None if reply.ok else reply.message() or f"HTTP {reply.status}"

    return register, unregister, answers


def _remove_unhealthy(registry: Registry, lifecycle: WorkerLifecycle, sources, spawn):
    """--remove-unhealthy-workers: a worker its probes declare down is removed as `DELETE /workers/{id}` would
    (the cluster's record too); the worker source that listed it registers it again once its server answers."""

    async def remove(worker, reason: str) -> None:
        if registry.find(worker.id) is not worker or worker.healthy:
            return  # gone already, or back meanwhile
        with sources.unhealthy_removal(worker) as listed:
            try:
                await lifecycle.unregister(worker, by=f"the health checker ({reason})")
            except RouterError as exc:  # an operation owns it (a conversion): it stays, held out
                logger.warning("%s is unhealthy but not removed: %s", worker.url, exc.message)
                return
        logger.warning("removed %s %s: unhealthy (%s)%s", worker.role, worker.url, reason,
                       "; its worker source registers it again once it answers" if listed else
                       ": nothing registers it again (not from a worker source)")

    def on_down(worker, reason: str) -> None:
        spawn(remove(worker, reason))

    return on_down


def _conversion_refusal(lifecycle: Lifecycle, admission: Admission) -> Callable[[], str | None]:
    """Why no conversion may start now: the router shuts down, or a fleet-wide operation holds the fleet."""

    def refusal() -> str | None:
        if (shutting_down := lifecycle.refusal()) is not None:
            return f"{shutting_down}: no conversion starts now"
        if admission.is_open:
            return None
        return (f"the fleet is held ({', '.join(admission.state()['holds'])}): convert once that operation "
                f"has ended")

    return refusal


def _observe_conversion(metrics: RouterMetrics):
    def observe(event: str, conversion, details: dict) -> None:
        if event == "finished":
            metrics.observe_conversion(conversion.outcome.value, conversion.duration_s or 0.0)
        elif event == "abort_all":
            metrics.observe_abort("conversion", details.get("inflight", 0))

    return observe


def _observe_fleet_operation(metrics: RouterMetrics):
    def observe(op) -> None:
        if op.kind in UPDATE_KINDS:
            metrics.observe_weight_update(op.state, op.duration_s or 0.0)
        metrics.observe_abort(op.kind, op.aborted_requests)

    return observe


async def _cancelled(tasks: list[asyncio.Task]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)

