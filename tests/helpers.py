"""Small test helpers: waiting on a condition with a deadline, free ports."""

from __future__ import annotations

from harness.processes import await_until, free_port  # noqa: F401: the tests' free port is every harness's


async def wait_for(condition, timeout: float = 5.0, interval: float = 0.01, message: str = "") -> None:
    """Wait until condition() (sync or async) is truthy; fail the test at the deadline. Every harness's wait
    (`harness.processes.await_until`), with the tests' defaults and a test failure for its timeout."""
    try:
        await await_until(condition, timeout=timeout, what=message or repr(condition), interval=interval)
    except TimeoutError as exc:
        raise AssertionError(str(exc)) from None

