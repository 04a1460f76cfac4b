"""Public fan-out routes answered once for many callers.

`/health_generate` runs a generation on every server and the info routes call every server (`/model_info`
up to three GETs each); they are public, so a loop of anonymous calls would multiply into load on the
fleet. Each such route gets a `SharedAnswer`: one computation in flight at a time, whose answer every
caller that arrived meanwhile gets (coalescing), and, where the route allows it, reused for `ttl` seconds
after (the info routes; not `/health_generate`, whose job is a fresh check). Any change to the registry
(a worker added, removed, moved, its health or facts) drops a kept answer, and an answer computed across
such a change is not kept.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Awaitable, Callable

from aiohttp import web

from router.core.keys import REGISTRY

Produce = Callable[[], Awaitable[Any]]


class SharedAnswer:
    __slots__ = ("ttl", "_clock", "_running", "_kept", "_expires", "_generation", "waiting", "computed")

    def __init__(self, ttl: float = 0.0, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl = ttl
        self._clock = clock
        self._running: asyncio.Future | None = None
        self._kept: asyncio.Future | None = None  # a finished computation, reused until _expires
        self._expires = 0.0
        self._generation = 0
        self.waiting = 0  # callers awaiting the computation in flight
        self.computed = 0  # computations started (for tests and curiosity)

    def invalidate(self) -> None:
        self._kept = None
        self._generation += 1

    async def get(self, produce: Produce) -> Any:
        """The answer (or the error) of one computation of `produce`, shared; a caller that leaves does not
        cancel it for the others."""
        kept = self._kept
        if kept is not None and self._clock() < self._expires:
            return kept.result()
        if self._running is None:
            self.computed += 1
            self._running = asyncio.ensure_future(produce())
            self._running.add_done_callback(self._finished(self._generation))
        self.waiting += 1
        try:
            return await asyncio.shield(self._running)
        finally:
            self.waiting -= 1

    def _finished(self, generation: int) -> Callable[[asyncio.Future], None]:
        def done(future: asyncio.Future) -> None:
            self._running = None
            if future.cancelled():
                return
            future.exception()  # retrieved here: every caller may have left
            if self.ttl > 0 and generation == self._generation:
                self._kept, self._expires = future, self._clock() + self.ttl
        return done

    def close(self) -> None:
        if self._running is not None:
            self._running.cancel()


SHARED_ANSWERS = web.AppKey("shared_answers", dict)


def shared_answer(app: web.Application, name: str, ttl: float = 0.0) -> SharedAnswer:
    """The app's SharedAnswer for a route (routes that give the same answer share a name)."""
    if SHARED_ANSWERS not in app:
        app[SHARED_ANSWERS] = {}
        app[REGISTRY].subscribe(lambda event, worker, details: _invalidate_all(app))
        app.on_cleanup.append(_close_all)
    answers = app[SHARED_ANSWERS]
    if name not in answers:
        answers[name] = SharedAnswer(ttl)
    return answers[name]


def _invalidate_all(app: web.Application) -> None:
    for answer in app[SHARED_ANSWERS].values():
        answer.invalidate()


async def _close_all(app: web.Application) -> None:
    for answer in app[SHARED_ANSWERS].values():
        answer.close()
