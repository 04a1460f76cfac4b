"""One attempt of a client request on one prefill/decode pair, and its two legs.

The live index holds attempts by rid and flows mark them before the router aborts their servers; the
dispatcher runs their legs. A leg holds its worker's in-flight count from dispatch until it is finished,
exactly once, whatever ends it (answer, failure, cancellation, or the background task that outlives it).
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass, field
from typing import Protocol

import orjson
from aiohttp import web

from policies import LegOutcome
from router.core.registry import Role, Worker
from router.core.traffic import AbortAction, MarkTally
from router.dataplane.leg_aborts import LegAborts

# SGLang's message for a KV transfer that failed: it implicates the pair, not necessarily this server.
KV_TRANSFER_FAILURE = b"KVTransferError"


class LegFailed(Exception):
    """A leg failed before the client saw a byte; carries what to answer if it is not retried.

    `signature`: what the failure looks like whichever server it came from (the status and the server's words,
    numbers and ids masked), for a failure the request itself may cause: a server's own 500 or 501 answer, or
    a server that closed the connection before answering (a request that crashes it). None for the rest
    (unreachable, silent, timed out, 502-504: the server's state, not the request's). Two attempts of one request
    failing with the same signature on two pairs is the request's fault (`Proxy`)."""

    def __init__(self, worker: Worker, status: int, body: bytes, content_type: str, *, retryable: bool,
                 reason: str, abort: AbortAction | None = None, signature: bytes | None = None,
                 local: str | None = None):
        super().__init__(reason)
        self.worker = worker
        self.status = status
        self.body = body
        self.content_type = content_type
        self.retryable = retryable
        self.reason = reason
        # The router aborted the attempt's servers: what to do with it (`Dispatcher.router_abort` decides).
        self.abort = abort
        self.signature = signature
        # The router ran out of its own descriptors or ports (EMFILE, ...) before the leg was sent: no server's
        # fault; the request waits for a descriptor and is retried on the same pair.
        self.local = local

    @property
    def worker_fault(self) -> bool:
        """Unreachable or 5xx, not caused by the router's own abort nor by the partner leg (a failed KV
        transfer): counts against this worker's breaker."""
        return (self.status >= 500 and self.abort is None and self.local is None
                and KV_TRANSFER_FAILURE not in self.body)

    @property
    def blame_now(self) -> bool:
        """A worker fault the request cannot have caused: it counts at once. One with a signature counts
        once the request shows it is not its own (`Proxy`, `Dispatcher.blame`)."""
        return self.worker_fault and self.signature is None

    def response(self) -> web.Response:
        """What the client gets: the server's error as a JSON error body, else the router's own."""
        if self.body:
            return relayed_error(self.status, self.body, self.content_type)
        return error_response(self.status, self.reason, "upstream_error")


# Numbers, hex ids and rids in a server's message differ from one attempt to the next (rids, rooms, ports).
_VARYING = re.compile(rb"[0-9a-fA-F]{8,}|\d+")
SIGNATURE_BYTES = 512


def answer_signature(status: int, body: bytes) -> bytes:
    return b"%d " % status + _VARYING.sub(b"#", body[:SIGNATURE_BYTES])


def error_response(status: int, message: str, kind: str, extra: dict | None = None) -> web.Response:
    body = {**(extra or {}), "error": {"message": message, "type": kind, "code": status}}
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")


def relayed_error(status: int, body: bytes, content_type: str) -> web.Response:
    """A server's error answer as a JSON error `{"error": {"message", "type", "code"}}`: as it is when it is one
    already; SGLang's other shapes (`{"object": "error", "message"}`, `{"error": "text"}`, FastAPI's
    `{"detail": ...}`) keep their fields and gain the `error` object; text becomes its message."""
    data = None
    if body[:1] in (b"{", b"[") or "json" in (content_type or ""):
        try:
            data = orjson.loads(body)
        except orjson.JSONDecodeError:
            data = None
    kind = "invalid_request_error" if status < 500 else "upstream_error"
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return web.Response(body=body, status=status, content_type="application/json")
        message = next((v for v in (error, data.get("message"), data.get("detail")) if v), None)
        if not isinstance(message, str):
            message = orjson.dumps(message).decode() if message is not None else body[:1000].decode(errors="replace")
        if isinstance(data.get("type"), str):
            kind = data["type"]
        return error_response(status, message, kind, {k: v for k, v in data.items() if k != "error"})
    text = body[:1000].decode(errors="replace").strip() or f"the server answered {status}"
    return error_response(status, text, kind)


@dataclass(slots=True, eq=False)
class Attempt:
    prefill: Worker
    decode: Worker
    payload: bytes
    rids: list[str]
    epochs: tuple[int, int]
    legs: list["Leg"] = field(default_factory=list)
    evicted: str | None = None  # why the router gave up on one of its workers (see Eviction.evict)
    streaming: bool = False  # the client has seen bytes of this attempt: it can no longer be re-sent
    # Set (through `Proxy.live`) when an operator or a flow aborts this attempt.
    abort_action: AbortAction | None = None
    tally: MarkTally | None = None  # the marking operation's count of how its requests end
    ended_aborted: bool = False  # its answer (a whole one, or a stream's last event) says the abort ended it
    # A prefill leg still runs after decode answered (`Dispatcher.linger`), and the client's request is over:
    # the attempt stays live (abortable by rid, counted by the flows) until both are true of it no more.
    lingering: bool = False
    ended: bool = False
    relaying: object | None = None  # decode's UpstreamResponse while it is relayed to the client
    traces: tuple | None = None  # (prefill's, decode's) LegTrace with --enable-trace (core/tracing.py)
    # `--dp-aware`: the decode leg's own body (its rank differs from the prefill's) and the ranks chosen.
    decode_payload: bytes | None = None
    ranks: tuple[int, int] | None = None

    @property
    def waiting_on_prefill(self) -> bool:
        """Its prefill leg still runs and its client has seen nothing of it: it waits for a prefill forward
        (or for decode room), nothing of it is decoded yet, and it can be re-sent whole (`StopAction.SHED`)."""
        if self.streaming or self.lingering or self.ended:
            return False
        return any(leg.role is Role.PREFILL and leg.is_open and not leg.task.done() for leg in self.legs)

    def give_up_on(self, worker: Worker, reason: str) -> bool:
        """Stop waiting on `worker` for this attempt (`Eviction.evict`): its leg there is stopped and the attempt
        fails as `reason` says, to be retried on another pair. False (nothing done) once the client has seen
        bytes of it, or when it has no open leg of its own there."""
        if self.streaming:
            return False
        for leg in self.legs:
            if leg.worker is worker and leg.is_open and not leg.detached and not leg.task.done():
                self.evicted = reason
                leg.stop()
                return True
        return False

    def cut(self, why: BaseException) -> None:
        """Stop waiting for its servers (the shutdown's last resort): a stream being relayed ends (`why`), and
        every leg still open is stopped, so the attempt answers what its mark asks for."""
        if self.relaying is not None:
            self.relaying.cut(why)
        for leg in self.legs:
            if leg.is_open:
                leg.stop()


class LegOwner(Protocol):
    """What a leg reports to (the dispatcher): its end, and the aborts it needs sent."""

    def leg_done(self, worker: Worker, role: Role, outcome: LegOutcome, fault: bool = True) -> None: ...

    @property
    def aborts(self) -> LegAborts: ...


class Leg:
    """One leg of a request: its task and its hold on the worker, released exactly once."""

    __slots__ = ("owner", "worker", "role", "task", "is_open", "detached", "trace")

    def __init__(self, owner: LegOwner, worker: Worker, role: Role, task: asyncio.Task, trace=None) -> None:
        self.owner, self.worker, self.role, self.task = owner, worker, role, task
        self.is_open = True
        self.detached = False
        self.trace = trace  # its span (core/tracing.py LegTrace), ended with it

    def finish(self, outcome: LegOutcome, fault: bool = True) -> None:
        """`fault`: whether an ERROR outcome counts against the worker (passive health)."""
        if self.is_open:
            self.is_open = False
            self.owner.leg_done(self.worker, self.role, outcome, fault)
            if self.trace is not None:
                self.trace.end(outcome.value)

    def stop(self) -> None:
        """Cancel its task (if still running); whoever awaits it concludes the leg. The one place a leg's
        task is cancelled: `cancel`, `ensure_closed`, an eviction, a cut and an overdue lingering leg all
        come here."""
        if not self.task.done():
            self.task.cancel()

    def cancel(self, rids: list[str]) -> None:
        """Stop the leg here and on its server (the other leg failed, or the client left)."""
        if self.is_open:
            self.stop()
            self.owner.aborts.abort_on(self.worker, rids)
            self.finish(LegOutcome.CANCELLED)

    def detach(self) -> None:
        """Ownership moved to a background task that will finish the leg."""
        self.detached = True

    def ensure_closed(self) -> None:
        """Last resort on unexpected errors: never leak a count or a task."""
        if self.is_open and not self.detached:
            self.stop()
            self.finish(LegOutcome.ERROR, fault=False)


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
