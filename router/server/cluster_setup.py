"""Wiring a replica into its cluster (`--etcd-endpoints`, docs/CLUSTER.md): imported only when one is
configured, so a lone router loads nothing of etcd.

The cluster's context runs right after the session's and before the command line's workers are registered:
the replica joins and applies the fleet's shared state first, then only workers absent from the cluster are
registered from its command line. The flows get the etcd coordinator and the fleet-wide holds; the weight
flow is attached once it exists; `GET /admin/cluster` and the `pd_router_cluster_*` metrics show it.
"""

from __future__ import annotations

from aiohttp import web

from router.cluster import view
from router.cluster.runtime import Cluster
from router.core.keys import CONFIG, COORDINATOR, METRICS, REGISTRY, TASKS, TRAFFIC, UPSTREAM, WEIGHTS
from router.server.replica_info import REPLICA


def setup(app: web.Application) -> None:
    """Call in create_app right after the session context is registered."""
    app.cleanup_ctx.append(_cluster_ctx)
    app.router.add_get("/admin/cluster", view.cluster_view)


def attach_flows(app: web.Application) -> None:
    """Call in create_app after the weight flow's context is registered."""
    app.cleanup_ctx.append(_attach_ctx)


async def _cluster_ctx(app: web.Application):
    config = app[CONFIG]
    replica_id = app[REPLICA].id if REPLICA in app else None  # one id in /admin/replica and /admin/cluster
    cluster = Cluster(config, app[REGISTRY], app[TRAFFIC], app[UPSTREAM], app[TASKS].spawn, replica_id=replica_id)
    app[view.CLUSTER] = cluster
    app[TRAFFIC] = cluster.holds  # the flows' holds are the fleet's
    app[COORDINATOR] = cluster.coordinator
    if METRICS in app:
        app[METRICS].prometheus.register(view.ClusterCollector(cluster))
    await cluster.start(config.worker_startup_timeout_secs)
    yield
    await cluster.close()


async def _attach_ctx(app: web.Application):
    app[view.CLUSTER].attach(app[WEIGHTS])
    yield
