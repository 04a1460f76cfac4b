"""Small test helpers: waiting on a condition with a deadline, free ports."""

from __future__ import annotations

import asyncio
import inspect
import time

from harness.processes import free_port  # noqa: F401: the tests' free port is every harness's


async def wait_for(condition, timeout: float = 5.0, interval: float = 0.01, message: str = "") -> None:
    """Wait until condition() (sync or async) is truthy; fail the test at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s: {message or condition}")
        await asyncio.sleep(interval)

