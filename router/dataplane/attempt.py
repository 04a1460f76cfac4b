"""One attempt of a client request on one prefill/decode pair, and its two legs.

The live index holds attempts by rid and flows mark them before the router aborts their servers; the
dispatcher runs their legs. A leg holds its worker's in-flight count from dispatch until it is finished,
exactly once, whatever ends it (answer, failure, cancellation, or the background task that outlives it).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Protocol

import orjson
from aiohttp import web

from policies import Outcome
from router.core.registry import Role, Worker
from router.core.traffic import AbortAction

# SGLang's message for a KV transfer that failed: it implicates the pair, not necessarily this server.
KV_TRANSFER_FAILURE = b"KVTransferError"


class LegFailed(Exception):
    """A leg failed before the client saw a byte; carries what to answer if it is not retried."""

    def __init__(self, worker: Worker, status: int, body: bytes, content_type: str, *, retryable: bool,
                 reason: str, router_abort: bool = False):
        super().__init__(reason)
        self.worker = worker
        self.status = status
        self.body = body
        self.content_type = content_type
        self.retryable = retryable
        self.reason = reason
        self.router_abort = router_abort

    @property
    def worker_fault(self) -> bool:
        """Unreachable or 5xx, not caused by the router's own abort nor by the partner leg (a failed KV
        transfer): counts against this worker's breaker."""
        return self.status >= 500 and not self.router_abort and KV_TRANSFER_FAILURE not in self.body

    def response(self) -> web.Response:
        if self.body:
            return web.Response(body=self.body, status=self.status, content_type=self.content_type or None)
        return web.json_response({"error": {"message": self.reason, "type": "upstream_error",
                                            "code": self.status}}, status=self.status,
                                 dumps=lambda o: orjson.dumps(o).decode())


@dataclass(slots=True, eq=False)
class Attempt:
    prefill: Worker
    decode: Worker
    payload: bytes
    rids: list[str]
    epochs: tuple[int, int]
    legs: list["Leg"] = field(default_factory=list)
    evicted: str | None = None  # why the router gave up on one of its workers (see Proxy.evict)
    streaming: bool = False  # the client has seen bytes of this attempt: it can no longer be re-sent
    # Set (through `Proxy.live`) when an operator or a flow aborts this attempt.
    abort_action: AbortAction | None = None
    # A prefill leg still runs after decode answered (`Dispatcher.linger`), and the client's request is over:
    # the attempt stays live (abortable by rid, counted by the flows) until both are true of it no more.
    lingering: bool = False
    ended: bool = False
    relaying: object | None = None  # decode's UpstreamResponse while it is relayed to the client

    def router_aborted(self) -> bool:
        return self.abort_action is not None or (self.prefill.abort_epoch, self.decode.abort_epoch) != self.epochs


class LegOwner(Protocol):
    """What a leg reports to (the dispatcher): its end, and the aborts it needs sent."""

    def leg_done(self, worker: Worker, role: Role, outcome: Outcome, fault: bool = True) -> None: ...

    def abort_on(self, worker: Worker, rids: list[str]) -> None: ...


class Leg:
    """One leg of a request: its task and its hold on the worker, released exactly once."""

    __slots__ = ("owner", "worker", "role", "task", "is_open", "detached")

    def __init__(self, owner: LegOwner, worker: Worker, role: Role, task: asyncio.Task) -> None:
        self.owner, self.worker, self.role, self.task = owner, worker, role, task
        self.is_open = True
        self.detached = False

    def finish(self, outcome: Outcome, fault: bool = True) -> None:
        """`fault`: whether an ERROR outcome counts against the worker (passive health)."""
        if self.is_open:
            self.is_open = False
            self.owner.leg_done(self.worker, self.role, outcome, fault)

    def cancel(self, rids: list[str]) -> None:
        """Stop the leg here and on its server (the other leg failed, or the client left)."""
        if self.is_open:
            if not self.task.done():
                self.task.cancel()
            self.owner.abort_on(self.worker, rids)
            self.finish(Outcome.CANCELLED)

    def detach(self) -> None:
        """Ownership moved to a background task that will finish the leg."""
        self.detached = True

    def ensure_closed(self) -> None:
        """Last resort on unexpected errors: never leak a count or a task."""
        if self.is_open and not self.detached:
            if not self.task.done():
                self.task.cancel()
            self.finish(Outcome.ERROR, fault=False)


async def first_done(tasks) -> None:
    """Wait until one of `tasks` is done; like asyncio.wait(FIRST_COMPLETED), without its per-call sets and
    checks (twice per request). Never cancels the tasks, never raises their exceptions."""
    waiter = asyncio.get_running_loop().create_future()

    def wake(_task) -> None:
        if not waiter.done():
            waiter.set_result(None)

    for task in tasks:
        task.add_done_callback(wake)
    try:
        await waiter
    finally:
        for task in tasks:
            task.remove_done_callback(wake)
