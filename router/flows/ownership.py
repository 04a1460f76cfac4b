"""The one way a flow owns an operation across the router replicas of its fleet.

`Owned.acquire` takes the coordinator's right to run an operation (a conversion or reinstate of one server, a
fleet-wide operation, abort_all); the flow then asks everything of the other replicas through it:

    run(work)            the operation's waits, cancelled the moment this replica stops owning it (its lease
                         ended): the coordinator's 503 is raised instead, so no wait outlives the lease
    stop_routing(...)    every replica took the servers out of routing and marked its requests on them
    inflight_elsewhere   the other replicas' requests still on a server (the idle wait reads it)
    wait_idle_elsewhere  until the other replicas have no request left (abort_all)
    progress(step)       before an irreversible step: recorded for a replica that takes the operation over,
                         refused (503) when this replica no longer owns it
    release(...)         the outcome published and the right given back, once, shielded from a shutdown

Used as `async with await Owned.acquire(...) as owned:`, it is released on the way out with the outcome the
flow set (`owned.ended(outcome, message)`), "failed" when an error left the block without one. A flow that
needs no agreement (a lone router's conversion: nobody to agree with) holds `Owned.alone(coordinator)`: every
call free, as `LocalCoordinator`'s are. No flow keeps a ticket or calls the coordinator's operation calls
itself (`tests/test_layout.py`); what it gives `Owned` is an `OperationCoordinator` (core/coordination.py:
the operation's ownership and the routing agreement, the two roles asked of here only).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Awaitable, Callable, Sequence, TypeVar

from router.core.coordination import OperationCoordinator, StopAction, StopReport, Ticket, while_owned
from router.core.errors import RouterError

if TYPE_CHECKING:
    from router.core.registry import Worker

T = TypeVar("T")


class Owned:
    def __init__(self, coordinator: OperationCoordinator, ticket: Ticket | None) -> None:
        self.coordinator = coordinator
        self.ticket = ticket
        self.outcome: str | None = None
        self.message = ""
        self._released = False

    @classmethod
    async def acquire(cls, coordinator: OperationCoordinator, kind: str, scope: str, details: dict, *,
                      wait_s: float = 0.0) -> Owned:
        """The right to run `kind` on `scope` (exclusive across the replicas), waiting up to `wait_s` for it;
        the coordinator's Conflict or ServiceUnavailable when it cannot be had."""
        return cls(coordinator, await coordinator.acquire(kind, scope, details, wait_s=wait_s))

    @classmethod
    def alone(cls, coordinator: OperationCoordinator) -> Owned:
        """An operation nobody else needs to agree to: every call free."""
        return cls(coordinator, None)

    @property
    def op_id(self) -> str | None:
        return self.ticket.op_id if self.ticket is not None else None

    async def run(self, work: Awaitable[T], on_lost: Callable[[RouterError], None] = lambda error: None) -> T:
        return await while_owned(self.coordinator, self.ticket, work, on_lost)

    async def stop_routing(self, workers: Sequence[Worker] | None, action: StopAction) -> StopReport:
        return await self.coordinator.stop_routing(self.ticket, workers, action)

    def inflight_elsewhere(self, worker: Worker) -> int:
        return self.coordinator.inflight_elsewhere(self.ticket, worker) if self.ticket is not None else 0

    async def wait_idle_elsewhere(self) -> None:
        if self.ticket is not None:
            await self.coordinator.wait_idle_elsewhere(self.ticket)

    async def progress(self, step: str) -> None:
        if self.ticket is not None:
            await self.coordinator.progress(self.ticket, step)

    def ended(self, outcome: str, message: str = "") -> None:
        """The outcome `release` publishes (the last one set wins)."""
        self.outcome, self.message = outcome, message

    async def release(self, outcome: str | None = None, message: str | None = None) -> None:
        """Publish the outcome and give the right back, once; shielded: a shutdown waits for it, so what the
        operation changed is shared before anyone hears its answer."""
        if outcome is not None:
            self.ended(outcome, self.message if message is None else message)
        if self._released:
            return
        self._released = True
        if self.ticket is not None:  # an operation held alone took nothing to give back
            await asyncio.shield(self.coordinator.release(self.ticket, self.outcome or "failed", self.message))

    async def __aenter__(self) -> Owned:
        return self

    async def __aexit__(self, kind, error, traceback) -> None:
        if self.outcome is None and error is not None:
            self.ended("failed", getattr(error, "message", "") or str(error))
        await self.release()
