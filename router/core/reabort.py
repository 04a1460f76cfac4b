"""Abort again until they end: the one re-abort loop of every flow (a conversion's shed and abort steps, a
fleet's quiesce, `/abort_request`, a replica's barrier, the shutdown).

SGLang answers an abort at once and aborts later, and a leg already on the wire can reach its server after the
abort did: only another abort ends that request. So whoever aborts looks again until what it aborted has ended,
and aborts again what has not. It lives in core, the layer every other one may import (flows, cluster/'s
barrier and server/'s shutdown all abort).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from typing import TYPE_CHECKING, Awaitable, Callable, Iterable, Sequence, TypeVar

if TYPE_CHECKING:
    from router.core.registry import Registry, Worker

T = TypeVar("T")

# The one re-abort timing. The first re-abort comes ABORT_AGAIN_S after the abort (several scheduler steps: the
# abort has had its chance; a late leg keeps a worker or the fleet out of service no longer than that), then
# the interval doubles up to ABORT_AGAIN_MAX_S, so hundreds of requests that do not end (a shutdown, a server
# that ignores aborts) do not load a busy router with a round of POSTs every quarter second.
ABORT_AGAIN_S = 0.25
ABORT_AGAIN_MAX_S = 2.0
LOOK_S = (0.005, 0.1)  # between two looks at what is still alive: the first wait, the longest


async def abort_until_ended(alive: Callable[[], Sequence[T] | Awaitable[Sequence[T]]],
                            abort: Callable[[Sequence[T]], object] | None, deadline: float, *,
                            aborted_at: float | None = None,
                            wait: Callable[[Sequence[T], float], Awaitable[object]] | None = None) -> list[T]:
    """Abort what `alive()` names, then look again until it names nothing, aborting again what it still names
    ABORT_AGAIN_S after, then at doubling intervals up to ABORT_AGAIN_MAX_S.

    `alive` says what "ended" means to the caller (its aborted requests still live, its servers still busy);
    `abort(pending)` is what the caller aborts them with (by rid, `abort_all` on servers; sync or async), or
    None to wait without aborting. A caller that sent the first abort itself (it needs the answers) gives its
    time, `aborted_at` (monotonic). `wait(pending, seconds)` waits between looks (a sleep by default; a caller
    may wake earlier on a state change). Both `alive` and `abort` may be sync or async.

    Returns [] once `alive()` names nothing; when `deadline` (monotonic; `math.inf`: until cancelled) passes
    first, what it still names (aborted at least once, unless it was first named after the last round): the
    caller settles them (504, cut, busy)."""
    pending = list(await _result(alive()))
    if pending and abort is not None and aborted_at is None:
        await _result(abort(pending))
        aborted_at = time.monotonic()
    again, look = ABORT_AGAIN_S, LOOK_S[0]
    while pending:
        now = time.monotonic()
        if now >= deadline:
            return pending
        if abort is not None and now - aborted_at >= again:
            await _result(abort(pending))
            aborted_at, again = time.monotonic(), min(again * 2, ABORT_AGAIN_MAX_S)
        pause = max(min(look, deadline - time.monotonic()), 0.0)
        await (asyncio.sleep(pause) if wait is None else wait(pending, pause))
        look = min(look * 2, LOOK_S[1])
        pending = list(await _result(alive()))
    return []


async def wake_when_router_idle(registry: Registry, workers: Iterable[Worker], seconds: float) -> None:
    """A `wait` for `abort_until_ended`: `seconds`, or less once the router's side of the first of `workers`
    that has requests empties (the servers' side is polled)."""
    routed = [w for w in workers if w.inflight]
    if routed:
        await registry.wait_idle(routed[0], seconds)
    else:
        await asyncio.sleep(seconds)


async def _result(value):
    return await value if inspect.isawaitable(value) else value
