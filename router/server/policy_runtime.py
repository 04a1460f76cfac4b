"""What policies and the rebalancer need beside the request path, started with the app and stopped with it:
the load monitor, the policies' periodic upkeep (cache_aware's eviction), the rebalancer's loop; and telling
a policy when a worker leaves its pool (removed, or moved by a conversion) so it can drop what it holds."""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from policies import Policy
from router.api import policy_admin as api_policies
from router.api.conversion import CONVERSIONS
from router.control.load_monitor import LoadMonitor
from router.core.keys import CONFIG, COORDINATOR, LOAD_MONITOR, METRICS, PROXY, REBALANCER, REGISTRY, TASKS, UPSTREAM
from router.core.registry import Role, Worker
from router.flows.rebalancer import FlowConverter, Rebalancer
from router.obs.policy_metrics import PolicyCollector

logger = logging.getLogger(__name__)


def setup(app: web.Application) -> None:
    """Call after the session, workers and conversions contexts: this one needs the proxy, the upstream
    client and the conversion flow."""
    app.cleanup_ctx.append(_runtime_ctx)
    api_policies.setup(app)


def forget_departed(policies: dict[Role, Policy]):
    """A registry listener: a worker removed or moved out of a pool is forgotten by that pool's policy."""

    def listener(event: str, worker: Worker, details: dict) -> None:
        if event == "removed":
            policies[worker.role].on_worker_removed(worker)
        elif event == "moved":
            policies[Role(details["old_role"])].on_worker_removed(worker)

    return listener


async def _upkeep(policy: Policy) -> None:
    while True:
        await asyncio.sleep(policy.maintenance_interval)
        try:
            policy.maintain()
        except Exception:
            logger.exception("upkeep of policy %s failed", policy.name)


async def _runtime_ctx(app: web.Application):
    config, registry, proxy, spawn = app[CONFIG], app[REGISTRY], app[PROXY], app[TASKS].spawn
    tasks: list[asyncio.Task] = []
    monitor = LoadMonitor(registry, app[UPSTREAM], config.load_monitor)
    app[LOAD_MONITOR] = monitor
    if config.load_monitor.enabled:
        tasks.append(spawn(monitor.run()))
    for policy in {id(p): p for p in proxy.policies.values()}.values():
        if policy.maintenance_interval:
            tasks.append(spawn(_upkeep(policy)))
    registry.subscribe(forget_departed(proxy.policies))
    converter = FlowConverter(app[CONVERSIONS])
    rebalancer = Rebalancer(registry, config.rebalance, converter=converter, spawn=spawn,
                            leading=lambda: app[COORDINATOR].leading)
    proxy.request_observers.append(rebalancer.window.observe)
    app[REBALANCER] = rebalancer
    if METRICS in app:
        app[METRICS].prometheus.register(PolicyCollector(registry, proxy.policies, monitor, rebalancer))
    tasks.append(spawn(rebalancer.run()))
    yield
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
