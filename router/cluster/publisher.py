"""Shares in etcd what this replica changed in its registry (and its fleet-wide holds).

The registry stays the one writer of local state: flows, discovery and the health monitor change it through
its methods as they do alone. This listener notes which workers (and whether the fleet record) changed here,
not by applying etcd (`applying`), and a writer task puts their records in etcd, the keys noted together in
one transaction (a weight update's fleet version and its servers' versions arrive together everywhere).

Who wins when two replicas change one record:
- a replica holding the lock that covers the record (the worker's, or the fleet's: it runs an operation on
  it) writes it fenced by that lock: the transaction holds only while the lock is still its own;
- any other change is compare-and-swap on the record as this replica last saw it (creating a record is a
  swap from "absent": a command-line worker is added only where absent);
- a change to a record that another replica's operation holds is not written.
A write that loses (or is not written) is undone here: the registry converges to the record in etcd. While
etcd does not answer, changes stay noted and are written when it does (or lose to what others wrote).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Callable

from router.cluster.etcd import EtcdClient
from router.cluster.etcd_status import EtcdStatus
from router.cluster.etcd_types import Compare, EtcdError, EtcdOutcomeUnknown, KeyValue, Op, RangeResult
from router.cluster.etcd_keys import ClusterKeys, decode, encode
from router.cluster.mirror import Mirror
from router.cluster.shared_records import same, worker_record
from router.core.errors import ServiceUnavailable
from router.core.registry import Registry, Worker, WorkerState

logger = logging.getLogger(__name__)

WORKER_EVENTS = frozenset({"added", "removed", "state", "moved", "info", "held", "hold_ended"})
BATCH = 48  # keys per transaction (etcd allows 128 compares and 128 operations; a key takes up to 2 and 1)
RETRY_S = (0.1, 2.0)


@dataclass(frozen=True, slots=True)
class Fence:
    """A lock this replica holds: its writes under it hold only while the lock key is at this revision."""

    key: str
    revision: int  # the lock key's create revision


@dataclass(slots=True)
class _Write:
    key: str
    value: bytes | None  # None: delete
    compares: tuple[Compare, ...]


class Publisher:
    def __init__(self, client: EtcdClient, keys: ClusterKeys, mirror: Mirror, registry: Registry,
                 status: EtcdStatus, replica_id: str, *, fleet_now: Callable[[], dict]) -> None:
        """`fleet_now`: the fleet record as this replica holds it (written whenever `note_fleet` is told)."""
        self.client = client
        self.keys = keys
        self.mirror = mirror
        self.registry = registry
        self.status = status
        self.replica_id = replica_id
        self.applying = False  # set while the applier changes the registry from etcd: not ours to publish
        self.fleet_now = fleet_now
        # Set afterwards by objects that take this publisher (so they cannot be given here): the lock covering
        # a key (fleet, or the worker's) held here or elsewhere, by the coordinator; undoing a refused change
        # through the applier, by the runtime.
        self.fence_for: Callable[[str], Fence | None] = lambda key: None
        self.locked_elsewhere: Callable[[str], bool] = lambda key: False
        self.converge: Callable[[str, KeyValue | None], None] = lambda key, kv: None
        self._dirty: dict[str, None] = {}  # keys to write, in the order they changed
        # key -> (the record's mod revision, 0 when absent; the revision at which etcd held that): what this
        # replica's state of the key is based on, i.e. the compare of its next swap. The newest wins, whether
        # applied or written here: a record deleted after this replica wrote it is a swap from "absent" again.
        self._base: dict[str, tuple[int, int]] = {}
        self._deleted: set[str] = set()  # records this replica deleted itself (a removed worker)
        self._writing = False
        self._wake = asyncio.Event()
        self._settled = asyncio.Event()
        self._settled.set()
        self.writes = 0
        self.refused = 0
        registry.subscribe(self._on_registry_event)

    # ---- what changed -------------------------------------------------------------------------------
    def _on_registry_event(self, event: str, worker: Worker | None, details: dict) -> None:
        if self.applying:
            return
        if event in WORKER_EVENTS and worker is not None:
            self.note(self.keys.worker(worker.url))
        elif event == "fleet_version":
            self.note(self.keys.fleet)

    def note(self, key: str) -> None:
        self._dirty[key] = None
        self._settled.clear()
        self._wake.set()

    def note_fleet(self) -> None:
        self.note(self.keys.fleet)

    def deleted(self, key: str, revision: int) -> None:
        """This replica deleted the record itself (`remove_worker`) at `revision`: the local removal needs no
        write, and a record created here later is a swap from "absent"."""
        self._deleted.add(key)
        self._rebase(key, 0, revision)

    def pending(self, key: str) -> bool:
        """A change of this key made here is not written yet (the watch's older value must not undo it)."""
        return key in self._dirty

    def known(self, key: str, revision: int) -> bool:
        """This replica's state of the key is already as of `revision` or newer: the watch brings back its own
        write, or one of its earlier writes after a later one (a conversion writes each of its states; the
        watch may lag behind), which must not take the registry back."""
        return revision <= self._base.get(key, (0, 0))[1]

    def seen(self, key: str, mod_revision: int, as_of: int | None) -> None:
        """The applier made the registry say what etcd held at revision `as_of` (None: read just now, newer
        than anything known here): the record at `mod_revision` (0: the key is gone). A change made here from
        now on is based on it (the compare-and-swap's revision), unless this replica already knows a newer
        state of the key (a late event older than its own write)."""
        if as_of is None:
            as_of = max(mod_revision, self._base.get(key, (0, 0))[1])
        self._rebase(key, mod_revision, as_of)

    def _rebase(self, key: str, mod_revision: int, as_of: int) -> None:
        if as_of >= self._base.get(key, (0, 0))[1]:
            self._base[key] = (mod_revision, as_of)

    async def flush(self, timeout: float) -> None:
        """Until every change noted so far is written (or refused and undone); ServiceUnavailable at timeout."""
        try:
            async with asyncio.timeout(timeout):
                while self._dirty or self._writing:
                    await self._settled.wait()
        except TimeoutError:
            raise ServiceUnavailable(f"etcd did not take this replica's changes within {timeout:g} s "
                                     f"({self.status.last_error or 'no answer'})", cluster=self.keys.name) from None

    # ---- writing ------------------------------------------------------------------------------------
    async def run(self) -> None:
        delay = RETRY_S[0]
        while True:
            if not self._dirty:
                self._settled.set()
                await self._wake.wait()
                self._wake.clear()
                continue
            keys = list(self._dirty)[:BATCH]
            for key in keys:
                self._dirty.pop(key, None)
            self._writing = True
            try:
                await self._write(keys)
                delay = RETRY_S[0]
            except EtcdError as exc:
                for key in keys:  # written again, with whatever they hold by then
                    self._dirty.setdefault(key, None)
                self.status.saw(False, str(exc))
                logger.debug("cluster: publishing %d key(s) failed (%s); retrying", len(keys), exc)
                # a retry cadence, not a wait for a condition: etcd is not answering
                await asyncio.sleep(delay)
                delay = min(delay * 2, RETRY_S[1])
            finally:
                self._writing = False

    async def _write(self, keys: list[str]) -> None:
        writes = [w for w in (self._plan(key) for key in keys) if w is not None]
        if not writes:
            return
        try:
            result = await self.client.txn([c for w in writes for c in w.compares],
                                           [Op.put(w.key, w.value) if w.value is not None else Op.delete(w.key)
                                            for w in writes])
        except EtcdOutcomeUnknown:
            await self._write_one_by_one(writes)  # each is read back: a compare that fails shows what is there
            return
        self.status.saw(True)
        if result.succeeded:
            self._wrote(writes, result.revision)
        elif len(writes) == 1:
            await self._refused(writes[0])
        else:
            await self._write_one_by_one(writes)  # find which compare failed: the others still go in

    async def _write_one_by_one(self, writes: list[_Write]) -> None:
        for write in writes:
            op = Op.put(write.key, write.value) if write.value is not None else Op.delete(write.key)
            try:
                result = await self.client.txn(list(write.compares), [op], [Op.get(write.key)])
            except EtcdOutcomeUnknown:
                current = await self.client.get(write.key)
                if (current is None and write.value is None) or (current is not None and current.value == write.value):
                    self._wrote([write], current.mod_revision if current is not None else 0)
                else:
                    self._dirty.setdefault(write.key, None)
                continue
            if result.succeeded:
                self._wrote([write], result.revision)
            else:
                found = result.responses[0] if result.responses else None
                kvs = found.kvs if isinstance(found, RangeResult) else []
                self._undo(write.key, kvs[0] if kvs else None)

    async def _refused(self, write: _Write) -> None:
        self._undo(write.key, await self.client.get(write.key))

    def _wrote(self, writes: list[_Write], revision: int) -> None:
        for write in writes:
            self._rebase(write.key, revision if write.value is not None else 0, revision)
        self.writes += len(writes)

    def _undo(self, key: str, current: KeyValue | None) -> None:
        """Another replica's record won: this replica converges to it."""
        self.refused += 1
        logger.info("cluster: %s changed here lost to %s: following it", key.removeprefix(self.keys.prefix),
                    "its deletion" if current is None else f"the record of {decode(current.value).get('by')}")
        self.converge(key, current)

    def _plan(self, key: str) -> _Write | None:
        """What to write for a noted key, under which condition; None when etcd already says it."""
        current = self.mirror.get(key)
        # what this replica's state is based on: the record it last applied, or its own last write of it
        base = self._base.get(key, (0, 0))[0]
        kind, name = self.keys.kind_of(key)
        if kind == "fleet":
            value = self.fleet_now()
        elif kind == "worker":
            worker = self.registry.find(name)
            if worker is not None and worker.state is WorkerState.PENDING:
                return None  # its server not read yet: this replica's business
            value = None if worker is None else worker_record(worker, self.replica_id)
            if value is not None and current is not None:
                value["id"] = decode(current.value).get("id", value["id"])  # the creator's id stays
        else:
            return None
        if current is not None and value is not None and same(decode(current.value), value):
            self._rebase(key, current.mod_revision, self.mirror.revision)  # etcd says it already
            return None
        if value is None and (current is None or key in self._deleted):
            self._deleted.discard(key)
            if current is None:
                self._rebase(key, 0, self.mirror.revision)
            return None
        fence = self.fence_for(key)
        if fence is not None:
            compare = Compare.create_revision(fence.key, "==", fence.revision)
        elif self.locked_elsewhere(key) and current is not None:
            self._undo(key, current)  # another replica's operation holds it: its record stands
            return None
        else:
            compare = Compare.mod_revision(key, "==", base)
        compares = (compare,)
        if kind == "worker" and value is not None:
            # a server the cluster removed is not written back, by any hand: only a registration on purpose
            # (which deletes the removal record first) creates it again; a write under a lock updates a record
            # that still exists (one removed meanwhile is not re-created)
            if current is None:
                compares += (Compare.absent(self.keys.removal(name)),)
            elif fence is not None:
                compares += (Compare.exists(key),)
        return _Write(key, None if value is None else encode(value), compares)

    @property
    def pending_count(self) -> int:
        return len(self._dirty)

    def stats(self) -> dict:
        return {"writes": self.writes, "refused": self.refused, "pending": len(self._dirty)}
