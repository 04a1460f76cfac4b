"""What the control flows may ask of the request path, and nothing more.

Fleet-wide operations (weight updates, pause, memory release, abort) need to close admission's gate (new requests wait) and to tell
the request path what to do with requests the router is about to abort. They call this interface; the
request path implements it (`router/dataplane/path_control.py`), so flows never reach into its internals.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Protocol, Sequence

if TYPE_CHECKING:
    from router.core.registry import Worker


class AbortAction(str, enum.Enum):
    """What the request path does with a request that an operator (or a flow) aborted."""

    RETRY = "retry"  # aborted before the client saw a token: re-send once the fleet is open again
    ANSWER = "answer"  # give the client SGLang's abort answer (with the partial output, if any)

    def __str__(self) -> str:
        return self.value


@dataclass(slots=True)
class MarkTally:
    """What became of the requests one operation marked before aborting their servers, counted by the request
    path as each ends: the ones in flight when it began are not all aborted, some finish first."""

    marked: int = 0
    aborted: int = 0  # ended by the router's abort: answered with it, or re-sent (their client saw nothing)
    finished: int = 0  # ended as they would have without it (the abort came too late), or otherwise
    _all_ended: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    def ended(self, aborted: bool) -> None:
        if aborted:
            self.aborted += 1
        else:
            self.finished += 1
        if self.aborted + self.finished >= self.marked:
            self._all_ended.set()

    async def wait_all_ended(self, timeout: float) -> None:
        """Until every marked request was counted (a request leaves its servers a moment before its end is
        counted), or `timeout`."""
        if self.aborted + self.finished < self.marked:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._all_ended.wait(), max(timeout, 0.0))


class LiveRequest(Protocol):
    """One request the router has in flight on a prefill/decode pair (read-only for flows)."""

    @property
    def prefill(self) -> Worker: ...

    @property
    def decode(self) -> Worker: ...

    @property
    def rids(self) -> Sequence[str]: ...


class RequestPathControl(Protocol):
    # ---- admission: the fleet-wide gate --------------------------------------------------------------
    def close_gate(self, reason: str) -> None:
        """Close admission for `reason`: new requests wait in the bounded queue (retries wait too)."""

    def open_gate(self, reason: str) -> None:
        """`reason` no longer keeps the gate closed; admission opens once no reason is left."""

    @property
    def held_total(self) -> int:
        """Requests that ever had to wait for admission (a difference of two reads counts an operation's)."""

    def admission_state(self) -> dict:
        """Admission's figures for the admin API (open, holds, active, waiting, bounds, totals)."""

    # ---- the legs' silence ---------------------------------------------------------------------------
    def expect_silence(self, reason: str) -> None:
        """The fleet is paused in place for `reason`: answers go silent on purpose, so the upstream idle
        timeout cuts nothing (and silence so far does not count once every reason is released)."""

    def end_silence(self, reason: str) -> None:
        """End the expected silence for `reason`."""

    # ---- live requests -------------------------------------------------------------------------------
    def count_on(self, workers: Iterable[Worker]) -> int:
        """Requests the router has in flight with a leg on any of these workers."""

    def mark_on(self, workers: Iterable[Worker], action: AbortAction, tally: MarkTally | None = None) -> int:
        """Before the router aborts these workers: mark their requests; return how many there were. `tally`
        counts how each of them ends (aborted, or finished first)."""

    def mark_waiting_on_prefill(self, workers: Iterable[Worker], action: AbortAction) -> list[LiveRequest]:
        """Mark the requests on these workers that still wait on their prefill (its leg still runs, their client
        has seen nothing): nothing of them is decoded, so they can be re-sent whole. Return them."""

    def mark_all(self, action: AbortAction) -> list[LiveRequest]:
        """Before the router aborts every server: mark every live request; return them."""

    def mark_rid(self, rid: str, action: AbortAction) -> tuple[LiveRequest, list[str]] | None:
        """Mark the request that knows `rid` and return it with the rids to abort on its two servers (the
        rid itself and, for a parent rid, its sequences'); None when the router does not route it now."""

    def still_live(self, requests: Iterable[LiveRequest]) -> list[LiveRequest]:
        """Those of `requests` that have not ended yet."""

    def cut(self, requests: Iterable[LiveRequest], reason: str) -> None:
        """Stop waiting for these requests' servers (they did not answer an abort): each leg still open is
        cancelled, so a request the client has seen nothing of gets the answer its mark asks for (SGLang's
        abort answer for `ANSWER`), and a stream being relayed ends with an error event (`reason`) and
        [DONE]. The shutdown's last resort before closing connections."""

    def abort(self, requests: Iterable[LiveRequest]) -> None:
        """Send each request's abort, by rid, to both of its servers, in the background over the request
        path's own keep-alive client (a few microseconds each: the shutdown aborts every request left at
        once, while the router is busy)."""
