"""`Owned`, the one way a flow owns an operation across the replicas (issue 32): released once, shielded from
its caller's cancellation, with the outcome the flow set ("failed" when an error left the block without one);
an operation held alone gives nothing back."""

from __future__ import annotations

import asyncio

import pytest

from router.core.coordination import LocalCoordinator, Ticket
from router.core.errors import Conflict
from router.flows.ownership import Owned


class Releases(LocalCoordinator):
    """A lone router's coordinator that records each release; `hold` keeps a release waiting until set."""

    def __init__(self) -> None:
        super().__init__(registry=None, traffic=None)  # neither is read by the operation calls
        self.released: list[tuple[str, str, str]] = []
        self.hold: asyncio.Event | None = None
        self.entered = asyncio.Event()  # a release began
        self.published = asyncio.Event()  # a release ended

    async def release(self, ticket: Ticket, outcome: str, message: str = "") -> None:
        self.entered.set()
        if self.hold is not None:
            await self.hold.wait()
        self.released.append((ticket.op_id, outcome, message))
        self.published.set()


async def test_the_outcome_set_is_published_once_however_often_release_is_called():
    coordinator = Releases()
    async with await Owned.acquire(coordinator, "conversion", "worker/http://a", {}) as owned:
        owned.ended("succeeded", "switched")
        await owned.release()
    await owned.release("failed", "too late")
    assert coordinator.released == [(owned.op_id, "succeeded", "switched")]


async def test_an_error_leaving_the_block_without_an_outcome_is_published_as_failed():
    coordinator = Releases()
    with pytest.raises(Conflict):
        async with await Owned.acquire(coordinator, "abort_all", "abort", {}) as owned:
            raise Conflict("another replica runs one")
    assert coordinator.released == [(owned.op_id, "failed", "another replica runs one")]


async def test_a_release_outlives_its_callers_cancellation():
    coordinator = Releases()
    owned = await Owned.acquire(coordinator, "update_weights_from_disk", "fleet", {})
    coordinator.hold = asyncio.Event()
    caller = asyncio.ensure_future(owned.release("succeeded"))
    async with asyncio.timeout(5):
        await coordinator.entered.wait()  # the caller waits inside the coordinator's release
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    coordinator.hold.set()
    async with asyncio.timeout(5):
        await coordinator.published.wait()
    assert coordinator.released == [(owned.op_id, "succeeded", "")]


async def test_an_operation_held_alone_gives_nothing_back():
    coordinator = Releases()
    async with Owned.alone(coordinator) as owned:
        owned.ended("succeeded")
    await owned.release()
    assert coordinator.released == [] and owned.op_id is None
