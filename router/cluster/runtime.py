"""One replica's part in a cluster: the pieces built from `--etcd-endpoints`, started and stopped with it.

Start-up (`start`, before the command line's workers are registered): take a lease and put this replica's
key, read the cluster's keys at one revision and apply them (the fleet's workers, their roles and states, the
fleet's weight version and holds), then keep them current from a watch. The command line's workers not in
the cluster yet are then registered and read as a lone router does, and each is published where still
absent (a compare-and-swap from "absent"); one that another replica published meanwhile is taken from etcd.
When etcd does not answer at start-up, the replica serves its command line's workers and joins (converging to
the cluster's state) as soon as etcd answers; until then control calls answer 503.

Shutdown (`close`, after the flows ended): the lease is revoked, so this replica's membership, acks and any
lock go at once instead of after the TTL.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable, Protocol

from router.cluster.applier import Applier
from router.cluster.barrier import BarrierResponder
from router.cluster.coordinator import EtcdCoordinator
from router.cluster.etcd import EtcdClient
from router.cluster.etcd_status import EtcdStatus
from router.cluster.etcd_types import EtcdError
from router.cluster.fleet_gate import FleetGate
from router.cluster.etcd_keys import ClusterKeys
from router.cluster.leadership import Leadership
from router.cluster.mirror import Mirror
from router.cluster.publisher import Publisher
from router.cluster.shared_records import fleet_record
from router.cluster.replica import Membership, ReplicaIdentity
from router.cluster.takeover import Takeover
from router.core.config import RouterConfig
from router.core.recovery import Recovery
from router.core.registry import Registry
from router.core.traffic import RequestPathControl

logger = logging.getLogger(__name__)

FLAG_FIELDS = ("paused", "memory_released")


class SharedFlags(Protocol):
    """The weight flow's state that the fleet shares beside its holds (the pause mode, released memory)."""

    def shared_state(self) -> dict: ...

    def adopt_shared_state(self, state: dict) -> None: ...


class Cluster:
    def __init__(self, config: RouterConfig, registry: Registry, traffic: RequestPathControl,
                 spawn: Callable[[Awaitable], asyncio.Task], *, replica_id: str) -> None:
        settings = config.cluster
        ttl = settings.lease_ttl_secs
        self.config = config
        self.registry = registry
        self.spawn = spawn
        self.keys = ClusterKeys(settings.name)
        self.identity = ReplicaIdentity.of_this_process(config.port, replica_id)
        self.client = EtcdClient(settings.etcd_endpoints, timeout=min(5.0, float(ttl)), connect_timeout=1.0)
        self.status = EtcdStatus(self.client, interval_s=max(ttl / 3, 0.5))
        self.membership = Membership(self.client, self.keys, self.identity, ttl)
        self.mirror = Mirror(self.client, self.keys.prefix)
        self._flags: dict = {}
        self._flow: SharedFlags | None = None
        self._tasks: list[asyncio.Task] = []
        self.publisher = Publisher(self.client, self.keys, self.mirror, registry, self.status, self.identity.id,
                                   fleet_now=self.fleet_record)
        self.leadership = Leadership(self.client, self.keys, self.mirror, self.membership)
        # before the gate, which names the fleet operation the coordinator runs (the coordinator stops `traffic`)
        self.coordinator = EtcdCoordinator(self.client, self.keys, self.mirror, self.membership, self.publisher,
                                           self.leadership, self.status, registry, traffic,
                                           ack_timeout_s=max(3.0 * ttl, 5.0), flush_timeout_s=max(2.0 * ttl, 3.0))
        self.gate = FleetGate(traffic, self.identity.id, self.publisher.note_fleet,
                              current_op=self.coordinator.fleet_op_id)
        self.applier = Applier(self.keys, registry, self.publisher, self.gate, apply_flags=self._adopt_flags)
        self.barrier = BarrierResponder(self.client, self.keys, registry, traffic, self.membership, spawn)
        self.takeover = Takeover(self.keys, self.mirror, self.membership, self.coordinator, self.gate, spawn)
        # Wired afterwards, as each side takes the other: the coordinator, the takeover and the applier (through
        # the publisher) read the mirror that tells them of its changes; the barrier acks under the membership's
        # lease and is told when it rejoins; the applier marks in the publisher what it applies, and the
        # publisher undoes a refused write through the applier.
        self.mirror.listeners += [self.coordinator.on_changes, self.applier.on_changes, self.barrier.on_changes,
                                  self.takeover.on_changes]
        self.membership.rejoined.append(self.barrier.rejoined)
        self.publisher.converge = self.applier.converge

    # ---- the fleet record and the weight flow's share of it --------------------------------------------
    def fleet_record(self) -> dict:
        flags = self._flow.shared_state() if self._flow is not None else self._flags
        return fleet_record(self.registry.fleet_version, dict(self.gate.closed), self.gate.silences,
                            {k: flags.get(k) for k in FLAG_FIELDS}, self.identity.id)

    def _adopt_flags(self, record: dict) -> None:
        self._flags = {k: record.get(k) for k in FLAG_FIELDS}
        if self._flow is not None:
            self._flow.adopt_shared_state(self._flags)

    def attach(self, flow: SharedFlags, recoveries: dict[str, Recovery]) -> None:
        """The flows, once they exist: the fleet-wide operations take the fleet's shared state, and the flows
        that recover their kinds of operation (by kind) let this replica take over orphaned ones."""
        self._flow = flow
        flow.adopt_shared_state(self._flags)
        self.takeover.recover_with(recoveries)

    # ---- life ------------------------------------------------------------------------------------------
    async def start(self, timeout: float) -> None:
        """Join and read the cluster's keys within `timeout`; then keep everything current in the background."""
        try:
            async with asyncio.timeout(timeout):
                await self.membership.join()
                await self.mirror.load()
            self.status.saw(True)
            logger.info("cluster %s: replica %s sees %d replica(s) and %d worker(s) at revision %d",
                        self.keys.name, self.identity.id, len(self.mirror.under(self.keys.replicas)),
                        len(self.mirror.under(self.keys.workers)), self.mirror.revision)
        except (EtcdError, TimeoutError) as exc:
            self.status.saw(False, str(exc) or "no answer in time")
            logger.warning("cluster %s: etcd %s did not answer at start-up (%s): serving the command line's "
                           "workers alone, joining when it answers; control calls answer 503 until then",
                           self.keys.name, ", ".join(self.client.endpoints), exc or "timeout")
        for job in (self.membership.run(), self.mirror.run(), self.status.run(), self.leadership.run(),
                    self.publisher.run(), self.takeover.run()):
            self._tasks.append(self.spawn(job))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.barrier.close()
        await self.coordinator.close()
        await self.membership.leave()
        await self.mirror.close()
        await self.client.close()
