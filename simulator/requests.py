"""A request's state inside one simulated worker: its phases, the item itself (`Req`), the weight lock and the
worker's counters. The engine (engine.py) moves items through the phases; the capacity model (capacity.py)
decides when; the load report (loads.py) counts them per queue, as SGLang 0.5.23's scheduler does.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from .tokens import Generator

# phases, in the order a request goes through them
WAITING = "waiting"  # admission queue (running cap / KV token cap)
BOOTSTRAP = "bootstrap"  # prefill: waiting for its decode partner to connect
HANDSHAKE = "handshake"  # decode: reaching the prefill's bootstrap listener
TRANSFER = "transfer"  # prefill: KV published, not yet taken / decode: waiting for the KV
FORWARD = "forward"  # computing the prefill
QUEUED = "queued"  # decode: its KV arrived, waiting for a place in the running batch (SGLang's waiting queue)
DECODE = "decode"  # emitting tokens
RETRACTED = "retracted"  # paused with mode=retract: KV freed, back in the queue
DONE = "done"

ABORTED = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
UNKNOWN_PEER_FAILURE = "Failed due to an unknown reason from another rank"


class RequestFailed(Exception):
    """An SGLang ``prepare_abort`` with a status code: 500 bodies, or an abort chunk in a stream."""

    def __init__(self, message: str, status: int = 500) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


@dataclass(eq=False)
class Req:
    """One scheduled item (a batch of N prompts is N of these)."""

    rid: str
    input_ids: list[int]
    gen: Generator
    route: str = "generate"
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    bootstrap_addr: str | None = None  # "host:port" of the prefill's listener (decode role)
    room: int | None = None
    parallel_sample: bool = False  # n > 1: a decode leg waits for a warm-up KV that never comes
    phase: str = WAITING
    finish_reason: dict | None = None
    kv_tokens: int = 0
    num_retractions: int = 0
    created: float = field(default_factory=time.perf_counter)
    first_output_sent: bool = False
    spans: list[list] = field(default_factory=list)  # [version, start] each time weights changed
    _wake: asyncio.Event | None = None  # made on first wait: most items never wait
    on_abort: Callable[[], Any] | None = None  # interrupts what the item is blocked in (a KV pull)
    done_failed: bool = False  # ended in a RequestFailed (5xx) outcome
    dispatched: bool = False  # past the pause gate: the scheduler knows it (aborts reach it)
    peer_acks: bool = True  # decode: its room's listener belongs to a live prefill (which acks aborts)
    cached_tokens: int = 0  # prompt tokens found in the prefix cache when it was prefilled
    forward_done: bool = False  # prefill: the forward it was batched into has ended
    step_tokens: int = 0  # decode: tokens the batch gave it that it has not emitted yet
    dp_rank: int = 0  # the data-parallel rank that runs it (reported per rank in /v1/loads)
    routed_dp_rank: int | None = None  # the rank its caller chose (simulator/dp_ranks.py)
    disagg_prefill_dp_rank: int | None = None  # the prefill rank holding its KV, as its caller said

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def output_ids(self) -> list[int]:
        return self.gen.output_ids

    @property
    def wake(self) -> asyncio.Event:
        """Set on abort, pause changes and partner events; waiting code clears it and waits."""
        if self._wake is None:
            self._wake = asyncio.Event()
        return self._wake

    def poke(self) -> None:
        if self._wake is not None:
            self._wake.set()

    def abort(self, reason: dict) -> None:
        if self.finish_reason is None:
            self.finish_reason = reason
        self.poke()
        if self.on_abort is not None:
            hook, self.on_abort = self.on_abort, None
            hook()


class RWLock:
    """Writer-preferring async read/write lock (SGLang's ``model_update_lock``), fast path for readers."""

    def __init__(self) -> None:
        self.readers = 0
        self.writer = False
        self.waiting_writers = 0
        self._waiters: list[asyncio.Future] = []

    @property
    def locked(self) -> bool:
        return self.readers > 0 or self.writer

    def _notify(self) -> None:
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    async def _wait(self) -> None:
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        await fut

    async def acquire_read(self) -> None:
        while self.writer or self.waiting_writers:
            await self._wait()
        self.readers += 1

    def release_read(self) -> None:
        self.readers -= 1
        if self.readers == 0:
            self._notify()

    async def acquire_write(self) -> None:
        self.waiting_writers += 1
        try:
            while self.writer or self.readers:
                await self._wait()
        finally:
            self.waiting_writers -= 1
        self.writer = True

    def release_write(self) -> None:
        self.writer = False
        self._notify()


@dataclass
class Counters:
    requests_by_route: dict[str, int] = field(default_factory=dict)
    items_started: int = 0
    items_finished: int = 0
    items_aborted: int = 0
    items_failed: int = 0
    abort_requests: int = 0  # POST /abort_request calls
    abort_all_requests: int = 0
    aborts_matched: int = 0  # items an abort call actually reached
    client_disconnects: int = 0
    faults_injected: int = 0
    kv_pulls_served: int = 0  # prefill side: rooms handed to a decode worker
    kv_pulls_made: int = 0  # decode side: rooms fetched from a prefill worker
    kv_mismatches: int = 0  # decode got a room whose prompt differs from its own (router bug)
    bootstrap_failures: int = 0
    prompt_tokens: int = 0
    prefill_tokens: int = 0  # prompt tokens of the forwards run (cached ones included)
    cached_tokens: int = 0  # of those, found in the prefix cache
    generation_tokens: int = 0
    weight_updates: int = 0
    role_switches: int = 0
    cache_flushes: int = 0  # successful flushes of the cache (/flush_cache, or the one after a weight update)


def leg_failure(req: Req, role: str, stage: str, reason: str | None) -> RequestFailed:
    """SGLang's 500 for a PD leg whose partner failed: the prefill's bootstrap or transfer, the decode's handshake
    or transfer (the message names the stage and the room)."""
    req.done_failed = True
    cause = f"with exception KVTransferError(bootstrap_room={req.room}): {reason or UNKNOWN_PEER_FAILURE}"
    if role == "prefill":
        what = "Prefill bootstrap failed" if stage == "bootstrap" else "Prefill transfer failed"
        return RequestFailed(f"{what} for request rank=0 req.rid={req.rid!r} req.bootstrap_room={req.room} {cause}")
    what = "Decode handshake failed" if stage == "handshake" else "Decode transfer failed"
    return RequestFailed(f"{what} for request rank=0 decode_req.req.rid={req.rid!r} "
                         f"decode_req.req.bootstrap_room={req.room} {cause}")
