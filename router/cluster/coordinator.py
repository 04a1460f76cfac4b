"""The flows' coordinator for replicas sharing a fleet through etcd (`router.core.coordination.Coordinator`).

An operation runs once in the cluster: `acquire` creates its lock (`locks/<scope>`, on this replica's lease)
and its record (`ops/<op-id>`) in one transaction that holds only while nobody holds the scope (a server's
operation also needs the fleet's scope free: nothing converts under a weight update). The record is written
again at each `progress` step and each barrier, fenced by the lock: a replica whose lease ended (etcd said
so, or it could not renew) cannot write for an operation another replica may have taken over. `release`
publishes what the operation changed, then deletes the lock and finishes the record in one transaction.

`stop_routing` is the ack barrier (see barrier.py): this replica's changes are written first, then the
barrier; it returns once every live replica (a key under `replicas/`) acked it. A replica whose lease ends
meanwhile is no longer waited for; one that stays alive without acking fails the operation after
`ack_timeout_s` (visibly: which replica did not confirm), before it changed anything on a server.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import Sequence

from router.cluster.etcd import EtcdClient
from router.cluster.etcd_status import EtcdStatus
from router.cluster.etcd_types import Compare, EtcdError, EtcdOutcomeUnknown, KeyValue, Op, RangeResult
from router.cluster.keys import ClusterKeys, decode, encode
from router.cluster.leadership import Leadership
from router.cluster.mirror import Mirror
from router.cluster.publisher import Fence, Publisher
from router.cluster.replica import Membership
from router.core.coordination import FLEET, StopAction, StopReport, Ticket
from router.core.errors import Conflict, ServiceUnavailable
from router.core.registry import Worker

logger = logging.getLogger(__name__)

HISTORY = 100  # finished operation records kept in etcd
RELEASE_RETRY_S = 0.5


class EtcdCoordinator:
    clustered = True

    def __init__(self, client: EtcdClient, keys: ClusterKeys, mirror: Mirror, membership: Membership,
                 publisher: Publisher, leadership: Leadership, status: EtcdStatus, *, ack_timeout_s: float,
                 flush_timeout_s: float = 10.0) -> None:
        self.client = client
        self.keys = keys
        self.mirror = mirror
        self.membership = membership
        self.publisher = publisher
        self.leadership = leadership
        self.status = status
        self.ack_timeout_s = ack_timeout_s
        self.flush_timeout_s = flush_timeout_s
        self.me = membership.identity.id
        self._ids = itertools.count(1)
        self._fences: dict[str, Fence] = {}  # scope -> the lock this replica holds
        self._records: dict[str, dict] = {}  # op id -> its record as this replica last wrote it
        self._seq: dict[str, int] = {}  # op id -> its last barrier
        self._releasing: set[asyncio.Task] = set()
        publisher.fence_for = self.fence_for
        publisher.locked_elsewhere = self.locked_elsewhere

    # ---- availability --------------------------------------------------------------------------------
    async def check_available(self, what: str) -> None:
        self._check_lease(what)
        try:
            await self.client.get(self.keys.fleet, timeout=self.client.timeout)
        except EtcdError as exc:
            raise self._unavailable(what, exc) from exc
        self.status.saw(True)

    def _check_lease(self, what: str) -> None:
        if not self.membership.alive:
            raise ServiceUnavailable(f"{what}: this replica has no etcd lease now (etcd unreachable: "
                                     f"{self.status.last_error or 'not joined yet'}); the replicas cannot agree "
                                     f"on a control operation, try again when etcd answers", cluster=self.keys.name)

    def _unavailable(self, what: str, exc: EtcdError) -> ServiceUnavailable:
        self.status.saw(False, str(exc))
        return ServiceUnavailable(f"{what}: etcd did not answer ({exc})", cluster=self.keys.name)

    @property
    def leading(self) -> bool:
        return self.leadership.leading

    # ---- locks -------------------------------------------------------------------------------------
    def fence_for(self, key: str) -> Fence | None:
        """The lock this replica holds that covers a worker's or the fleet's record."""
        kind, name = self.keys.kind_of(key)
        if kind == "worker" and (fence := self._fences.get(f"worker/{name}")) is not None:
            return fence
        return self._fences.get(FLEET)

    def locked_elsewhere(self, key: str) -> bool:
        kind, name = self.keys.kind_of(key)
        scopes = [FLEET] + ([f"worker/{name}"] if kind == "worker" else [])
        for scope in scopes:
            kv = self.mirror.get(self.keys.lock(scope))
            if kv is not None and self._fences.get(scope) is None:
                return True
        return False

    def _holder(self, kv: KeyValue | None) -> str:
        if kv is None:
            return "another replica"
        lock = decode(kv.value)
        return f"{lock.get('kind', 'an operation')} {lock.get('op', '')} on replica {lock.get('replica', '?')}"

    def fleet_operation_elsewhere(self) -> str | None:
        kv = self.mirror.get(self.keys.lock(FLEET))
        if kv is None or FLEET in self._fences:
            return None
        return self._holder(kv)

    # ---- acquire / progress / release --------------------------------------------------------------
    async def acquire(self, kind: str, scope: str, details: dict, *, wait_s: float = 0.0) -> Ticket:
        self._check_lease(kind)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        lock_key = self.keys.lock(scope)
        needed = [lock_key] + ([self.keys.lock(FLEET)] if scope.startswith("worker/") else [])
        while True:
            op_id = f"{self.me}.{next(self._ids)}"
            record = {"id": op_id, "kind": kind, "scope": scope, "owner": self.me, "state": "running",
                      "step": "start", "started_at": round(time.time(), 3), "details": details, "barrier": None}
            lock = {"op": op_id, "kind": kind, "replica": self.me}
            lease = self.membership.lease_id
            if not lease:
                raise ServiceUnavailable(f"{kind}: this replica has no etcd lease now", cluster=self.keys.name)
            try:
                result = await self.client.txn(
                    [Compare.absent(key) for key in needed],
                    [Op.put(lock_key, encode(lock), lease=lease), Op.put(self.keys.op(op_id), encode(record))],
                    [Op.get(key) for key in needed])
            except EtcdOutcomeUnknown as exc:
                current = await self._read(lock_key, kind)
                if current is None or decode(current.value).get("op") != op_id:
                    raise self._unavailable(kind, exc) from exc
                result = None  # it was applied after all
                revision = current.create_revision
            except EtcdError as exc:
                raise self._unavailable(kind, exc) from exc
            else:
                self.status.saw(True)
                revision = result.revision
            if result is None or result.succeeded:
                self._fences[scope] = Fence(lock_key, revision)
                self._records[op_id] = record
                logger.info("cluster: %s %s acquired %s", kind, op_id, scope)
                return Ticket(op_id, kind, scope, details=details)
            holders = [r.kvs[0] for r in result.responses if isinstance(r, RangeResult) and r.kvs]
            left = deadline - loop.time()
            if left <= 0:
                raise Conflict(f"{kind} refused: {self._holder(holders[0] if holders else None)} is running "
                               f"(one operation per server, and none while a fleet-wide operation runs)",
                               cluster=self.keys.name)
            await self.mirror.wait_for(lambda: all(self.mirror.get(k) is None for k in needed), left)

    async def _read(self, key: str, what: str) -> KeyValue | None:
        try:
            return await self.client.get(key)
        except EtcdError as exc:
            raise self._unavailable(what, exc) from exc

    async def progress(self, ticket: Ticket, step: str) -> None:
        await self._update(ticket, step=step)

    async def _update(self, ticket: Ticket, **changes) -> None:
        """Write the operation's record again, only while its lock is this replica's."""
        fence = self._fences.get(ticket.scope)
        record = self._records.get(ticket.op_id)
        if fence is None or record is None:
            raise ServiceUnavailable(f"{ticket.kind} {ticket.op_id}: this replica no longer runs it",
                                     cluster=self.keys.name)
        record.update(changes)
        try:
            result = await self.client.txn([Compare.create_revision(fence.key, "==", fence.revision)],
                                           [Op.put(self.keys.op(ticket.op_id), encode(record))])
        except EtcdError as exc:
            raise self._unavailable(f"{ticket.kind} {ticket.op_id}", exc) from exc
        if not result.succeeded:
            self._fences.pop(ticket.scope, None)
            raise ServiceUnavailable(f"{ticket.kind} {ticket.op_id}: this replica lost it (its lease ended; another "
                                     f"replica may have taken it over)", cluster=self.keys.name)

    async def release(self, ticket: Ticket, outcome: str, message: str = "") -> None:
        if ticket.scope == FLEET:
            self.publisher.note_fleet()  # the flow's shared flags (pause mode, released memory) as they end
        try:
            await self.publisher.flush(self.flush_timeout_s)
        except ServiceUnavailable as exc:
            logger.warning("cluster: %s %s ends with changes not yet shared: %s", ticket.kind, ticket.op_id, exc)
        if not await self._finish(ticket, outcome, message):
            task = asyncio.ensure_future(self._finish_later(ticket, outcome, message))
            self._releasing.add(task)
            task.add_done_callback(self._releasing.discard)

    async def _finish(self, ticket: Ticket, outcome: str, message: str) -> bool:
        """Delete the lock and finish the record together; True when done (or no longer ours)."""
        fence = self._fences.get(ticket.scope)
        record = self._records.get(ticket.op_id)
        if fence is None or record is None:
            return True
        record.update(state="done", outcome=outcome, message=message[:1000], ended_at=round(time.time(), 3))
        old = self._finished_to_forget()
        try:
            result = await self.client.txn(
                [Compare.create_revision(fence.key, "==", fence.revision)],
                [Op.delete(fence.key), Op.put(self.keys.op(ticket.op_id), encode(record)),
                 *(Op.delete(key) for key in old)])
        except EtcdError as exc:
            self.status.saw(False, str(exc))
            logger.warning("cluster: releasing %s %s failed (%s); retrying", ticket.kind, ticket.op_id, exc)
            return False
        if not result.succeeded:
            logger.warning("cluster: %s %s was no longer this replica's when it ended (%s)", ticket.kind,
                           ticket.op_id, outcome)
        self._fences.pop(ticket.scope, None)
        self._records.pop(ticket.op_id, None)
        self._seq.pop(ticket.op_id, None)
        return True

    async def _finish_later(self, ticket: Ticket, outcome: str, message: str) -> None:
        """etcd did not answer: keep trying while the lease lives (after it, the lock is gone anyway)."""
        while self.membership.alive and not await self._finish(ticket, outcome, message):
            # a retry cadence, not a wait for a condition: etcd is not answering
            await asyncio.sleep(RELEASE_RETRY_S)
        self._fences.pop(ticket.scope, None)

    def _finished_to_forget(self) -> list[str]:
        done = [kv for kv in self.mirror.under(self.keys.ops) if decode(kv.value).get("state") == "done"]
        done.sort(key=lambda kv: kv.mod_revision)
        return [kv.key for kv in done[:max(len(done) - HISTORY, 0)]][:32]

    # ---- the barrier -------------------------------------------------------------------------------
    def replicas(self) -> list[str]:
        """The other live replicas (their keys under replicas/)."""
        return [self.keys.kind_of(kv.key)[1] for kv in self.mirror.under(self.keys.replicas)
                if self.keys.kind_of(kv.key)[1] != self.me]

    def _acks(self, ticket: Ticket) -> dict[str, dict]:
        """The current barrier's acks of the live replicas, by replica."""
        seq = self._seq.get(ticket.op_id, 0)
        acks = {}
        for replica in self.replicas():
            kv = self.mirror.get(self.keys.ack(ticket.op_id, replica))
            ack = decode(kv.value) if kv is not None else {}
            if ack.get("seq") == seq:
                acks[replica] = ack
        return acks

    async def stop_routing(self, ticket: Ticket, workers: Sequence[Worker] | None, action: StopAction) -> StopReport:
        await self.publisher.flush(self.flush_timeout_s)
        seq = self._seq.get(ticket.op_id, 0) + 1
        self._seq[ticket.op_id] = seq
        barrier = {"seq": seq, "action": action.value, "at": round(time.time(), 3),
                   "workers": None if workers is None else [w.url for w in workers]}
        await self._update(ticket, barrier=barrier)
        confirmed = await self.mirror.wait_for(lambda: set(self._acks(ticket)) >= set(self.replicas()),
                                               self.ack_timeout_s)
        acks = self._acks(ticket)
        if not confirmed:
            missing = sorted(set(self.replicas()) - set(acks))
            raise ServiceUnavailable(f"{ticket.kind} {ticket.op_id}: replica(s) {', '.join(missing)} did not confirm "
                                     f"within {self.ack_timeout_s:g} s that they stopped routing to the servers "
                                     f"concerned; nothing was changed on them", cluster=self.keys.name,
                                     replicas=missing)
        return StopReport(replicas=len(acks), marked=sum(int(a.get("marked", 0)) for a in acks.values()),
                          inflight=sum(int(a.get("inflight", 0)) for a in acks.values()))

    def inflight_elsewhere(self, ticket: Ticket, worker: Worker) -> int:
        return sum(int(ack.get("counts", {}).get(worker.url, 0)) for ack in self._acks(ticket).values())

    async def wait_idle_elsewhere(self, ticket: Ticket) -> None:
        def idle() -> bool:
            acks = self._acks(ticket)
            return all(int(acks.get(r, {}).get("inflight", 1)) == 0 for r in self.replicas())
        while not await self.mirror.wait_for(idle, 3600.0):
            pass

    async def wait_worker_operations_elsewhere(self, timeout: float) -> list[str]:
        """Conversions and reinstates of other replicas, and those whose owner died until they are taken over."""
        def running() -> list[str]:
            return [f"{r.get('kind')} {r.get('id')} of replica {r.get('owner')}" for r in self.running()
                    if str(r.get("scope", "")).startswith("worker/") and r.get("id") not in self._records]
        await self.mirror.wait_for(lambda: not running(), timeout)
        return running()

    def fleet_op_id(self) -> str | None:
        """The fleet-wide operation this replica runs now (its holds are that operation's)."""
        fence = self._fences.get(FLEET)
        return next((op_id for op_id, r in self._records.items() if r.get("scope") == FLEET), None) \
            if fence is not None else None

    # ---- takeover ----------------------------------------------------------------------------------------
    async def adopt(self, kv: KeyValue) -> Ticket | None:
        """Take over a running operation whose lock is gone (its owner's lease ended): its lock again, on this
        replica's lease, and its record naming this replica, if nobody did first. None when another did."""
        record = decode(kv.value)
        scope, op_id, lease = str(record.get("scope", "")), str(record.get("id", "")), self.membership.lease_id
        if not scope or not op_id or not lease:
            return None
        lock_key = self.keys.lock(scope)
        adopted = {**record, "owner": self.me, "taken_over_from": record.get("owner"),
                   "taken_over_at": round(time.time(), 3), "barrier": None}
        lock = {"op": op_id, "kind": record.get("kind"), "replica": self.me, "takeover": True}
        try:
            result = await self.client.txn(
                [Compare.absent(lock_key), Compare.mod_revision(kv.key, "==", kv.mod_revision)],
                [Op.put(lock_key, encode(lock), lease=lease), Op.put(kv.key, encode(adopted))])
        except EtcdError as exc:
            self.status.saw(False, str(exc))
            return None
        if not result.succeeded:
            return None
        self._fences[scope] = Fence(lock_key, result.revision)
        self._records[op_id] = adopted
        return Ticket(op_id, str(record.get("kind")), scope, details=record.get("details") or {})

    # ---- workers ---------------------------------------------------------------------------------------
    async def publish(self) -> None:
        await self.publisher.flush(self.flush_timeout_s)

    async def remove_worker(self, worker: Worker) -> None:
        self._check_lease("remove worker")
        key, lock = self.keys.worker(worker.url), self.keys.lock(f"worker/{worker.url}")
        try:
            result = await self.client.txn([Compare.absent(lock)], [Op.delete(key)], [Op.get(lock)])
        except EtcdError as exc:
            raise self._unavailable("remove worker", exc) from exc
        if not result.succeeded:
            held = result.responses[0].kvs[0] if result.responses and result.responses[0].kvs else None
            raise Conflict(f"worker {worker.url}: {self._holder(held)} is running on it; wait for it to end",
                           cluster=self.keys.name)
        self.publisher.deleted(key, result.revision)
        self.status.saw(True)

    async def close(self) -> None:
        for task in list(self._releasing):
            task.cancel()
        await asyncio.gather(*self._releasing, return_exceptions=True)

    def running(self) -> list[dict]:
        """The operations running in the cluster now (their records), oldest first."""
        found = [decode(kv.value) for kv in self.mirror.under(self.keys.ops)]
        return sorted((r for r in found if r.get("state") == "running"), key=lambda r: r.get("started_at", 0))

