"""Typed keys of the objects the application owns (one module, so handlers need not import app)."""

from __future__ import annotations

import aiohttp
from aiohttp import web

from .admission import Admission
from .config import RouterConfig
from .registry import Registry
from .upstream import Upstream

CONFIG = web.AppKey("config", RouterConfig)
REGISTRY = web.AppKey("registry", Registry)
SESSION = web.AppKey("session", aiohttp.ClientSession)
UPSTREAM = web.AppKey("upstream", Upstream)
ADMISSION = web.AppKey("admission", Admission)
PROXY = web.AppKey("proxy", object)
TASKS = web.AppKey("tasks", object)
DISCOVERY = web.AppKey("discovery", object)
HEALTH = web.AppKey("health", object)  # router.health.HealthMonitor
LOAD_MONITOR = web.AppKey("load_monitor", object)
REBALANCER = web.AppKey("rebalancer", object)
METRICS = web.AppKey("metrics", object)  # router.metrics.RouterMetrics
WEIGHTS = web.AppKey("weights", object)  # flows.weights.WeightFlow
