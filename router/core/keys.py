"""Typed keys of the objects the application owns (one module, so handlers need not import app).

The types are named for type checkers only: core must not import the layers above it at run time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import aiohttp
from aiohttp import web

from router.core.config import RouterConfig
from router.core.coordination import Coordinator
from router.core.lifecycle import Lifecycle
from router.core.registry import Registry
from router.core.traffic import RequestPathControl

if TYPE_CHECKING:
    from router.control.health import HealthMonitor
    from router.control.upstream import Upstream
    from router.dataplane.admission import Admission
    from router.obs.metrics import RouterMetrics

CONFIG = web.AppKey("config", RouterConfig)
REGISTRY = web.AppKey("registry", Registry)
SESSION = web.AppKey("session", aiohttp.ClientSession)
UPSTREAM: web.AppKey[Upstream] = web.AppKey("upstream")
ADMISSION: web.AppKey[Admission] = web.AppKey("admission")
PROXY = web.AppKey("proxy", object)
TRAFFIC = web.AppKey("traffic", RequestPathControl)  # the request path as the flows see it
COORDINATOR = web.AppKey("coordinator", Coordinator)  # the other router replicas of the fleet, as flows see them
TASKS = web.AppKey("tasks", object)
DISCOVERY = web.AppKey("discovery", object)
HEALTH: web.AppKey[HealthMonitor] = web.AppKey("health")
LOAD_MONITOR = web.AppKey("load_monitor", object)
REBALANCER = web.AppKey("rebalancer", object)
METRICS: web.AppKey[RouterMetrics] = web.AppKey("metrics")
WEIGHTS = web.AppKey("weights", object)  # flows.weights.WeightFlow
LIFECYCLE = web.AppKey("lifecycle", Lifecycle)  # serving, or shutting down
WORKER_SOURCES = web.AppKey("worker_sources", object)  # server.worker_sources.WorkerSources
