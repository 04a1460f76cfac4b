"""Simulated servers a test kills, replaces and brings back at the same address, beside a `Fleet`, and the
cluster's own record of the workers (read from etcd): what the removal and chaos tests check replicas against."""

from __future__ import annotations

from router.cluster.etcd import EtcdClient
from router.cluster.etcd_keys import ClusterKeys, decode
from simulator.fleet import Fleet, WorkerHandle
from simulator.worker import Worker


class Servers:
    """Servers started by the test (replacements, revivals): stopped with `close`."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.started: list[Worker] = []

    async def kill(self, handle: WorkerHandle) -> None:
        """The server dies: its port refuses connections, its requests end (aborted)."""
        if handle.worker is not None:
            await handle.worker.stop()

    async def start(self, role: str, *, port: int = 0) -> WorkerHandle:
        """A new server of `role` with the fleet's settings (on `port`: the address of a dead one again)."""
        worker = Worker(self.fleet.config.with_(role=role, port=port, bootstrap_port=0))
        await worker.start()
        self.started.append(worker)
        return WorkerHandle(role, worker.url, worker.port, worker.bootstrap_port, worker=worker)

    async def close(self) -> None:
        for worker in self.started:
            await worker.stop()


async def cluster_workers(endpoints: list[str], name: str) -> dict[str, tuple]:
    """The cluster's records of its workers: url -> (role, bootstrap port, state); and its removal records'
    URLs under the key None."""
    keys = ClusterKeys(name)
    async with EtcdClient(endpoints, timeout=5.0) as client:
        snapshot = await client.get_prefix(keys.prefix)
    records: dict = {}
    removed = []
    for kv in snapshot.kvs:
        kind, url = keys.kind_of(kv.key)
        if kind == "worker":
            record = decode(kv.value)
            records[url] = (record.get("role"), record.get("bootstrap_port"), record.get("state"))
        elif kind == "removed":
            removed.append(url)
    records[None] = sorted(removed)
    return records
