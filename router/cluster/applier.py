"""Applies the cluster's shared state from etcd to this replica: its registry and its fleet-wide holds.

For each batch of changes the watch brings (one etcd answer: a transaction's keys together), through the
registry's own methods, synchronously: the request path sees the pools before or after, never half-way.
- a weight version (the fleet's, or servers' with it) first, in one `set_fleet_version` call, so nobody is
  judged against a new fleet version with its old weights;
- each worker record: added (with its record's state), moved to its role and bootstrap port, held out or
  let back, its state and facts set; a deleted record removes the worker (a `pending` one, still being
  read here, stays: it is published once read, where absent);
- the fleet record: its holds applied to admission, the weight flow's shared state (pause mode, released
  memory) set;
- a removal record (`removed/<url>`): a worker of that URL this replica has and the cluster does not (one its
  command line added while etcd did not answer, or one still `pending` here, its server not read: published
  by nobody) is removed; the cluster removed it, and no command line brings it back.
Skipped: this replica's own writes coming back, and keys changed here that are not written yet (the
publisher decides those). Nothing applied here is published again (`Publisher.applying`).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Callable, Iterator

from router.cluster.etcd_types import KeyValue
from router.cluster.fleet_gate import FleetGate
from router.cluster.etcd_keys import ClusterKeys, decode
from router.cluster.mirror import Change
from router.cluster.publisher import Publisher
from router.cluster.shared_records import FACTS, describe_removal, hold_of, state_of
from router.core.registry import DuplicateWorker, Registry, Role, Worker, WorkerState

logger = logging.getLogger(__name__)


class Applier:
    def __init__(self, keys: ClusterKeys, registry: Registry, publisher: Publisher, gate: FleetGate, *,
                 apply_flags: Callable[[dict], None]) -> None:
        """`apply_flags`: takes the fleet record's share of the weight flow's state (pause mode, released
        memory)."""
        self.keys = keys
        self.registry = registry
        self.publisher = publisher
        self.gate = gate
        self.apply_flags = apply_flags
        self.applied = 0  # changes applied

    @contextlib.contextmanager
    def _applying(self) -> Iterator[None]:
        self.publisher.applying = True
        try:
            yield
        finally:
            self.publisher.applying = False

    # ---- a batch from the watch -----------------------------------------------------------------------
    def on_changes(self, changes: list[Change]) -> None:
        workers: dict[str, dict | None] = {}
        fleet: dict | None = None
        removed: dict[str, dict] = {}
        for change in changes:
            kind, name = self.keys.kind_of(change.key)
            if kind == "removed":
                if change.new is not None and not self.publisher.known(change.key, change.revision):
                    removed[name] = decode(change.new.value)
                continue
            if kind not in ("worker", "fleet"):
                continue
            if self.publisher.known(change.key, change.revision):
                continue  # its own write coming back, or older than what this replica wrote since
            if self.publisher.pending(change.key):
                continue  # changed here meanwhile: the publisher's swap decides which of the two stands
            mod_revision = change.new.mod_revision if change.new is not None else 0
            self.publisher.seen(change.key, mod_revision, change.revision)
            record = decode(change.new.value) if change.new is not None else None
            if kind == "worker":
                workers[name] = record
            else:
                fleet = record if record is not None else {}
        if not workers and fleet is None and not removed:
            return
        with self._applying():
            self._apply_versions(workers, fleet)
            for url, record in workers.items():
                self._converge_worker(url, record)
            if fleet is not None:
                self._apply_fleet(fleet)
            for url, record in removed.items():
                self._removed(url, record)
        self.applied += len(workers) + (fleet is not None) + len(removed)

    def _removed(self, url: str, record: dict) -> None:
        """The cluster removed `url`: this replica's own copy goes too (not the cluster's record, if one was
        created again since: then the removal record is stale and the record stands)."""
        worker = self.registry.find(url)
        if worker is None or self.publisher.mirror.get(self.keys.worker(url)) is not None:
            return
        logger.warning("cluster: %s (%s here) was %s: dropped here too; POST /workers adds it again", url,
                       worker.state, describe_removal(record))
        self.registry.remove(worker)

    def converge(self, key: str, kv: KeyValue | None) -> None:
        """One key as etcd has it (a change of this replica that lost)."""
        kind, name = self.keys.kind_of(key)
        record = decode(kv.value) if kv is not None else None
        self.publisher.seen(key, kv.mod_revision if kv is not None else 0, as_of=None)  # read just now
        with self._applying():
            if kind == "worker":
                self._apply_versions({name: record}, None)
                self._converge_worker(name, record)
            elif kind == "fleet":
                self._apply_versions({}, record or {})
                self._apply_fleet(record or {})

    # ---- weight versions, together ----------------------------------------------------------------------
    def _apply_versions(self, workers: dict[str, dict | None], fleet: dict | None) -> None:
        version = self.registry.fleet_version if fleet is None else fleet.get("weight_version")
        changed: dict[Worker, str] = {}
        for url, record in workers.items():
            worker = self.registry.find(url)
            if worker is None or record is None or worker.state is WorkerState.PENDING:
                continue
            new = record.get("weight_version")
            if new is not None and new != worker.weight_version:
                changed[worker] = new
        if version != self.registry.fleet_version or changed:
            self.registry.set_fleet_version(version, "shared by the cluster", worker_versions=changed)

    # ---- one worker --------------------------------------------------------------------------------------
    def _converge_worker(self, url: str, record: dict | None) -> None:
        registry = self.registry
        worker = registry.find(url)
        if record is None:
            if worker is not None and worker.state is not WorkerState.PENDING:
                logger.info("cluster: %s was removed from the fleet", url)
                registry.remove(worker)
            return
        try:
            role = Role(record.get("role"))
        except ValueError:
            logger.warning("cluster: the record of %s has no usable role (%r): ignored", url, record.get("role"))
            return
        port = record.get("bootstrap_port")
        port = port if isinstance(port, int) and not isinstance(port, bool) else None
        state, reason, hold = state_of(record), str(record.get("state_reason", "")), hold_of(record)
        # a worker new here (or still being read here) takes its weight version with its other facts
        fresh = worker is None or worker.state is WorkerState.PENDING
        if worker is None:
            try:
                given_id = record.get("id")
                worker = registry.add(url, role, port, state=state, reason=reason,
                                      worker_id=given_id if isinstance(given_id, str) else None,
                                      source=f"cluster (added by {record.get('by', 'another replica')})")
            except DuplicateWorker:
                return
            logger.info("cluster: %s joined the fleet as %s (%s)", url, role, state)
        elif worker.role is not role or worker.bootstrap_port != port:
            registry.move(worker, role, port, state if hold is None else WorkerState.FAILED, reason)
        if hold is not None:
            held = worker.hold
            if held is None or (held.kind, held.reason) != (hold.kind, hold.reason):
                registry.hold_out(worker, hold.kind, hold.reason)
        elif worker.hold is not None:
            registry.end_hold(worker, [worker.hold.kind], reason or "let back by the cluster")
        if (worker.state, worker.state_reason) != (state, reason) and (hold is None or state is not WorkerState.FAILED):
            registry.set_state(worker, state, reason)
        facts = {name: record.get(name) for name in FACTS
                 if record.get(name) is not None and record.get(name) != getattr(worker, name)}
        if not fresh:
            facts.pop("weight_version", None)  # applied with the fleet's (see _apply_versions)
        if facts:
            registry.update_info(worker, **facts)

    # ---- the fleet -----------------------------------------------------------------------------------
    def _apply_fleet(self, record: dict) -> None:
        holds, silences = record.get("holds"), record.get("silences")
        self.gate.apply(holds if isinstance(holds, dict) else {},
                         [str(s) for s in silences] if isinstance(silences, list) else [])
        self.apply_flags(record)
