"""The live requests of the router: every attempt in flight, indexed by rid.

The request path adds an attempt once its pair and rids are chosen and removes it when the attempt ends;
the flows read and mark it through `RequestPathControl` (dataplane/path_control.py): to abort one request on
exactly the two servers that hold it, or to mark every request on a set of servers before the router aborts
them (so the request path can tell a router-made abort from a failure, and knows whether to re-send or to
answer with the abort).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Iterator

from router.core.traffic import AbortAction, MarkTally

if TYPE_CHECKING:
    from router.core.registry import Worker
    from router.dataplane.attempt import Attempt


class LiveRequests:
    __slots__ = ("_attempts", "_by_rid")

    def __init__(self) -> None:
        self._attempts: set[Attempt] = set()
        self._by_rid: dict[str, Attempt] = {}

    # ---- request path (hot) ------------------------------------------------------------------------
    def add(self, attempt: "Attempt") -> None:
        self._attempts.add(attempt)
        for rid in attempt.rids:
            self._by_rid[rid] = attempt

    def discard(self, attempt: "Attempt") -> None:
        self._attempts.discard(attempt)
        by_rid = self._by_rid
        for rid in attempt.rids:
            if by_rid.get(rid) is attempt:
                del by_rid[rid]

    # ---- control -----------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._attempts)

    def __contains__(self, attempt: "Attempt") -> bool:
        return attempt in self._attempts

    def __iter__(self) -> Iterator["Attempt"]:
        return iter(list(self._attempts))

    def on(self, workers: Iterable["Worker"]) -> list["Attempt"]:
        """Attempts with a leg on any of these workers."""
        wanted = set(workers)
        return [a for a in self._attempts if a.prefill in wanted or a.decode in wanted]

    def waiting_on_prefill(self, workers: Iterable["Worker"]) -> list["Attempt"]:
        """Attempts with a leg on any of these workers that wait on their prefill (`Attempt.waiting_on_prefill`)."""
        return [a for a in self.on(workers) if a.waiting_on_prefill]

    def by_rid(self, rid: str) -> tuple["Attempt", list[str]] | None:
        """The attempt that `rid` names, and the rids to abort on its servers (SGLang 0.5.23 aborts by exact
        rid): the rid itself with its sequences `rid_N` (a batch, n>1), or, for a parent rid the attempt does
        not carry itself, those sequences. Never a mere prefix: `/abort_request {"rid": "a"}` from anyone
        must not abort whichever request's rid starts with "a"."""
        attempt = self._by_rid.get(rid)
        if attempt is None:
            attempt = self._by_rid.get(rid + "_0")  # SGLang numbers sequences from 0
            if attempt is None:
                return None
        return attempt, [r for r in attempt.rids if r == rid or _is_sequence_of(r, rid)]

    @staticmethod
    def mark(attempts: Iterable["Attempt"], action: AbortAction, tally: MarkTally | None = None) -> int:
        """Tell the request path what to do when these attempts come back aborted (ANSWER wins over RETRY);
        `tally` counts how each ends (the last operation that marked an attempt counts it)."""
        count = 0
        for attempt in attempts:
            if attempt.abort_action is None or action is AbortAction.ANSWER:
                attempt.abort_action = action
            if tally is not None:
                attempt.tally = tally
            count += 1
        if tally is not None:
            tally.marked += count
        return count


def _is_sequence_of(rid: str, parent: str) -> bool:
    """`parent_N`: how SGLang names the sequences of a batch or of n>1."""
    return rid.startswith(parent) and rid[len(parent):len(parent) + 1] == "_" and rid[len(parent) + 1:].isdigit()
