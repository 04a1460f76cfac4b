"""Operations whose owner died: one live replica takes each over, and the flow it belongs to finishes it.

An operation's lock is on its owner's lease; its record stays. When the watch shows a running record whose
lock is gone (and at start-up, for records left by replicas that are all gone), every replica races to take
it over (`EtcdCoordinator.adopt`: a transaction only one wins). The winner hands the record to the flow of its
kind (`core/recovery.py`: the conversion flow recovers a conversion, `flows/conversion_recovery.py`; the
weight-update flow settles an update's version, `WeightUpdates.recover`), under `while_owned` so that its
waits end if this replica loses it in turn, and closes the record with the flow's outcome, within a few
seconds of the owner's death (its lease's TTL). A weight update's hold on admission is released then.
Operations with nothing half-done to finish (reinstate, abort_all) or whose fleet-wide state stays as it
stood (pause, continue, memory release/resume: repeat the call at any replica) are closed as failed.
No server is left out of every pool without a reason in its state. Nothing is taken over until the flows
are attached (`recover_with`, by the composition root once they exist): an orphan waits until then.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

from router.cluster.coordinator import EtcdCoordinator
from router.cluster.fleet_gate import FleetGate
from router.cluster.etcd_keys import ClusterKeys, decode
from router.cluster.mirror import Change, Mirror
from router.cluster.replica import Membership
from router.core.coordination import Ticket, while_owned
from router.core.errors import RouterError
from router.core.recovery import Recovery

logger = logging.getLogger(__name__)


class Takeover:
    def __init__(self, keys: ClusterKeys, mirror: Mirror, membership: Membership, coordinator: EtcdCoordinator,
                 gate: FleetGate, spawn: Callable[[Awaitable], asyncio.Task]) -> None:
        self.keys = keys
        self.mirror = mirror
        self.membership = membership
        self.coordinator = coordinator
        self.gate = gate
        self.spawn = spawn
        self.recoveries: dict[str, Recovery] | None = None  # by operation kind; None until the flows exist
        self.taken: list[dict] = []  # the last operations this replica took over (for the cluster view)
        self.count = 0
        self._running: set[str] = set()
        self._wake = asyncio.Event()

    def recover_with(self, recoveries: dict[str, Recovery]) -> None:
        """The flows that finish their kinds of operation; taking over starts now."""
        self.recoveries = dict(recoveries)
        self._wake.set()

    def on_changes(self, changes: list[Change]) -> None:
        if any(self.keys.kind_of(c.key)[0] in ("lock", "op") for c in changes):
            self._wake.set()

    async def run(self) -> None:
        """Scan on every change of locks and records, and every lease TTL anyway (cancel to stop)."""
        while True:
            self.scan()
            try:
                async with asyncio.timeout(self.membership.ttl):
                    await self._wake.wait()
            except TimeoutError:
                pass
            self._wake.clear()

    def orphans(self) -> list:
        """Running records whose lock is gone or held for another operation."""
        found = []
        for kv in self.mirror.under(self.keys.ops):
            record = decode(kv.value)
            if record.get("state") != "running" or not record.get("scope"):
                continue
            lock = self.mirror.get(self.keys.lock(str(record["scope"])))
            if lock is None or decode(lock.value).get("op") != record.get("id"):
                found.append(kv)
        return found

    def scan(self) -> None:
        if not self.membership.alive or self.recoveries is None:
            return
        for kv in self.orphans():
            op_id = str(decode(kv.value).get("id"))
            if op_id not in self._running:
                self._running.add(op_id)
                task = self.spawn(self._take(kv))
                task.add_done_callback(lambda _t, op_id=op_id: self._running.discard(op_id))

    async def _take(self, kv) -> None:
        ticket = await self.coordinator.adopt(kv)
        if ticket is None:
            return  # another replica took it (or etcd did not answer: the next scan tries again)
        record = decode(kv.value)
        started = time.monotonic()
        logger.warning("cluster: replica %s takes over %s %s from replica %s, whose lease ended",
                       self.membership.identity.id, ticket.kind, ticket.op_id, record.get("owner"))
        outcome, message = "failed", "taken over: nothing to finish"
        recovery = (self.recoveries or {}).get(ticket.kind)
        try:
            if recovery is not None:
                outcome, message = await while_owned(self.coordinator, ticket, recovery.recover(ticket, record))
                self._open_gate_of(ticket)  # an update's own hold (a pause's or a memory hold stays)
            else:
                message = (f"its owner {record.get('owner')} died during {ticket.kind}; closed by replica "
                           f"{self.membership.identity.id} (repeat the call if it is still wanted)")
        except RouterError as exc:  # lost in turn: left to the next replica
            message = exc.message
        except Exception as exc:  # the record must still end; the worker's state says what is known
            logger.exception("cluster: taking over %s %s failed", ticket.kind, ticket.op_id)
            message = f"takeover failed: {type(exc).__name__}: {exc}"
        finally:
            self.taken.append({"op": ticket.op_id, "kind": ticket.kind, "from": record.get("owner"),
                               "outcome": outcome, "message": message, "at": round(time.time(), 3),
                               "duration_s": round(time.monotonic() - started, 3)})
            del self.taken[:-20]
            self.count += 1
            await self.coordinator.release(ticket, outcome, message)
        logger.warning("cluster: %s %s taken over: %s (%s)", ticket.kind, ticket.op_id, outcome, message)

    def _open_gate_of(self, ticket: Ticket) -> None:
        for reason, info in list(self.gate.closed.items()):
            if isinstance(info, dict) and info.get("op") == ticket.op_id:
                self.gate.open_gate(reason)
