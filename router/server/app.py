"""The router application: its middlewares and its route table. What the routes serve is built by the
composition root (`server/composition.py`), the app's one clean-up context."""

from __future__ import annotations

from aiohttp import web

from router.api import control as api_control
from router.api import conversion_endpoints as api_conversion
from router.api import health_view as api_health
from router.api import info as api_info
from router.api import metrics_view as api_metrics
from router.api import openapi as api_openapi
from router.api import policy_admin as api_policies
from router.api import probes as api_probes
from router.api import rl as api_rl
from router.api import worker_update as api_worker_update
from router.api import workers as api_workers
from router.api.access import make_access_middleware
from router.api.cors import Cors
from router.core.config import RouterConfig
from router.core.errors import error_middleware, json_response
from router.core.keys import CONFIG, REGISTRY
from router.core.registry import Registry
from router.core.request_shape import GENERATE_ROUTES
from router.dataplane.proxy import PROXY
from router.obs import logs
from router.server import replica_info
from router.server.composition import router_context
from router.server.replica_info import REPLICA, ReplicaInfo


def create_app(config: RouterConfig, *, registry: Registry | None = None,
               replica: ReplicaInfo | None = None) -> web.Application:
    middlewares = [logs.make_request_id_middleware(config.request_id_headers), api_metrics.metrics_middleware,
                   error_middleware, make_access_middleware(config)]
    cors = Cors(config.cors_allowed_origins) if config.cors_allowed_origins else None
    if cors is not None:  # preflights answered before the key check
        middlewares.insert(1, cors.middleware())
    app = web.Application(middlewares=middlewares, client_max_size=config.admission.max_payload_size)
    app[CONFIG] = config
    if config.request_id_headers:
        app.on_response_prepare.append(logs.echo_request_id)
    if cors is not None:
        app.on_response_prepare.append(cors.on_prepare)
    app[REGISTRY] = registry if registry is not None else Registry()
    app[REPLICA] = replica if replica is not None else ReplicaInfo()
    app.cleanup_ctx.append(router_context)
    add_routes(app, config)
    return app


def add_routes(app: web.Application, config: RouterConfig) -> None:
    """Every route of the router; each api module's `setup` only adds its own."""
    for route, upstream_path in GENERATE_ROUTES.items():
        app.router.add_post(route, _generate_handler(route, upstream_path))
    api_info.setup(app)
    api_probes.setup(app)
    api_workers.setup(app)
    api_worker_update.setup(app)
    api_conversion.setup(app)
    api_health.setup(app)
    api_policies.setup(app)
    api_metrics.setup(app)
    api_control.setup(app)
    api_rl.setup(app)
    replica_info.setup(app)
    if config.cluster.enabled:
        from router.cluster import view  # etcd's modules only where a cluster is configured

        async def cluster_view(request: web.Request) -> web.Response:
            return json_response(await view.describe(request.app[view.CLUSTER]))
        app.router.add_get("/admin/cluster", cluster_view)
    api_openapi.setup(app)  # last: it documents every route above


def _generate_handler(route: str, upstream_path: str):
    async def handler(request: web.Request) -> web.StreamResponse:
        return await request.app[PROXY].handle(request, route, upstream_path)

    handler.__name__ = f"generate_{route.strip('/').replace('/', '_')}"
    return handler
