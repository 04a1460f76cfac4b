"""The simulated scheduler: request states, admission caps, PD legs, abort, pause and the weight lock.

One ``Engine`` per worker. It mirrors what SGLang's TokenizerManager + Scheduler do with a
request, with the same phases (the abort message a client gets depends on the phase):

    prefill: bootstrap (wait for the decode leg) -> forward -> transfer (decode pulls the KV)
    decode:  handshake (reach the prefill's bootstrap listener) -> transfer (wait for its KV) -> decode
    null:    waiting (admission) -> forward -> decode

Every wait has a deadline and wakes on abort, so nothing here can hang without an outcome.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from .config import WorkerConfig
from .faults import FaultInjector
from .prefix_cache import PrefixCache
from .tokens import Generator

if TYPE_CHECKING:
    from .bootstrap import KvClient, RoomStore

# phases, in the order a request goes through them
WAITING = "waiting"  # admission queue (running cap / KV token cap)
BOOTSTRAP = "bootstrap"  # prefill: waiting for its decode partner to connect
HANDSHAKE = "handshake"  # decode: reaching the prefill's bootstrap listener
TRANSFER = "transfer"  # prefill: KV published, not yet taken / decode: waiting for the KV
FORWARD = "forward"  # computing the prefill
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


class Engine:
    """Request state for one worker; the HTTP layer (worker.py) calls into it."""

    def __init__(self, config: WorkerConfig, faults: FaultInjector, rooms: "RoomStore",
                 kv_client: "KvClient | None" = None) -> None:
        self.config = config
        self._timing_zero = config.timing.zero
        self.role = config.role
        self.faults = faults
        self.rooms = rooms
        self.kv_client = kv_client
        self.requests: dict[str, Req] = {}  # live items by rid (SGLang's rid_to_state)
        self.waiting: deque[Req] = deque()
        self.prefill_queue: deque[Req] = deque()  # admitted, waiting for a prefill compute slot
        self.prefill_busy = 0
        self.decoding = 0  # requests in a decode loop: the batch whose size sets the decode step time
        self.prefix_cache = PrefixCache(config.prefix_cache_tokens) if config.prefix_cache_tokens else None
        self.running = 0
        self.used_tokens = 0
        self.lock = RWLock()
        self.inflight_calls = 0  # generate calls holding the read lock
        self.is_pause = False  # tokenizer-level pause: new calls wait
        self.pause_mode: str | None = None  # scheduler-level pause: "retract" | "in_place"
        self._unpaused = asyncio.Event()
        self._unpaused.set()
        self._scheduler_resumed = asyncio.Event()
        self._scheduler_resumed.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self.weight_version = config.weight_version  # scheduler's: meta_info, internal_states
        self.model_version = config.weight_version  # tokenizer's: /model_info
        self.model_path = config.model_path
        self.deferred_release_until = 0.0
        self.last_output = 0.0
        self.counters = Counters()
        self.started_at = time.time()
        self.unhealthy = False  # a failed role switch left this worker broken
        self.switch_in_progress = False
        self.weight_session_open = False
        self.released_memory: set[str] = set()  # GPU memory tags given back, until resumed
        self.flush_pending = False
        self.last_gen_throughput = 0.0

    # ------------------------------------------------------------ admission of calls

    async def enter_call(self) -> None:
        """A generate call: wait while paused, then hold the weight lock's read side."""
        while self.is_pause:
            await self._unpaused.wait()
        await self.lock.acquire_read()
        self.inflight_calls += 1
        self._idle.clear()

    def leave_call(self) -> None:
        self.inflight_calls -= 1
        self.lock.release_read()
        if self.inflight_calls == 0 and not self.requests:
            self._idle.set()

    def dispatch(self, reqs: list[Req]) -> None:
        """The call passed the pause gate and holds the read lock: the scheduler now has its items."""
        for req in reqs:
            req.dispatched = True
            req.spans = [[self.weight_version, 0]]

    def register(self, req: Req) -> None:
        self.requests[req.rid] = req
        self.counters.items_started += 1
        self.counters.prompt_tokens += len(req.input_ids)

    def unregister(self, req: Req) -> None:
        if self.requests.get(req.rid) is req:
            del self.requests[req.rid]
        if req.phase != DONE:
            self._release_kv(req)
            if req in self.waiting:
                self.waiting.remove(req)
            req.phase = DONE
        if req.finish_reason and req.finish_reason.get("type") == "abort":
            self.counters.items_aborted += 1
        else:
            self.counters.items_finished += 1
        if self.inflight_calls == 0 and not self.requests:
            self._idle.set()

    # ------------------------------------------------------------ the life of one item

    async def run(self, req: Req, on_progress: Callable[[Req], Awaitable[None]] | None = None) -> None:
        """Take ``req`` through its phases until it finishes; sets ``req.finish_reason``.

        Raises RequestFailed for SGLang's 5xx outcomes (bootstrap/transfer failures).
        ``on_progress`` is awaited after every new token (streaming).
        """
        try:
            if req.done:  # its client left while the call waited for the pause or the weight lock
                return
            if self.faults.faults.hang:
                await self._park(req, None)
                return
            if self.role == "prefill":
                await self._run_prefill(req)
            elif self.role == "decode":
                await self._run_decode(req, on_progress)
            elif on_progress is None and self._instant(req):
                return
            else:
                await self._admit(req)
                if req.done:
                    return
                await self._forward(req)
                await self._decode_loop(req, on_progress)
        finally:
            self._release_kv(req)

    async def _run_prefill(self, req: Req) -> None:
        if req.parallel_sample:  # SGLang's n>1 prefill legs end without a decode partner (seen on 0.5.23)
            await self._admit(req)
            if not req.done:
                await self._forward(req)
                req.gen.step(1)
                req.finish_reason = {"type": "length", "length": 0}
            return
        room = self.rooms.open_prefill(req.room, req.rid, req.input_ids, waiter=req)
        succeeded = False
        try:
            req.phase = BOOTSTRAP
            deadline = time.monotonic() + self.config.bootstrap_timeout_s
            await self._wait_until(req, lambda: room.decode_attached or room.failed, deadline)
            if room.failed:
                raise self._prefill_failure(req, "bootstrap", room.failure_reason)
            if req.done:  # aborted while waiting for the decode leg
                raise self._prefill_failure(req, "bootstrap", "Aborted by AbortReq.")
            if not room.decode_attached:
                raise self._prefill_failure(
                    req, "bootstrap",
                    f"Request {req.room} timed out after {self.config.bootstrap_timeout_s:.1f}s "
                    "in KVPoll.Bootstrapping")
            await self._admit(req)
            if req.done:
                raise self._prefill_failure(req, "bootstrap", "Aborted by AbortReq.")
            await self._forward(req)
            if req.done or room.failed:
                raise self._prefill_failure(req, "transfer", room.failure_reason if room.failed
                                            else "Aborted by AbortReq.")
            req.gen.step(1)
            req.phase = TRANSFER
            if self.config.timing.kv_transfer_s:
                await self._sleep(req, self.config.timing.kv_transfer_s)
            room.publish(first_token=req.gen.output_ids[0], weight_version=self.weight_version,
                         cached_tokens=req.cached_tokens)
            deadline = time.monotonic() + self.config.kv_wait_timeout_s
            await self._wait_until(req, lambda: room.taken or room.failed, deadline)
            if not room.taken:
                if room.failed:
                    raise self._prefill_failure(req, "transfer", room.failure_reason)
                if req.done:
                    raise self._prefill_failure(req, "transfer", "Aborted by AbortReq.")
                raise self._prefill_failure(
                    req, "transfer",
                    f"Request {req.room} timed out after {self.config.kv_wait_timeout_s:.1f}s "
                    "in KVPoll.WaitingForInput")
            req.finish_reason = {"type": "length", "length": 0}
            self.counters.kv_pulls_served += 1
            succeeded = True
        finally:
            self.rooms.close_prefill(room, succeeded=succeeded)

    def _prefill_failure(self, req: Req, stage: str, reason: str | None) -> RequestFailed:
        self.counters.bootstrap_failures += 1
        req.done_failed = True
        what = "Prefill bootstrap failed" if stage == "bootstrap" else "Prefill transfer failed"
        return RequestFailed(
            f"{what} for request rank=0 req.rid={req.rid!r} req.bootstrap_room={req.room} "
            f"with exception KVTransferError(bootstrap_room={req.room}): {reason or UNKNOWN_PEER_FAILURE}")

    def _decode_failure(self, req: Req, stage: str, reason: str | None) -> RequestFailed:
        self.counters.bootstrap_failures += 1
        req.done_failed = True
        what = "Decode handshake failed" if stage == "handshake" else "Decode transfer failed"
        return RequestFailed(
            f"{what} for request rank=0 decode_req.req.rid={req.rid!r} "
            f"decode_req.req.bootstrap_room={req.room} "
            f"with exception KVTransferError(bootstrap_room={req.room}): {reason or UNKNOWN_PEER_FAILURE}")

    async def _run_decode(self, req: Req, on_progress: Callable[[Req], Awaitable[None]] | None) -> None:
        req.phase = HANDSHAKE
        await self._admit(req)
        if req.done:
            raise self._decode_failure(req, "handshake", "Aborted by AbortReq.")
        req.phase = HANDSHAKE  # admission may have queued it: it is in the prealloc queue again
        if req.parallel_sample:
            # SGLang's n>1 warm-up leg waits for a room no prefill ever fills (seen on 0.5.23)
            req.phase = TRANSFER
            await self._wait_until(req, lambda: False, time.monotonic() + self.config.kv_wait_timeout_s)
            if req.done:
                raise self._decode_failure(req, "transfer", "Aborted by AbortReq.")
            raise self._decode_failure(
                req, "transfer",
                f"Request {req.room} timed out after {self.config.kv_wait_timeout_s:.1f}s in KVPoll.WaitingForInput")
        assert self.kv_client is not None
        result = await self.kv_client.fetch(self, req)
        if result.stage == "ok":
            self.counters.kv_pulls_made += 1
            req.cached_tokens = result.cached_tokens
            if result.prompt_tokens != len(req.input_ids) or result.prompt_hash != self.rooms.prompt_hash(
                    req.input_ids):
                self.counters.kv_mismatches += 1
            req.phase = DECODE
            self.counters.generation_tokens += req.gen.step(1)  # the first token came with the KV
            if req.gen.finished:
                req.finish_reason = req.gen.finish_reason
            self.last_output = time.monotonic()
            if on_progress is not None:
                await on_progress(req)
            await self._decode_loop(req, on_progress)
            return
        if result.stage == "transfer" and req.done and not req.peer_acks:
            self._defer_release()  # nobody will ack the abort: hold the KV until the deadline
        raise self._decode_failure(req, result.stage, result.reason)

    def _defer_release(self) -> None:
        """An aborted transfer: the decode side keeps the KV until the prefill acks (``deferred_release_s``)."""
        if not self.config.deferred_release_s:
            return
        self.deferred_release_until = max(self.deferred_release_until,
                                          time.monotonic() + self.config.deferred_release_s)

    # ------------------------------------------------------------ phases

    async def _admit(self, req: Req) -> None:
        """Wait for a running slot and KV room (input + max_new_tokens), or abort."""
        need = len(req.input_ids) + max(req.gen.max_new_tokens, 0)
        if not self.waiting and self._fits(need):
            self._take(req, need)
            return
        req.phase = WAITING
        self.waiting.append(req)
        try:
            while not req.done:
                if self.waiting[0] is req and self._fits(need):
                    self._take(req, need)
                    return
                req.wake.clear()
                await req.wake.wait()
        finally:
            if req in self.waiting:
                self.waiting.remove(req)
                self._wake_waiting()

    def _fits(self, need: int) -> bool:
        if self.pause_mode is not None:
            return False
        if self.running >= self.config.max_running_requests:
            return False
        return self.used_tokens + need <= self.config.max_total_tokens or self.running == 0

    def _take(self, req: Req, need: int) -> None:
        self.running += 1
        req.kv_tokens = need
        self.used_tokens += need
        if req.phase == WAITING:
            req.phase = FORWARD

    def _release_kv(self, req: Req) -> None:
        if req.kv_tokens:
            self.running -= 1
            self.used_tokens -= req.kv_tokens
            req.kv_tokens = 0
            self._wake_waiting()

    def _wake_waiting(self) -> None:
        if self.waiting:
            self.waiting[0].poke()

    async def _forward(self, req: Req) -> None:
        limit = self.config.prefill_concurrency
        if limit and not await self._prefill_slot(req, limit):
            return  # aborted while waiting for compute
        req.phase = FORWARD
        try:
            self._match_prefix(req)
            delay = self.config.timing.prefill_time(len(req.input_ids) - req.cached_tokens)
            if delay:
                await self._sleep(req, delay)
        finally:
            if limit:
                self.prefill_busy -= 1
                self._wake_prefill_queue()
        if not req.done:
            self._record_prefill(req)

    def _match_prefix(self, req: Req) -> None:
        if self.prefix_cache is not None:
            matched = self.prefix_cache.match(req.input_ids)
            if req.return_logprob and req.logprob_start_len >= 0:
                # input logprobs from that position on need their tokens computed (Req._compute_max_prefix_len)
                matched = min(matched, req.logprob_start_len)
            req.cached_tokens = matched

    def flush_prefix_cache(self) -> None:
        """What a successful /flush_cache (also the one after a weight update) does to the radix cache."""
        if self.prefix_cache is not None:
            self.prefix_cache.clear()

    def _record_prefill(self, req: Req) -> None:
        self.counters.prefill_tokens += len(req.input_ids)
        self.counters.cached_tokens += req.cached_tokens
        if self.prefix_cache is not None:
            self.prefix_cache.insert(req.input_ids)

    def _instant(self, req: Req) -> bool:
        """Zero delays, free capacity, nothing to wait for: run the whole item now, without awaiting."""
        faults = self.faults.faults
        if (not self._timing_zero or self.config.prefill_concurrency or self.pause_mode is not None
                or self.waiting or faults.hang_after_tokens is not None):
            return False
        need = len(req.input_ids) + max(req.gen.max_new_tokens, 0)
        if not self._fits(need):
            return False
        self._take(req, need)
        self._match_prefix(req)
        self._record_prefill(req)
        req.phase = DECODE
        self.counters.generation_tokens += req.gen.step(1 << 30)
        self.last_output = time.monotonic()
        req.finish_reason = req.gen.finish_reason
        return True

    async def _prefill_slot(self, req: Req, limit: int) -> bool:
        """Wait (first come, first served; in the waiting queue) for a prefill compute slot."""
        if not self.prefill_queue and self.prefill_busy < limit:
            self.prefill_busy += 1
            return True
        req.phase = WAITING
        self.prefill_queue.append(req)
        try:
            while not req.done:
                if self.prefill_queue[0] is req and self.prefill_busy < limit:
                    self.prefill_busy += 1
                    return True
                req.wake.clear()
                await req.wake.wait()
            return False
        finally:
            if req in self.prefill_queue:
                self.prefill_queue.remove(req)
                self._wake_prefill_queue()

    def _wake_prefill_queue(self) -> None:
        if self.prefill_queue:
            self.prefill_queue[0].poke()

    async def _decode_loop(self, req: Req, on_progress: Callable[[Req], Awaitable[None]] | None) -> None:
        # Only requests that are decoding make the batch: on a decode server, those still waiting for their
        # KV hold memory (self.running) but take no part in the forward passes.
        self.decoding += 1
        try:
            await self._decode_steps(req, on_progress)
        finally:
            self.decoding -= 1

    async def _decode_steps(self, req: Req, on_progress: Callable[[Req], Awaitable[None]] | None) -> None:
        req.phase = DECODE
        timing = self.config.timing
        zero = self._timing_zero
        while not req.done:
            faults = self.faults.faults  # replaced, not mutated, when changed at run time
            if self.pause_mode is not None:
                await self._hold_while_paused(req)
                if req.done:
                    return
            if faults.hang_after_tokens is not None and len(req.output_ids) >= faults.hang_after_tokens:
                await self._park(req, lambda: self.pause_mode is not None
                                 or self.faults.faults.hang_after_tokens is None
                                 or len(req.output_ids) < self.faults.faults.hang_after_tokens)
                continue
            step = 0.0 if zero else timing.decode_step_time(self.decoding)
            if step:
                await self._sleep(req, step)
                if req.done:
                    return
                if self.pause_mode is not None:
                    continue
            # with no delays and no listener, emit everything at once: nothing can observe the steps
            burst = 1 if (step or on_progress is not None or faults.hang_after_tokens is not None) else 1 << 30
            added = req.gen.step(burst)
            self.counters.generation_tokens += added
            self.last_output = time.monotonic()
            if req.gen.finished:
                req.finish_reason = req.gen.finish_reason
            if on_progress is not None:
                await on_progress(req)

    async def _hold_while_paused(self, req: Req) -> None:
        """Scheduler paused: retract frees the KV and requeues; in_place keeps it."""
        if self.pause_mode == "retract" and req.kv_tokens:
            self._release_kv(req)
            req.num_retractions += 1
            req.phase = RETRACTED
            while self.pause_mode is not None and not req.done:
                await self._wait_resumed(req)
            if not req.done:
                req.phase = WAITING
                await self._admit(req)
                req.phase = DECODE
        else:
            while self.pause_mode is not None and not req.done:
                await self._wait_resumed(req)

    async def _wait_resumed(self, req: Req) -> None:
        req.wake.clear()
        await req.wake.wait()  # resume() and abort() wake every request

    async def _sleep(self, req: Req, delay: float) -> None:
        """Sleep ``delay`` unless the request is woken (abort, pause) first."""
        req.wake.clear()
        try:
            async with asyncio.timeout(delay):
                await req.wake.wait()
        except TimeoutError:
            pass

    async def _wait_until(self, req: Req, ready: Callable[[], bool], deadline: float) -> None:
        """Wait until ``ready()`` (re-checked whenever the request is woken), its abort, or ``deadline``."""
        while not req.done and not ready():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            req.wake.clear()
            try:
                async with asyncio.timeout(remaining):
                    await req.wake.wait()
            except TimeoutError:
                return

    async def _park(self, req: Req, until: Callable[[], bool] | None) -> None:
        """A hung request: no progress until aborted, the client leaves, or ``until()`` holds."""
        while not req.done and not (until is not None and until()):
            req.wake.clear()
            await req.wake.wait()  # woken by abort, disconnect, or a change of faults

    def wake_all(self) -> None:
        for req in list(self.requests.values()):
            req.poke()

    # ------------------------------------------------------------ control

    def abort(self, rid: str = "", abort_all: bool = False) -> int:
        """SGLang 0.5.23 semantics: an exact rid must be live, then every rid with that prefix goes."""
        self.counters.abort_requests += 1
        if abort_all:
            self.counters.abort_all_requests += 1
        elif not rid or rid not in self.requests:
            return 0
        matched = 0
        for req in list(self.requests.values()):
            if req.dispatched and (abort_all or req.rid.startswith(rid)):
                if not req.done:
                    req.abort(self._abort_reason(req))
                    matched += 1
        self.counters.aborts_matched += matched
        return matched

    def _abort_reason(self, req: Req) -> dict:
        if req.phase == WAITING and self.role == "null":
            return {"type": "abort", "message": "Abort in waiting queue"}
        return dict(ABORTED)

    def abort_on_disconnect(self, reqs: list[Req]) -> None:
        self.counters.client_disconnects += 1
        for req in reqs:
            if not req.done:
                req.abort(dict(ABORTED))

    async def pause(self, mode: str) -> None:
        self.is_pause = True
        self._unpaused.clear()
        if mode == "abort":
            while True:
                self.abort(abort_all=True)
                if not self.lock.locked:
                    return
                await self._wait_idle_or(1.0)
        else:
            self.pause_mode = mode
            self._scheduler_resumed.clear()
            for req in list(self.requests.values()):
                req.poke()

    async def _wait_idle_or(self, timeout: float) -> None:
        try:
            async with asyncio.timeout(timeout):
                await self._idle.wait()
        except TimeoutError:
            pass

    def resume(self) -> None:
        self.is_pause = False
        self.pause_mode = None
        self._unpaused.set()
        self._scheduler_resumed.set()
        for req in list(self.requests.values()):
            req.poke()
        self._wake_waiting()

    def is_fully_idle(self, *, ignore_waiting: bool = False) -> bool:
        """SGLang's ``Scheduler.is_fully_idle``: nothing running, queued, or held for a deferred release."""
        if time.monotonic() < self.deferred_release_until:
            return False
        for req in self.requests.values():
            if not req.dispatched:
                continue
            if req.phase == RETRACTED and ignore_waiting:
                continue
            if req.phase == WAITING and ignore_waiting and not req.kv_tokens:
                continue
            return False
        return True

    def set_weight_version(self, version: str | None) -> None:
        """The scheduler records a new version: running items get a new span from here on."""
        if version is None or version == self.weight_version:
            return
        self.weight_version = version
        for req in self.requests.values():
            if not req.dispatched:
                continue  # not in the scheduler yet: it starts with the new version
            at = len(req.output_ids)
            if req.spans and req.spans[-1][1] == at:
                req.spans[-1][0] = version
            else:
                req.spans.append([version, at])

    async def write_locked(self, fn: Callable[[], Awaitable[Any]], *, paused: bool) -> Any:
        """Run ``fn`` holding the weight lock (SGLang waits for in-flight calls unless paused)."""
        if paused:
            return await fn()
        await self.lock.acquire_write()
        try:
            return await fn()
        finally:
            self.lock.release_write()

    # ------------------------------------------------------------ views

    def load(self) -> dict[str, int]:
        running = waiting = 0
        queues = {"prefill_bootstrap_queue_reqs": 0, "prefill_inflight_queue_reqs": 0,
                  "decode_prealloc_queue_reqs": 0, "decode_transfer_queue_reqs": 0,
                  "decode_retracted_queue_reqs": 0}
        used = 0
        for req in self.requests.values():
            if not req.dispatched:
                continue
            phase = req.phase
            if req.kv_tokens:
                used += len(req.input_ids) + len(req.gen.output_ids)
            if phase == DECODE or (phase == FORWARD and req.kv_tokens):
                running += 1
            elif phase in (WAITING, RETRACTED):
                waiting += 1
            elif phase == BOOTSTRAP:
                queues["prefill_bootstrap_queue_reqs"] += 1
            elif phase == TRANSFER and self.role == "prefill":
                queues["prefill_inflight_queue_reqs"] += 1
            elif phase == HANDSHAKE:
                queues["decode_prealloc_queue_reqs"] += 1
            elif phase == TRANSFER:
                queues["decode_transfer_queue_reqs"] += 1
            if phase == RETRACTED:
                queues["decode_retracted_queue_reqs"] += self.role == "decode"
        return {"running": running, "waiting": waiting, "used_tokens": used, **queues}

    def snapshot(self) -> dict[str, Any]:
        """Everything a router test may want to assert on (``GET /_sim/state``)."""
        by_phase: dict[str, list[str]] = {}
        undispatched = []
        for req in self.requests.values():
            if req.dispatched:
                by_phase.setdefault(req.phase, []).append(req.rid)
            else:
                undispatched.append(req.rid)
        return {
            "role": self.role,
            "paused": self.is_pause,
            "pause_mode": self.pause_mode,
            "weight_version": self.weight_version,
            "model_version": self.model_version,
            "unhealthy": self.unhealthy,
            "inflight_calls": self.inflight_calls,
            "running_rids": by_phase.get(DECODE, []) + by_phase.get(FORWARD, []),
            "waiting_rids": by_phase.get(WAITING, []) + by_phase.get(RETRACTED, []),
            "rids_by_phase": by_phase,
            "undispatched_rids": undispatched,  # parked behind a pause or a weight update
            "weight_lock": {"readers": self.lock.readers, "writer": self.lock.writer,
                            "waiting_writers": self.lock.waiting_writers},
            "weight_session_open": self.weight_session_open,
            "released_memory": sorted(self.released_memory),
            "rooms": self.rooms.snapshot(),
            "kv_reserved_tokens": self.used_tokens,  # admission: input + max_new_tokens of each running item
            "deferred_release_s": max(0.0, round(self.deferred_release_until - time.monotonic(), 3)),
            "counters": self.counters.__dict__.copy(),
        }
