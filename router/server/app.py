"""Builds the router application: the route table, one shared client session, owned background tasks."""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable

import aiohttp
from aiohttp import web

from policies import make_policy
from router.api import control as api_control
from router.api import conversion as api_conversion
from router.api import info as api_info
from router.api import openapi as api_openapi
from router.api import rl as api_rl
from router.api import workers as api_workers
from router.api.access import make_access_middleware
from router.control import health
from router.control.discovery import Discovery
from router.control.upstream import Upstream
from router.core.config import DISCOVER, RouterConfig
from router.core.coordination import LocalCoordinator
from router.core.errors import error_middleware
from router.core.keys import (ADMISSION, CONFIG, COORDINATOR, DISCOVERY, LIFECYCLE, PROXY, REGISTRY, SESSION, TASKS,
                              TRAFFIC, UPSTREAM, WORKER_SOURCES)
from router.core.lifecycle import Lifecycle
from router.core.registry import Registry, Role
from router.core.worker_url import identity
from router.core.request_shape import GENERATE_ROUTES
from router.dataplane.admission import Admission
from router.dataplane.proxy import Proxy
from router.dataplane.traffic import DataplaneControl
from router.dataplane.upstream_http import UpstreamPool
from router.obs import logs, metrics
from router.server import policy_runtime, replica_info, worker_sources
from router.server.replica_info import ReplicaInfo

logger = logging.getLogger(__name__)


class BackgroundTasks:
    """Tasks the app owns: kept referenced, cancelled and awaited on clean-up."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task] = set()

    def spawn(self, coro: Awaitable) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("background task failed", exc_info=task.exception())

    def __len__(self) -> int:
        return len(self._tasks)

    async def close(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)


def make_session(config: RouterConfig) -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(
        limit=config.max_connections,
        limit_per_host=0,  # the total limit already bounds each worker; a per-host cap would stall bursts
        ttl_dns_cache=300,
        keepalive_timeout=30,
    )
    return aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=None, connect=config.connect_timeout_secs),
        auto_decompress=False,
        read_bufsize=2**17,
    )


def create_app(config: RouterConfig, *, registry: Registry | None = None,
               replica: ReplicaInfo | None = None) -> web.Application:
    middlewares = [logs.request_id_middleware, metrics.metrics_middleware, error_middleware,
                   make_access_middleware(config)]
    app = web.Application(middlewares=middlewares, client_max_size=config.admission.max_payload_size)
    app[CONFIG] = config
    app[REGISTRY] = registry if registry is not None else Registry()
    app[TASKS] = BackgroundTasks()
    app[LIFECYCLE] = Lifecycle()
    app[ADMISSION] = Admission(config.admission)
    app[COORDINATOR] = LocalCoordinator()  # replaced by the cluster's when replicas share the fleet
    app[WORKER_SOURCES] = worker_sources.build(app)
    app.cleanup_ctx.append(_session_ctx)
    if config.cluster.enabled:
        from router.server import cluster_setup  # etcd's modules only where a cluster is configured

        cluster_setup.setup(app)
    app.cleanup_ctx.append(_workers_ctx)

    for route, upstream_path in GENERATE_ROUTES.items():
        app.router.add_post(route, _generate_handler(route, upstream_path))
    api_info.setup(app)
    api_workers.setup(app)
    api_conversion.setup(app)
    health.setup(app)
    policy_runtime.setup(app)
    metrics.setup(app)
    logs.setup(app)
    api_control.setup(app)
    api_rl.setup(app)
    replica_info.setup(app, replica if replica is not None else ReplicaInfo())
    api_openapi.setup(app)  # last: it documents every route above
    if config.cluster.enabled:
        cluster_setup.attach_flows(app)
    return app


def _generate_handler(route: str, upstream_path: str):
    async def handler(request: web.Request) -> web.StreamResponse:
        return await request.app[PROXY].handle(request, route, upstream_path)

    handler.__name__ = f"generate_{route.strip('/').replace('/', '_')}"
    return handler


async def _session_ctx(app: web.Application):
    config = app[CONFIG]
    session = make_session(config)
    app[SESSION] = session
    app[UPSTREAM] = Upstream(session, api_key=config.worker_api_key)
    app[UPSTREAM].follow_credentials(app[REGISTRY])
    legs = UpstreamPool(max_connections=config.max_connections, connect_timeout=config.connect_timeout_secs,
                        silence_timeout=config.upstream_idle_timeout_secs)
    app[PROXY] = Proxy(
        config=config,
        registry=app[REGISTRY],
        upstream=legs,
        prefill_policy=make_policy(config.prefill_policy, config.policy_params),
        decode_policy=make_policy(config.decode_policy, config.policy_params),
        admission=app[ADMISSION],
        spawn=app[TASKS].spawn,
    )
    app[TRAFFIC] = DataplaneControl(app[ADMISSION], app[PROXY].live, legs, abort_on=app[PROXY].abort_on)
    app[REGISTRY].subscribe(_forget_removed(legs))
    yield
    await app[TASKS].close()
    await legs.close()
    await session.close()


def _forget_removed(legs: UpstreamPool):
    """A registry listener: a removed worker's connections are closed and its pool entry dropped."""

    def listener(event: str, worker, details: dict) -> None:
        if event == "removed":
            legs.forget(worker.url)

    return listener


def _known(app: web.Application, url: str, flag: str) -> bool:
    """Already in the fleet, or removed from it (router replicas: the command line seeds a cluster, it does not
    override it; the cluster's record, or its record of a removal, wins over the flag)."""
    worker = app[REGISTRY].find(url)
    url = identity(url)  # credentials apart: never shown
    if worker is not None:
        logger.info("%s is in the fleet already (as %s, %s): its command-line flag is not applied", url,
                    worker.role, worker.state)
        return True
    removal = app[COORDINATOR].removal(url)
    if removal is not None:
        logger.warning("%s was %s: not added from %s. To bring it back on purpose: POST /workers {\"url\": \"%s\"} "
                       "at any replica (its live role is read; the removal is cleared)", url, removal, flag, url)
        return True
    return False


async def _workers_ctx(app: web.Application):
    """Register the command line's workers, pending until their servers have been read (their live role,
    bootstrap port, weight version and readiness: `Discovery.start_up`, bounded) before the router serves."""
    config, registry = app[CONFIG], app[REGISTRY]
    discovery = Discovery(registry, app[UPSTREAM], app[TASKS].spawn, retry_interval=config.health.interval_secs)
    app[DISCOVERY] = discovery
    for spec in config.prefill:
        given = spec.bootstrap_port is not DISCOVER
        if _known(app, spec.url, "--prefill"):
            continue
        discovery.register(spec.url, Role.PREFILL, spec.bootstrap_port if given else None, port_given=given,
                           source="--prefill")
    for spec in config.decode:
        if not _known(app, spec.url, "--decode"):
            discovery.register(spec.url, Role.DECODE, None, port_given=True, source="--decode")
    sources = app[WORKER_SOURCES]
    await sources.load()
    if not sources.sources and (not config.prefill or not config.decode):
        logger.warning("started with %d prefill and %d decode workers; add workers through POST /workers",
                       len(config.prefill), len(config.decode))
    await discovery.start_up(config.worker_startup_timeout_secs)
    sources.start(app[TASKS].spawn)
    yield
    await sources.close()
    await discovery.close()
