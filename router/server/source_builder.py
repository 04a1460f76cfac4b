"""The worker sources the command line names (`--discovery-file`, `--discovery-etcd-endpoints`,
`--service-discovery`), built with the calls that register and remove a worker (the worker API's own, given by the
composition root), so a listed worker is registered and removed exactly as `POST /workers` and
`DELETE /workers/{id}` would."""

from __future__ import annotations

from typing import Awaitable, Callable

from router.control.discovery_file import WorkerFile
from router.control.worker_sources import Listing, SourceReconciler, WorkerSource, WorkerSources
from router.core.config import RouterConfig
from router.core.registry import Registry, Role, Worker

# (url with its credentials, role or None for the live one, bootstrap port or DISCOVER, source, read now, seed:
# a source's first listing, which seeds a cluster as a command line does, the peers' fields the worker keeps)
RegisterWorker = Callable[[str, "Role | None", object, str, bool, bool, dict], Awaitable[Worker]]
UnregisterWorker = Callable[[Worker, str], Awaitable[None]]  # (worker, by: how it goes)
ServerAnswers = Callable[[str], Awaitable["str | None"]]  # (url with its credentials) -> None, or why it does not


def build(config: RouterConfig, registry: Registry, register_worker: RegisterWorker,
          unregister_worker: UnregisterWorker, server_answers: ServerAnswers) -> WorkerSources:
    async def register(item: Listing, source: str, read: bool, seed: bool) -> Worker:
        return await register_worker(item.address, item.role, item.bootstrap_port, source, read, seed,
                                     item.settings_dict())

    def unregister_from(source: str):
        async def unregister(worker: Worker) -> None:
            await unregister_worker(worker, f"{source}: its entry gone or changed")
        return unregister

    async def answers(item: Listing) -> str | None:
        return await server_answers(item.address)

    def reconciler(name: str) -> SourceReconciler:
        return SourceReconciler(name, registry, register, unregister_from(name), answers)

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
    if settings.pod_discovery:
        # imported only here: a router without pod discovery never loads the Kubernetes client
        from router.control.kubernetes_pods import PodDiscovery, PodWorkerSource, selector_text

        pods = PodDiscovery.of(settings)
        where = pods.namespace or "all namespaces"
        shown = " / ".join(selector_text(s) for s in (pods.prefill_selector, pods.decode_selector, pods.selector)
                           if s)
        sources.append(PodWorkerSource(pods, reconciler(f"kubernetes pods {shown} ({where})"),
                                       retry_secs=config.health.interval_secs,
                                       startup_timeout=config.worker_startup_timeout_secs))
    return WorkerSources(sources)
