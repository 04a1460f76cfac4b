"""The worker sources the command line names (`--discovery-file`, `--discovery-etcd-endpoints`), wired to the
worker API's own calls, so a listed worker is registered and removed exactly as `POST /workers` and
`DELETE /workers/{id}` would."""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable, Protocol

from aiohttp import web

from router.api.workers import register_worker, unregister_worker
from router.control.discovery_file import WorkerFile
from router.control.worker_sources import Listing, SourceReconciler
from router.core.keys import CONFIG, REGISTRY
from router.core.registry import Worker


class WorkerSource(Protocol):
    reconciler: SourceReconciler

    async def load(self) -> None: ...
    def start(self, spawn: Callable[[Awaitable], asyncio.Task]) -> None: ...
    async def close(self) -> None: ...
    def to_dict(self) -> dict: ...


class WorkerSources:
    def __init__(self, sources: list[WorkerSource]) -> None:
        self.sources = sources

    async def load(self) -> None:
        """Every source's first listing, registered pending: read with the command line's workers."""
        await asyncio.gather(*(source.load() for source in self.sources))

    def start(self, spawn: Callable[[Awaitable], asyncio.Task]) -> None:
        for source in self.sources:
            source.start(spawn)

    async def close(self) -> None:
        await asyncio.gather(*(source.close() for source in self.sources))

    def to_dict(self) -> dict:
        return {"sources": [source.to_dict() for source in self.sources]}


def build(app: web.Application) -> WorkerSources:
    config = app[CONFIG]

    async def register(item: Listing, source: str, read: bool, seed: bool) -> Worker:
        # read in the background (a source does not wait for a server), or at start-up with the others
        return await register_worker(app, item.address, item.role, item.bootstrap_port, source=source,
                                     settle=0.0 if read else None, seed=seed)

    def unregister_from(source: str):
        async def unregister(worker: Worker) -> None:
            await unregister_worker(app, worker, by=f"{source}: its entry gone or changed")
        return unregister

    def reconciler(name: str) -> SourceReconciler:
        return SourceReconciler(name, app[REGISTRY], register, unregister_from(name))

    sources: list[WorkerSource] = []
    settings = config.worker_sources
    if settings.file:
        sources.append(WorkerFile(settings.file, reconciler(f"file {settings.file}"),
                                  interval_secs=settings.file_interval_secs, retry_secs=config.health.interval_secs))
    if settings.etcd_endpoints:
        # imported only here: a router started without etcd never loads router/cluster
        from router.cluster.discovery_watch import EtcdWorkerSource, discovery_prefix
        from router.cluster.etcd import EtcdClient

        client = EtcdClient(settings.etcd_endpoints, timeout=5.0, connect_timeout=1.0)
        sources.append(EtcdWorkerSource(client, settings.etcd_cluster_name,
                                        reconciler(f"etcd {discovery_prefix(settings.etcd_cluster_name)}"),
                                        retry_secs=config.health.interval_secs,
                                        startup_timeout=config.worker_startup_timeout_secs))
    return WorkerSources(sources)
