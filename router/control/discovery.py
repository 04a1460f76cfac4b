"""Learning what the router needs from a server before routing to it.

A prefill registered without a bootstrap port stays `pending` until its `/server_info` answers: then it
gets `disaggregation_bootstrap_port` (or, if the server is reachable but does not say, null with a warning:
decode will then use its own default port, as with mini_lb). Unreachable servers are retried until they
answer or are removed. Every worker's switch API, version and weight version are learnt on the way.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

from router.control.upstream import Upstream, bootstrap_port_of, switch_api_of, weight_version_of
from router.core.registry import Registry, Role, Worker, WorkerState

logger = logging.getLogger(__name__)

INFO_TIMEOUT = 5.0


class Discovery:
    def __init__(self, registry: Registry, upstream: Upstream, spawn: Callable[[Awaitable], asyncio.Task],
                 retry_interval: float = 5.0) -> None:
        self.registry = registry
        self.upstream = upstream
        self.spawn = spawn
        self.retry_interval = max(retry_interval, 0.2)
        self._tasks: dict[str, asyncio.Task] = {}

    def watch(self, worker: Worker) -> asyncio.Task:
        """Resolve a pending worker in the background (until reachable, removed, or closed)."""
        task = self._tasks.get(worker.id)
        if task is None or task.done():
            task = self.spawn(self._resolve(worker))
            self._tasks[worker.id] = task
        return task

    async def settle(self, timeout: float) -> None:
        """Wait (bounded) for the pending workers known now, so start-up serves with their ports."""
        tasks = [t for t in self._tasks.values() if not t.done()]
        if tasks:
            done, pending = await asyncio.wait(tasks, timeout=timeout)
            for worker in self.registry.workers():
                if worker.state is WorkerState.PENDING:
                    logger.warning("worker %s is not reachable yet; it joins its pool when it answers", worker.url)

    async def learn(self, worker: Worker) -> bool:
        """Refresh what we know about a worker from its /server_info; False if unreachable."""
        revision = worker.revision
        reply = await self.upstream.server_info(worker.url, timeout=INFO_TIMEOUT)
        if reply.status == 0:
            return False
        if self.registry.find(worker.id) is not worker:
            return True  # removed meanwhile
        if worker.revision != revision and worker.state is not WorkerState.PENDING:
            return True  # changed meanwhile (update, switch): this answer may be stale
        info = reply.data if reply.ok else None
        facts: dict = {}
        if (api := switch_api_of(info)) is not None:
            facts["switch_api"] = api
        if (version := weight_version_of(info)) is not None:
            facts["weight_version"] = version
        if isinstance(info, dict) and isinstance(info.get("version"), str):
            facts["server_version"] = info["version"]
        if worker.state is WorkerState.PENDING and worker.revision == revision:
            port = bootstrap_port_of(info)
            if worker.role is Role.PREFILL and port is None:
                logger.warning("prefill %s did not report its bootstrap port (%s); routing with bootstrap_port "
                               "null: decode servers will use their own default", worker.url,
                               f"HTTP {reply.status}" if not reply.ok else "no disaggregation_bootstrap_port")
            facts["bootstrap_port"] = port if worker.role is Role.PREFILL else worker.bootstrap_port
            self.registry.update_info(worker, **facts)
            self.registry.set_state(worker, WorkerState.ACTIVE, "bootstrap port learnt")
        else:
            self.registry.update_info(worker, **facts)
        return True

    async def _resolve(self, worker: Worker) -> None:
        while self.registry.find(worker.id) is worker and worker.state is WorkerState.PENDING:
            if await self.learn(worker):
                return
            await asyncio.sleep(self.retry_interval)

    async def close(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        self._tasks.clear()
