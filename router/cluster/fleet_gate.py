"""Admission's fleet-wide gate (and the legs' expected silence of a pause), shared: what the flows'
`RequestPathControl` becomes in a cluster.

A weight update, a pause or a memory release closes the gate to new requests on every replica, not only on the
one that runs it. The flows call `close_gate(reason)` / `open_gate(reason)` as they do alone; this wrapper closes
this replica's admission and has it published (the fleet record's `holds`), and the other replicas apply it
from their watch (`apply`). Everything else goes straight to the request path.

A gate closed from etcd stays closed while etcd is unreachable: opening it could let requests reach servers in the
middle of an update (a silent mix of weights); it ends when the watch shows it released (by its owner, or by
the replica that took the operation over after its owner died).
"""

from __future__ import annotations

import time
from typing import Callable, Iterable

from router.core.registry import Worker
from router.core.traffic import AbortAction, LiveRequest, RequestPathControl


class FleetGate:
    """Implements RequestPathControl over this replica's own (`local`)."""

    def __init__(self, local: RequestPathControl, replica_id: str, changed: Callable[[], None], *,
                 current_op: Callable[[], str | None]) -> None:
        self.local = local
        self.replica_id = replica_id
        self.changed = changed  # the publisher's: the fleet record must be written again
        # The fleet-wide operation this replica runs now (a reason it closes the gate for is that operation's: a replica that
        # takes the operation over after this one died releases it).
        self.current_op = current_op
        self.closed: dict[str, dict] = {}  # why the fleet's gate is closed here, by reason: {"replica", "op", "since"}
        self.silences: set[str] = set()  # reasons the legs' silence is expected (a pause in place)

    # ---- the fleet-wide gate -------------------------------------------------------------------------
    def close_gate(self, reason: str) -> None:
        self.local.close_gate(reason)
        self.closed[reason] = {"replica": self.replica_id, "op": self.current_op(), "since": round(time.time(), 3)}
        self.changed()

    def open_gate(self, reason: str) -> None:
        self.local.open_gate(reason)
        if self.closed.pop(reason, None) is not None:
            self.changed()

    def expect_silence(self, reason: str) -> None:
        """A pause in place: every replica's legs go silent on purpose, not only this one's."""
        self.local.expect_silence(reason)
        self.silences.add(reason)
        self.changed()

    def end_silence(self, reason: str) -> None:
        self.local.end_silence(reason)
        if reason in self.silences:
            self.silences.discard(reason)
            self.changed()

    def apply(self, holds: dict[str, dict], silences: list[str]) -> None:
        """The gate as the fleet record says (its `holds`, from the watch): applied here, not published again."""
        for reason in [r for r in self.closed if r not in holds]:
            del self.closed[reason]
            self.local.open_gate(reason)
        for reason, info in holds.items():
            if reason not in self.closed:
                self.local.close_gate(reason)
            self.closed[reason] = dict(info) if isinstance(info, dict) else {}
        for reason in self.silences - set(silences):
            self.local.end_silence(reason)
        for reason in set(silences) - self.silences:
            self.local.expect_silence(reason)
        self.silences = set(silences)

    # ---- the rest of the request path's control, unchanged ---------------------------------------------
    @property
    def held_total(self) -> int:
        return self.local.held_total

    def admission_state(self) -> dict:
        return self.local.admission_state()

    def count_on(self, workers: Iterable[Worker]) -> int:
        return self.local.count_on(workers)

    def mark_on(self, workers: Iterable[Worker], action: AbortAction) -> int:
        return self.local.mark_on(workers, action)

    def mark_waiting_on_prefill(self, workers: Iterable[Worker], action: AbortAction) -> list[LiveRequest]:
        return self.local.mark_waiting_on_prefill(workers, action)

    def mark_all(self, action: AbortAction) -> list[LiveRequest]:
        return self.local.mark_all(action)

    def mark_rid(self, rid: str, action: AbortAction) -> tuple[LiveRequest, list[str]] | None:
        return self.local.mark_rid(rid, action)

    def still_live(self, requests: Iterable[LiveRequest]) -> list[LiveRequest]:
        return self.local.still_live(requests)

    def cut(self, requests: Iterable[LiveRequest], reason: str) -> None:
        self.local.cut(requests, reason)

    def abort(self, requests: Iterable[LiveRequest]) -> None:
        self.local.abort(requests)
