"""A first-come-first-served queue of requests waiting for room (PD admission's prefill room, the legs'
descriptors): each waits its turn and goes when it heads the queue and its owner says there is room.

Room comes back without telling (a breaker half-open emits nothing), so the head looks again every
`HEAD_RECHECK_S`; otherwise a waiter sleeps until woken (`wake_head`, called by the owner when room is freed,
and by the queue itself after a head leaves: the next one looks)."""

from __future__ import annotations

import asyncio
import collections
from typing import Callable

HEAD_RECHECK_S = 1.0


class Turns:
    __slots__ = ("_waiters",)

    def __init__(self) -> None:
        self._waiters: collections.deque[asyncio.Event] = collections.deque()

    def __len__(self) -> int:
        return len(self._waiters)

    async def wait(self, ready: Callable[[], bool]) -> None:
        """Until this caller heads the queue and `ready()` holds. The caller's deadline bounds it (cancellation
        leaves the queue and wakes the next head)."""
        me = asyncio.Event()
        waiters = self._waiters
        waiters.append(me)
        try:
            while not (waiters[0] is me and ready()):
                me.clear()
                try:
                    async with asyncio.timeout(HEAD_RECHECK_S if waiters[0] is me else None):
                        await me.wait()
                except TimeoutError:
                    pass
        finally:
            head = waiters[0] is me
            waiters.remove(me)
            if head and waiters:  # after this one took its room (this step): the next looks
                asyncio.get_running_loop().call_soon(self.wake_head)

    def wake_head(self) -> None:
        if self._waiters:
            self._waiters[0].set()
