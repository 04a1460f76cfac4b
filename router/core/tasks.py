"""The background tasks a router owns: kept referenced, their failures logged, cancelled and awaited on close.

One `BackgroundTasks` per router (the composition root builds it); every long-lived object that starts tasks
is given its `spawn`, so nothing the router starts outlives it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

logger = logging.getLogger(__name__)

Spawn = Callable[[Awaitable], asyncio.Task]  # what an object that starts background work is given


class BackgroundTasks:
    """Tasks the router owns: kept referenced, cancelled and awaited on clean-up."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task] = set()

    def spawn(self, coro: Awaitable) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("background task failed", exc_info=task.exception())

    def __len__(self) -> int:
        return len(self._tasks)

    async def close(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
