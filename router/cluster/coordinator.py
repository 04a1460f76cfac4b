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
from dataclasses import dataclass, field
from typing import Callable, Sequence

from router.cluster.etcd import EtcdClient
from router.cluster.etcd_status import EtcdStatus
from router.cluster.etcd_lease import LeaseKeeper
from router.cluster.etcd_types import Compare, EtcdError, EtcdOutcomeUnknown, KeyValue, Op, RangeResult
from router.cluster.etcd_keys import ClusterKeys, decode, encode
from router.cluster.leadership import Leadership
from router.cluster.mirror import Change, Mirror
from router.cluster.publisher import Fence, Publisher
from router.cluster.shared_records import describe_removal, removal_record
from router.cluster.replica import Membership
from router.core.coordination import FLEET, StopAction, StopReport, Ticket, stop_here
from router.core.errors import Conflict, ServiceUnavailable
from router.core.registry import Registry, Worker
from router.core.traffic import MarkTally, RequestPathControl

logger = logging.getLogger(__name__)

HISTORY = 100  # finished operation records kept in etcd
# Removal records kept (`removed/<url>`): beyond it the oldest are forgotten, a few per removal. Plenty for
# command lines (which name tens of servers); a fleet whose URLs churn (new pods, new addresses) stays bounded.
MAX_REMOVALS = 1000
RELEASE_RETRY_S = 0.5


@dataclass(eq=False)
class _Owned:
    """An operation this replica runs: its lock (the fence of every write for it), its record as last written,
    and the lease both are on. It stops being this replica's the moment that lease is lost, or its lock is seen
    deleted or another's (`ended`, with why): from then on nothing is written for it, and its waits end."""

    op_id: str
    scope: str
    fence: Fence
    record: dict
    lease: LeaseKeeper
    seq: int = 0  # its last barrier
    finishing: bool = False  # its lock is being deleted by this replica (the deletion is no loss)
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    why: str = ""


class EtcdCoordinator:
    clustered = True

    def __init__(self, client: EtcdClient, keys: ClusterKeys, mirror: Mirror, membership: Membership,
                 publisher: Publisher, leadership: Leadership, status: EtcdStatus, registry: Registry,
                 traffic: RequestPathControl, *, ack_timeout_s: float, flush_timeout_s: float = 10.0) -> None:
        """`registry`, `traffic`: this replica's own, which `stop_routing` stops first (`stop_here`)."""
        self.client = client
        self.registry = registry
        self.traffic = traffic
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
        self._owned: dict[str, _Owned] = {}  # scope -> the operation this replica runs on it
        self._releasing: set[asyncio.Task] = set()
        publisher.fence_for = self.fence_for
        publisher.locked_elsewhere = self.locked_elsewhere
        membership.on_lost.append(self._lease_lost)

    # ---- availability --------------------------------------------------------------------------------
    async def check_available(self, what: str) -> None:
        self._check_lease(what)
        try:
            await self.client.get(self.keys.fleet, timeout=self.client.timeout)
        except EtcdError as exc:
            raise self._unavailable(what, exc) from exc
        self.status.saw(True)

    def _check_lease(self, what: str) -> LeaseKeeper:
        """The lease to act on; 503 while there is none, or it cannot be trusted (a renewal is overdue)."""
        lease = self.membership.trusted()
        if lease is not None:
            return lease
        if self.membership.alive:
            overdue = self.membership.ttl - self.membership.lease.time_left()
            why = (f"its etcd lease was not renewed for {overdue:.1f} s of its {self.membership.ttl} s TTL (etcd not "
                   f"answering: {self.status.last_error or 'no answer'})")
        else:
            why = f"this replica has no etcd lease now (etcd unreachable: {self.status.last_error or 'not joined yet'})"
        raise ServiceUnavailable(f"{what}: {why}; the replicas cannot agree on a control operation, try again when "
                                 f"etcd answers", cluster=self.keys.name)

    def _unavailable(self, what: str, exc: EtcdError) -> ServiceUnavailable:
        self.status.saw(False, str(exc))
        return ServiceUnavailable(f"{what}: etcd did not answer ({exc})", cluster=self.keys.name)

    @property
    def leading(self) -> bool:
        return self.leadership.leading

    # ---- what this replica owns ----------------------------------------------------------------------
    def _mine(self, scope: str) -> _Owned | None:
        """The operation this replica runs on `scope`, while it is still this replica's."""
        owned = self._owned.get(scope)
        if owned is not None and not owned.lease.alive:
            self._end(owned, f"its etcd lease ended ({owned.lease.lost_reason or 'lost'})")
            return None
        return owned

    def _of(self, ticket: Ticket) -> _Owned | None:
        owned = self._mine(ticket.scope)
        return owned if owned is not None and owned.op_id == ticket.op_id else None

    def _end(self, owned: _Owned, why: str) -> None:
        """It is no longer this replica's: nothing more is written for it, its waits end (503 naming why)."""
        if self._owned.get(owned.scope) is owned:
            del self._owned[owned.scope]
        if not owned.ended.is_set():
            owned.why = why
            owned.ended.set()
            logger.warning("cluster: %s %s is no longer this replica's: %s", owned.record.get("kind"), owned.op_id,
                           why)

    def _lease_lost(self, lease: LeaseKeeper) -> None:
        for owned in [o for o in self._owned.values() if o.lease is lease]:
            self._end(owned, f"its etcd lease ended ({lease.lost_reason or 'lost'})")

    def on_changes(self, changes: list[Change]) -> None:
        """A mirror listener: a lock of this replica deleted or another's (its lease ended in etcd, or it was
        revoked when this replica joined again) means the operation is not this replica's any more."""
        for change in changes:
            kind, scope = self.keys.kind_of(change.key)
            owned = self._owned.get(scope) if kind == "lock" else None
            if owned is None or owned.finishing or change.revision <= owned.fence.revision:
                continue
            if change.new is None or change.new.create_revision != owned.fence.revision:
                self._end(owned, "its lock was deleted in etcd (its lease ended there)" if change.new is None
                          else "its lock is another operation's now")

    def lost_error(self, ticket: Ticket, why: str) -> ServiceUnavailable:
        return ServiceUnavailable(f"{ticket.kind} {ticket.op_id}: this replica lost it ({why}); another replica "
                                  f"takes it over (GET /admin/cluster shows it)", cluster=self.keys.name,
                                  lost=ticket.op_id)

    async def wait_lost(self, ticket: Ticket) -> ServiceUnavailable:
        owned = self._of(ticket)
        if owned is None:
            return self.lost_error(ticket, "this replica no longer runs it")
        lease, ended = asyncio.ensure_future(owned.lease.wait_lost()), asyncio.ensure_future(owned.ended.wait())
        try:
            await asyncio.wait((lease, ended), return_when=asyncio.FIRST_COMPLETED)
        finally:
            lease.cancel()
            ended.cancel()
        self._mine(owned.scope)  # ends it, if its lease is what ended
        return self.lost_error(ticket, owned.why or "its etcd lease ended")

    async def _wait(self, ticket: Ticket, condition: Callable[[], bool], timeout: float) -> bool:
        """mirror.wait_for(condition, timeout), ended early (ServiceUnavailable) when the operation stops being
        this replica's: no wait of an operation outlives its owner's lease."""
        owned = self._of(ticket)
        if owned is None:
            raise self.lost_error(ticket, "this replica no longer runs it")
        met = asyncio.ensure_future(self.mirror.wait_for(condition, timeout))
        lost = asyncio.ensure_future(self.wait_lost(ticket))
        try:
            await asyncio.wait((met, lost), return_when=asyncio.FIRST_COMPLETED)
        finally:
            met.cancel()
            lost.cancel()
        if met.done() and not met.cancelled():
            return met.result()
        raise lost.result()

    # ---- locks -------------------------------------------------------------------------------------
    def fence_for(self, key: str) -> Fence | None:
        """The lock this replica holds that covers a worker's or the fleet's record."""
        kind, name = self.keys.kind_of(key)
        if kind == "worker" and (owned := self._mine(f"worker/{name}")) is not None:
            return owned.fence
        owned = self._mine(FLEET)
        return owned.fence if owned is not None else None

    def locked_elsewhere(self, key: str) -> bool:
        """A lock covering the record is in etcd and not this replica's (a lock of an operation this replica
        lost counts as another's: its record stands, what this replica changed under it is undone)."""
        kind, name = self.keys.kind_of(key)
        scopes = [FLEET] + ([f"worker/{name}"] if kind == "worker" else [])
        for scope in scopes:
            kv = self.mirror.get(self.keys.lock(scope))
            if kv is not None and self._mine(scope) is None:
                return True
        return False

    def _holder(self, kv: KeyValue | None) -> str:
        if kv is None:
            return "another replica"
        lock = decode(kv.value)
        return f"{lock.get('kind', 'an operation')} {lock.get('op', '')} on replica {lock.get('replica', '?')}"

    def fleet_operation_elsewhere(self) -> str | None:
        kv = self.mirror.get(self.keys.lock(FLEET))
        if kv is None or self._mine(FLEET) is not None:
            return None
        return self._holder(kv)

    # ---- acquire / progress / release --------------------------------------------------------------
    async def acquire(self, kind: str, scope: str, details: dict, *, wait_s: float = 0.0) -> Ticket:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        lock_key = self.keys.lock(scope)
        needed = [lock_key] + ([self.keys.lock(FLEET)] if scope.startswith("worker/") else [])
        while True:
            lease = self._check_lease(kind)  # a lease lost or overdue: refused before anything is written
            op_id = f"{self.me}.{next(self._ids)}"
            record = {"id": op_id, "kind": kind, "scope": scope, "owner": self.me, "state": "running",
                      "step": "start", "started_at": round(time.time(), 3), "details": details, "barrier": None}
            lock = {"op": op_id, "kind": kind, "replica": self.me}
            try:
                result = await self.client.txn(
                    [Compare.absent(key) for key in needed],
                    [Op.put(lock_key, encode(lock), lease=lease.id), Op.put(self.keys.op(op_id), encode(record))],
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
                fence = Fence(lock_key, revision)
                if not lease.alive or self.membership.lease is not lease:
                    # etcd answered after this replica had called the lease lost: the lock is on a lease that
                    # may end any moment, and whatever it guards may be another's by then. Given back.
                    await self._give_back(fence, op_id, record, kind)
                    raise ServiceUnavailable(f"{kind}: this replica's etcd lease ended while it acquired {scope}; "
                                             f"nothing was changed, try again", cluster=self.keys.name)
                self._owned[scope] = _Owned(op_id, scope, fence, record, lease)
                logger.info("cluster: %s %s acquired %s", kind, op_id, scope)
                return Ticket(op_id, kind, scope, details=details)
            holders = [r.kvs[0] for r in result.responses if isinstance(r, RangeResult) and r.kvs]
            left = deadline - loop.time()
            if left <= 0:
                raise Conflict(f"{kind} refused: {self._holder(holders[0] if holders else None)} is running "
                               f"(one operation per server, and none while a fleet-wide operation runs)",
                               cluster=self.keys.name)
            lost = asyncio.ensure_future(lease.wait_lost())
            free = asyncio.ensure_future(self.mirror.wait_for(lambda: all(self.mirror.get(k) is None for k in needed),
                                                              left))
            try:  # the turn comes, or the lease ends (then refused at once, above)
                await asyncio.wait((lost, free), return_when=asyncio.FIRST_COMPLETED)
            finally:
                lost.cancel()
                free.cancel()

    async def _give_back(self, fence: Fence, op_id: str, record: dict, kind: str) -> None:
        """A lock just taken on a lease called lost: deleted, its record finished. When the lock went first
        (the lease revoked as this replica joined again), the record is finished unless another replica
        already adopted it (then that replica closes it)."""
        key = self.keys.op(op_id)
        done = encode({**record, "state": "done", "outcome": "refused", "ended_at": round(time.time(), 3),
                       "message": "acquired on a lease that had ended meanwhile; given back"})
        try:
            result = await self.client.txn([Compare.create_revision(fence.key, "==", fence.revision)],
                                           [Op.delete(fence.key), Op.put(key, done)])
            if not result.succeeded:
                await self.client.txn([Compare.mod_revision(key, "==", fence.revision)], [Op.put(key, done)])
        except EtcdError as exc:
            logger.warning("cluster: %s %s taken on a lost lease not given back (%s): it goes with the lease, and "
                           "its record is closed by a replica taking it over", kind, op_id, exc)

    async def _read(self, key: str, what: str) -> KeyValue | None:
        try:
            return await self.client.get(key)
        except EtcdError as exc:
            raise self._unavailable(what, exc) from exc

    async def progress(self, ticket: Ticket, step: str) -> None:
        await self._update(ticket, step=step)

    async def _update(self, ticket: Ticket, **changes) -> None:
        """Write the operation's record again, only while its lock is this replica's."""
        owned = self._of(ticket)
        if owned is None:
            raise self.lost_error(ticket, "this replica no longer runs it")
        owned.record.update(changes)
        try:
            result = await self.client.txn([Compare.create_revision(owned.fence.key, "==", owned.fence.revision)],
                                           [Op.put(self.keys.op(ticket.op_id), encode(owned.record))])
        except EtcdError as exc:
            raise self._unavailable(f"{ticket.kind} {ticket.op_id}", exc) from exc
        if not result.succeeded:
            self._end(owned, "its lock is gone (its lease ended)")
            raise self.lost_error(ticket, "its lock is gone: its lease ended")
        if self._of(ticket) is None:  # the lease was called lost while etcd took the write
            raise self.lost_error(ticket, owned.why or "its etcd lease ended")

    async def release(self, ticket: Ticket, outcome: str, message: str = "") -> None:
        owned = self._of(ticket)
        if owned is None:  # lost: nothing of it is this replica's to write; the replica taking it over ends it
            logger.warning("cluster: %s %s ended here (%s) after this replica lost it; its record is left to the "
                           "replica that takes it over", ticket.kind, ticket.op_id, outcome)
            return
        if ticket.scope == FLEET:
            self.publisher.note_fleet()  # the flow's shared flags (pause mode, released memory) as they end
        try:
            await self.publisher.flush(self.flush_timeout_s)
        except ServiceUnavailable as exc:
            logger.warning("cluster: %s %s ends with changes not yet shared: %s", ticket.kind, ticket.op_id, exc)
        if not await self._finish(owned, outcome, message):
            task = asyncio.ensure_future(self._finish_later(owned, outcome, message))
            self._releasing.add(task)
            task.add_done_callback(self._releasing.discard)

    async def _finish(self, owned: _Owned, outcome: str, message: str) -> bool:
        """Delete the lock and finish the record together; True when done (or no longer ours)."""
        if self._mine(owned.scope) is not owned:
            return True
        owned.record.update(state="done", outcome=outcome, message=message[:1000], ended_at=round(time.time(), 3))
        old = self._finished_to_forget()
        owned.finishing = True
        try:
            result = await self.client.txn(
                [Compare.create_revision(owned.fence.key, "==", owned.fence.revision)],
                [Op.delete(owned.fence.key), Op.put(self.keys.op(owned.op_id), encode(owned.record)),
                 *(Op.delete(key) for key in old)])
        except EtcdError as exc:
            owned.finishing = False
            self.status.saw(False, str(exc))
            logger.warning("cluster: releasing %s %s failed (%s); retrying", owned.record.get("kind"), owned.op_id,
                           exc)
            return False
        if not result.succeeded:
            logger.warning("cluster: %s %s was no longer this replica's when it ended (%s)",
                           owned.record.get("kind"), owned.op_id, outcome)
        if self._owned.get(owned.scope) is owned:
            del self._owned[owned.scope]
        return True

    async def _finish_later(self, owned: _Owned, outcome: str, message: str) -> None:
        """etcd did not answer: keep trying while the lease lives (after it, the lock is gone anyway)."""
        while owned.lease.alive and not await self._finish(owned, outcome, message):
            # a retry cadence, not a wait for a condition: etcd is not answering
            await asyncio.sleep(RELEASE_RETRY_S)
        self._mine(owned.scope)

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
        owned = self._of(ticket)
        if owned is None:
            return {}
        acks = {}
        for replica in self.replicas():
            kv = self.mirror.get(self.keys.ack(ticket.op_id, replica))
            ack = decode(kv.value) if kv is not None else {}
            if ack.get("seq") == owned.seq:
                acks[replica] = ack
        return acks

    async def stop_routing(self, ticket: Ticket | None, workers: Sequence[Worker] | None,
                           action: StopAction) -> StopReport:
        tally = MarkTally()
        marked_here, here = stop_here(self.registry, self.traffic, workers, action, tally)  # this replica first
        if ticket is None:
            return StopReport(marked=marked_here, here=tuple(here), tally=tally)
        await self.publisher.flush(self.flush_timeout_s)
        owned = self._of(ticket)
        if owned is None:
            raise self.lost_error(ticket, "this replica no longer runs it")
        owned.seq += 1
        barrier = {"seq": owned.seq, "action": action.value, "at": round(time.time(), 3),
                   "workers": None if workers is None else [w.url for w in workers]}
        await self._update(ticket, barrier=barrier)
        confirmed = await self._wait(ticket, lambda: set(self._acks(ticket)) >= set(self.replicas()),
                                     self.ack_timeout_s)
        acks = self._acks(ticket)
        if not confirmed:
            missing = sorted(set(self.replicas()) - set(acks))
            raise ServiceUnavailable(f"{ticket.kind} {ticket.op_id}: replica(s) {', '.join(missing)} did not confirm "
                                     f"within {self.ack_timeout_s:g} s that they stopped routing to the servers "
                                     f"concerned; nothing was changed on them", cluster=self.keys.name,
                                     replicas=missing)
        return StopReport(replicas=len(acks),
                          marked=marked_here + sum(int(a.get("marked", 0)) for a in acks.values()),
                          inflight=sum(int(a.get("inflight", 0)) for a in acks.values()), here=tuple(here),
                          tally=tally)

    def inflight_elsewhere(self, ticket: Ticket, worker: Worker) -> int:
        return sum(int(ack.get("counts", {}).get(worker.url, 0)) for ack in self._acks(ticket).values())

    async def wait_idle_elsewhere(self, ticket: Ticket) -> None:
        def idle() -> bool:
            acks = self._acks(ticket)
            return all(int(acks.get(r, {}).get("inflight", 1)) == 0 for r in self.replicas())
        while not await self._wait(ticket, idle, 3600.0):
            pass

    async def wait_worker_operations_elsewhere(self, timeout: float) -> list[str]:
        """Conversions and reinstates of other replicas, and those whose owner died until they are taken over."""
        def running() -> list[str]:
            mine = {o.op_id for o in self._owned.values()}
            return [f"{r.get('kind')} {r.get('id')} of replica {r.get('owner')}" for r in self.running()
                    if str(r.get("scope", "")).startswith("worker/") and r.get("id") not in mine]
        await self.mirror.wait_for(lambda: not running(), timeout)
        return running()

    def fleet_op_id(self) -> str | None:
        """The fleet-wide operation this replica runs now (its holds are that operation's)."""
        owned = self._mine(FLEET)
        return owned.op_id if owned is not None else None

    # ---- takeover ----------------------------------------------------------------------------------------
    async def adopt(self, kv: KeyValue) -> Ticket | None:
        """Take over a running operation whose lock is gone (its owner's lease ended): its lock again, on this
        replica's lease, and its record naming this replica, if nobody did first. None when another did."""
        record = decode(kv.value)
        scope, op_id, lease = str(record.get("scope", "")), str(record.get("id", "")), self.membership.trusted()
        if not scope or not op_id or lease is None:
            return None
        lock_key = self.keys.lock(scope)
        adopted = {**record, "owner": self.me, "taken_over_from": record.get("owner"),
                   "taken_over_at": round(time.time(), 3), "barrier": None}
        lock = {"op": op_id, "kind": record.get("kind"), "replica": self.me, "takeover": True}
        try:
            result = await self.client.txn(
                [Compare.absent(lock_key), Compare.mod_revision(kv.key, "==", kv.mod_revision)],
                [Op.put(lock_key, encode(lock), lease=lease.id), Op.put(kv.key, encode(adopted))])
        except EtcdError as exc:
            self.status.saw(False, str(exc))
            return None
        if not result.succeeded:
            return None
        self._owned[scope] = owned = _Owned(op_id, scope, Fence(lock_key, result.revision), adopted, lease)
        if not lease.alive or self.membership.lease is not lease:
            self._end(owned, "its etcd lease ended while it took the operation over")
        return Ticket(op_id, str(record.get("kind")), scope, details=record.get("details") or {})

    # ---- workers ---------------------------------------------------------------------------------------
    async def publish(self) -> None:
        await self.publisher.flush(self.flush_timeout_s)

    async def remove_worker(self, worker: Worker, by: str = "") -> None:
        """Delete the worker's record and leave a removal record (`removed/<url>`) in the same transaction: no
        replica's command line brings the server back (it seeds a cluster, it does not override it); only a
        registration on purpose does (`readmit`). Refused while an operation holds the worker."""
        self._check_lease("remove worker")
        key, lock, removal = (self.keys.worker(worker.url), self.keys.lock(f"worker/{worker.url}"),
                              self.keys.removal(worker.url))
        forget = self._removals_to_forget(removal)
        try:
            result = await self.client.txn(
                [Compare.absent(lock)],
                [Op.delete(key), Op.put(removal, encode(removal_record(worker, self.me, by))),
                 *(Op.delete(old) for old in forget)],
                [Op.get(lock)])
        except EtcdError as exc:
            raise self._unavailable("remove worker", exc) from exc
        if not result.succeeded:
            held = result.responses[0].kvs[0] if result.responses and result.responses[0].kvs else None
            raise Conflict(f"worker {worker.url}: {self._holder(held)} is running on it; wait for it to end",
                           cluster=self.keys.name)
        self.publisher.deleted(key, result.revision)
        self.publisher.seen(removal, result.revision, result.revision)  # its own write coming back
        if forget:
            logger.info("cluster: %d oldest removal record(s) forgotten (%d kept)", len(forget), MAX_REMOVALS)
        self.status.saw(True)

    def _removals_to_forget(self, adding: str) -> list[str]:
        kept = [kv for kv in self.mirror.under(self.keys.removals) if kv.key != adding]
        kept.sort(key=lambda kv: kv.mod_revision)
        return [kv.key for kv in kept[:max(len(kept) + 1 - MAX_REMOVALS, 0)]][:16]

    def removal(self, url: str) -> str | None:
        """Why the cluster has no such worker, when it removed it (from its removal record); None otherwise."""
        kv = self.mirror.get(self.keys.removal(url))
        return describe_removal(decode(kv.value)) if kv is not None else None

    async def readmit(self, url: str) -> None:
        """A registration on purpose (`POST /workers`, `/add_worker`, `/register`, a worker source's new entry):
        the removal record goes, so the worker may be created again."""
        key = self.keys.removal(url)
        if self.mirror.get(key) is None:
            return  # none known; one written meanwhile by another replica's removal makes the creation lose
        try:
            result = await self.client.txn([], [Op.delete(key)])
        except EtcdError as exc:
            raise self._unavailable("add worker", exc) from exc
        self.publisher.seen(key, 0, result.revision)  # the watch's older removal must not remove it again
        logger.info("cluster: %s registered again on purpose: its removal record is cleared", url)

    async def close(self) -> None:
        for task in list(self._releasing):
            task.cancel()
        await asyncio.gather(*self._releasing, return_exceptions=True)

    def running(self) -> list[dict]:
        """The operations running in the cluster now (their records), oldest first."""
        found = [decode(kv.value) for kv in self.mirror.under(self.keys.ops)]
        return sorted((r for r in found if r.get("state") == "running"), key=lambda r: r.get("started_at", 0))
