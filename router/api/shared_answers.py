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

from router.core.registry import Registry

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


class SharedAnswers:
    """The router's SharedAnswer of each shared route, by name (routes that give the same answer share one),
    each with its TTL; any change to the registry drops every kept answer."""

    def __init__(self, registry: Registry, ttls: dict[str, float]) -> None:
        self._answers = {name: SharedAnswer(ttl) for name, ttl in ttls.items()}
        registry.subscribe(self._on_registry_event)

    def __getitem__(self, name: str) -> SharedAnswer:
        return self._answers[name]

    def _on_registry_event(self, event: str, worker, details: dict) -> None:
        for answer in self._answers.values():
            answer.invalidate()

    def close(self) -> None:
        for answer in self._answers.values():
            answer.close()


SHARED_ANSWERS = web.AppKey("shared_answers", SharedAnswers)
