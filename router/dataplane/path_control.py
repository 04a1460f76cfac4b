"""The request path's side of `router.core.traffic.RequestPathControl`: admission and the live attempts of
one proxy, behind the narrow interface that the control flows call."""

from __future__ import annotations

from typing import Callable, Iterable

from router.core.registry import Worker
from router.core.traffic import AbortAction, LiveRequest, MarkTally
from router.dataplane.admission import Admission
from router.dataplane.live import LiveRequests
from router.dataplane.upstream_http import UpstreamError, UpstreamPool


class DataplaneControl:
    """Implements RequestPathControl. Not on the hot path: only fleet-wide operations call it."""

    __slots__ = ("_admission", "_live", "_legs", "_abort_on")

    def __init__(self, admission: Admission, live: LiveRequests, legs: UpstreamPool | None = None,
                 abort_on: Callable[[Worker, list[str]], None] | None = None) -> None:
        """`abort_on(worker, rids)`: the request path's own abort sender (`LegAborts.abort_on`)."""
        self._admission = admission
        self._live = live
        self._legs = legs
        self._abort_on = abort_on

    # ---- admission ---------------------------------------------------------------------------------
    def close_gate(self, reason: str) -> None:
        self._admission.close_gate(reason)

    def open_gate(self, reason: str) -> None:
        self._admission.open_gate(reason)

    @property
    def held_total(self) -> int:
        return self._admission.held_total

    def admission_state(self) -> dict:
        return self._admission.state()

    # ---- the legs' silence -------------------------------------------------------------------------
    def expect_silence(self, reason: str) -> None:
        if self._legs is not None:
            self._legs.expect_silence(reason)

    def end_silence(self, reason: str) -> None:
        if self._legs is not None:
            self._legs.end_silence(reason)

    # ---- live requests -----------------------------------------------------------------------------
    def count_on(self, workers: Iterable[Worker]) -> int:
        return len(self._live.on(workers))

    def mark_on(self, workers: Iterable[Worker], action: AbortAction, tally: MarkTally | None = None) -> int:
        return self._live.mark(self._live.on(workers), action, tally)

    def mark_waiting_on_prefill(self, workers: Iterable[Worker], action: AbortAction) -> list[LiveRequest]:
        attempts = self._live.waiting_on_prefill(workers)
        self._live.mark(attempts, action)
        return attempts

    def mark_all(self, action: AbortAction) -> list[LiveRequest]:
        attempts = list(self._live)
        self._live.mark(attempts, action)
        return attempts

    def mark_rid(self, rid: str, action: AbortAction) -> tuple[LiveRequest, list[str]] | None:
        found = self._live.by_rid(rid)
        if found is not None:
            self._live.mark((found[0],), action)
        return found

    def still_live(self, requests: Iterable[LiveRequest]) -> list[LiveRequest]:
        live = self._live
        return [r for r in requests if r in live]

    def cut(self, requests: Iterable[LiveRequest], reason: str) -> None:
        for attempt in requests:
            attempt.cut(UpstreamError(reason))

    def abort(self, requests: Iterable[LiveRequest]) -> None:
        if self._abort_on is None:
            raise RuntimeError("this request path has no abort sender")
        for request in requests:
            if request.rids:
                self._abort_on(request.prefill, list(request.rids))
                self._abort_on(request.decode, list(request.rids))
