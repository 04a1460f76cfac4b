"""The simulated scheduler: request states, admission caps, PD legs, abort, pause and the weight lock.

One ``Engine`` per worker. It mirrors what SGLang's TokenizerManager + Scheduler do with a
request, with the same phases (the abort message a client gets depends on the phase):

    prefill: bootstrap (wait for the decode leg) -> waiting -> forward -> transfer (decode pulls the KV)
    decode:  handshake (reach the prefill's bootstrap listener) -> transfer (wait for its KV) -> queued -> decode
    null:    waiting (admission) -> forward -> decode

The compute that sets the pace (one prefill forward at a time, a continuously batched decode) is
``capacity.py``'s; what the load report counts in each queue is ``loads.py``'s. Every wait has a deadline and
wakes on abort, so nothing here can hang without an outcome.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import TYPE_CHECKING, Awaitable, Callable

from .capacity import DecodeBatch, PrefillForwards
from .dp_ranks import RankChooser, prefill_conflict, room_key
from .engine_control import EngineControl
from .config import WorkerConfig
from .faults import FaultInjector
from .prefix_cache import PrefixCache
from .requests import (
    ABORTED, BOOTSTRAP, DECODE, DONE, FORWARD, HANDSHAKE, RETRACTED, TRANSFER, WAITING,
    Counters, Req, RequestFailed, RWLock, leg_failure,
)

if TYPE_CHECKING:
    from .bootstrap import KvClient, RoomStore

__all__ = ["ABORTED", "Counters", "Engine", "Req", "RequestFailed"]


class Engine(EngineControl):
    """Request state for one worker; the HTTP layer (worker.py) calls into it."""

    def __init__(self, config: WorkerConfig, faults: FaultInjector, rooms: "RoomStore",
                 kv_client: "KvClient | None" = None) -> None:
        self.config = config
        self._timing_zero = config.timing.zero
        self._steps_take_time = bool(config.timing.decode_step_s or config.timing.decode_step_per_running_s)
        self.role = config.role
        self.faults = faults
        self.rooms = rooms
        self.kv_client = kv_client
        self.requests: dict[str, Req] = {}  # live items by rid (SGLang's rid_to_state)
        self.waiting: deque[Req] = deque()
        # One prefill forward loop and one decode batch per data-parallel rank (each rank is a scheduler).
        self.forwards = [PrefillForwards(self, rank) for rank in range(config.dp_size)]
        self.batches = [DecodeBatch(self, rank) for rank in range(config.dp_size)]
        self.published_rows: list[dict | None] = [None] * config.dp_size  # /v1/loads rows (loads.py)
        # Publishes rank N's row now (after a forward, every N decode steps): loads.publish, set by the server.
        self.publish_row: Callable[[int], None] = lambda rank: None
        self.rank_chooser = RankChooser(config.dp_size)
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
        # 0.5.23's TokenizerManager.last_receive_tstamp: the last answer from the scheduler (an output, or an
        # internal-state reply: /server_info), which its /health probe takes for progress, paused or not
        self.last_receive = 0.0
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
        req.dp_rank = self.rank_chooser.choose(self.role, req.room, req.routed_dp_rank)
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
        conflict = prefill_conflict(req.dp_rank, req.room, self.config.dp_size, req.disagg_prefill_dp_rank)
        if conflict is not None:  # the KV sender refuses it at once (CommonKVSender, 0.5.23)
            raise self._prefill_failure(req, "bootstrap", conflict)
        room = self.rooms.open_prefill(room_key(req.dp_rank, req.room), req.rid, req.input_ids, waiter=req)
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
                await self.sleep(req, self.config.timing.kv_transfer_s)
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
        return leg_failure(req, "prefill", stage, reason)

    def _decode_failure(self, req: Req, stage: str, reason: str | None) -> RequestFailed:
        self.counters.bootstrap_failures += 1
        return leg_failure(req, "decode", stage, reason)

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
            self.last_receive = time.monotonic()
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

    def _kv_need(self, req: Req) -> int:
        """KV room a request takes at admission: its prompt and answer; on a decode server, as 0.5.23's
        prealloc, its prompt and `num_reserved_decode_tokens` (512) whatever its answer's length."""
        if self.role == "decode" and self.config.num_reserved_decode_tokens:
            return len(req.input_ids) + self.config.num_reserved_decode_tokens
        return len(req.input_ids) + max(req.gen.max_new_tokens, 0)

    async def _admit(self, req: Req) -> None:
        """Wait for a running slot and KV room (`_kv_need`), or abort."""
        need = self._kv_need(req)
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
        ranks = self.config.dp_size
        # a decode server's request slots hold transfers beyond the running batch (SGLang's extra slots)
        slots = self.config.max_running_requests * ranks * (2 if self.role == "decode" else 1)
        if self.running >= slots:
            return False
        return self.used_tokens + need <= self.config.max_total_tokens * ranks or self.running == 0

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
        if await self.forwards[req.dp_rank].run(req) and not req.done:
            self._record_prefill(req)

    def match_prefix(self, req: Req) -> None:
        if self.prefix_cache is not None:
            matched = self.prefix_cache.match(req.input_ids)
            if req.return_logprob and req.logprob_start_len >= 0:
                # input logprobs from that position on need their tokens computed (Req._compute_max_prefix_len)
                matched = min(matched, req.logprob_start_len)
            req.cached_tokens = matched

    def flush_prefix_cache(self) -> None:
        """What a successful /flush_cache (also the one after a weight update) does to the radix cache."""
        self.counters.cache_flushes += 1
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
        need = self._kv_need(req)
        if not self._fits(need):
            return False
        self._take(req, need)
        self.match_prefix(req)
        self._record_prefill(req)
        req.phase = DECODE
        self.counters.generation_tokens += req.gen.step(1 << 30)
        self.last_receive = time.monotonic()
        req.finish_reason = req.gen.finish_reason
        return True

    async def _decode_loop(self, req: Req, on_progress: Callable[[Req], Awaitable[None]] | None) -> None:
        # Only requests that are decoding make the batch: on a decode server, those still waiting for their
        # KV hold memory (self.running) but take no part in the forward passes.
        if not self._steps_take_time:
            self.decoding += 1
            try:
                await self._decode_steps(req, on_progress)
            finally:
                self.decoding -= 1
            return
        batch = self.batches[req.dp_rank]
        if not await batch.join(req):
            return
        self.decoding += 1
        try:
            await self._batched_steps(req, batch, on_progress)
        finally:
            self.decoding -= 1
            batch.leave(req)

    async def _batched_steps(self, req: Req, batch: DecodeBatch,
                             on_progress: Callable[[Req], Awaitable[None]] | None) -> None:
        """Emit the tokens the batch's steps give this request (capacity.DecodeBatch), until it finishes."""
        req.phase = DECODE
        while not req.done:
            if self.pause_mode is not None:
                if self.pause_mode == "retract" and req.kv_tokens:
                    batch.leave(req)
                    await self._hold_while_paused(req)
                    if req.done or not await batch.join(req):
                        return
                    req.phase = DECODE
                else:
                    await self._hold_while_paused(req)
                continue
            if not req.step_tokens:
                req.wake.clear()
                await req.wake.wait()
                continue
            tokens, req.step_tokens = req.step_tokens, 0
            self.counters.generation_tokens += req.gen.step(tokens)
            self.last_receive = time.monotonic()
            if req.gen.finished:
                req.finish_reason = req.gen.finish_reason
            if on_progress is not None:
                await on_progress(req)

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
                await self.sleep(req, step)
                if req.done:
                    return
                if self.pause_mode is not None:
                    continue
            # with no delays and no listener, emit everything at once: nothing can observe the steps
            burst = 1 if (step or on_progress is not None or faults.hang_after_tokens is not None) else 1 << 30
            added = req.gen.step(burst)
            self.counters.generation_tokens += added
            self.batches[req.dp_rank].account(1, step * 1e6, added)  # each emit counts as a step of one
            self.last_receive = time.monotonic()
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

    async def sleep(self, req: Req, delay: float) -> None:
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
        for batch in self.batches:
            batch.wake()

    async def close(self) -> None:
        for batch in self.batches:
            await batch.close()
