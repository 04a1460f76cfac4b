"""What policies need beside the request path: their periodic upkeep (cache_aware's eviction) and being told
when a worker leaves their pool (removed, or moved by a conversion) so they can drop what they hold. The
composition root (`server/composition.py`) runs these with the load monitor and the rebalancer."""

from __future__ import annotations

import asyncio
import logging

from policies import Policy
from router.core.registry import Role, Worker

logger = logging.getLogger(__name__)


def forget_departed(policies: dict[Role, Policy]):
    """A registry listener: a worker removed or moved out of a pool is forgotten by that pool's policy."""

    def listener(event: str, worker: Worker, details: dict) -> None:
        if event == "removed":
            policies[worker.role].on_worker_removed(worker)
        elif event == "moved":
            policies[Role(details["old_role"])].on_worker_removed(worker)

    return listener


async def upkeep(policy: Policy) -> None:
    """`policy.maintain()` every `maintenance_interval`, for as long as the router runs (cancel to stop)."""
    while True:
        await asyncio.sleep(policy.maintenance_interval)
        try:
            policy.maintain()
        except Exception:
            logger.exception("upkeep of policy %s failed", policy.name)


def loads_read(config, policies: dict[Role, Policy]) -> bool:
    """Whether anything reads the servers' load reports (SMG's --disable-load-monitoring polls only then)."""
    return config.rebalance.mode.value != "off" or any(p.reads_server_load for p in policies.values())
