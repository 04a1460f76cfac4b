"""Router replicas sharing a simulated fleet through a real etcd, in this process: each an app on its own
loopback port with its own registry, admission, flows and etcd client (what a replica process has), started
and stopped one by one. (tests/cluster/test_replicas_e2e.py runs them as real processes.)"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import aiohttp
import orjson
from aiohttp.test_utils import TestClient, TestServer

from router.cluster.view import CLUSTER
from router.core.config import ClusterConfig, HealthConfig, RouterConfig, WorkerSpec
from router.core.keys import REGISTRY
from router.dataplane.admission import ADMISSION
from router.server.app import create_app
from simulator.fleet import Fleet

SIM = dict(health_check_s=0.0, bootstrap_retries=3, bootstrap_retry_interval_s=0.02, deferred_release_s=0.0,
           decode_step_s=0.003)
BODY = {"text": "the quick brown fox", "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
TTL = 2


def cluster_config(fleet: Fleet, endpoints: list[str], *, name: str = "test", workers: int | None = None,
                   **overrides) -> RouterConfig:
    """A replica's config: the fleet's first `workers` prefill and decode servers on its command line."""
    prefill, decode = fleet.prefill[:workers], fleet.decode[:workers]
    options = {"health": HealthConfig(enabled=False), **overrides}
    return RouterConfig(prefill=tuple(WorkerSpec(h.url, h.bootstrap_port) for h in prefill),
                        decode=tuple(WorkerSpec(h.url) for h in decode),
                        cluster=ClusterConfig(etcd_endpoints=tuple(endpoints), name=name, lease_ttl_secs=TTL),
                        **options).validated()


@dataclass
class Replica:
    client: TestClient
    answers: list = field(default_factory=list)

    @property
    def app(self):
        return self.client.app

    @property
    def registry(self):
        return self.app[REGISTRY]

    @property
    def cluster(self):
        return self.app[CLUSTER]

    @property
    def admission(self):
        return self.app[ADMISSION]

    def worker(self, handle):
        return self.registry.find(handle.url)

    def view(self) -> list[tuple]:
        """The fleet as this replica routes it: (url, role, bootstrap port, state, routable)."""
        return sorted((w.url, w.role.value, w.bootstrap_port, w.state.value, w.routable)
                      for w in self.registry.workers())

    async def call(self, method: str, path: str, body: dict | None = None) -> tuple[int, object]:
        resp = await self.client.request(method, path, json=body)
        raw = await resp.read()
        return resp.status, (orjson.loads(raw) if raw else None)

    async def generate(self, body: dict = BODY) -> tuple[int, dict | None]:
        resp = await self.client.post("/generate", json=body)
        raw = await resp.read()
        return resp.status, (orjson.loads(raw) if resp.status == 200 else {"error": raw[:300]})

    async def close(self) -> None:
        await self.client.close()


async def start_replica(config: RouterConfig) -> Replica:
    client = TestClient(TestServer(create_app(config), handler_cancellation=True),
                        timeout=aiohttp.ClientTimeout(total=60))
    await client.start_server()
    return Replica(client)


class Load:
    """`concurrency` clients per replica sending requests back to back until stopped; every answer kept as
    (replica index, status, finish reason or error)."""

    def __init__(self, replicas: list[Replica], concurrency: int = 3, body: dict = BODY) -> None:
        self.replicas = replicas
        self.concurrency = concurrency
        self.body = body
        self.answers: list[tuple[int, int, str]] = []
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    async def _user(self, index: int) -> None:
        replica = self.replicas[index % len(self.replicas)]
        while not self._stop.is_set():
            status, answer = await replica.generate(self.body)
            reason = answer["meta_info"]["finish_reason"]["type"] if status == 200 else str(answer)
            self.answers.append((index % len(self.replicas), status, reason))

    def start(self) -> "Load":
        self._tasks = [asyncio.ensure_future(self._user(i)) for i in range(self.concurrency * len(self.replicas))]
        return self

    async def finish(self) -> list[tuple[int, int, str]]:
        self._stop.set()
        await asyncio.gather(*self._tasks)
        return self.answers

    def failed(self) -> list[tuple[int, int, str]]:
        return [a for a in self.answers if a[1] != 200 or a[2] not in ("length", "stop")]
