"""The simulated server's compute: what bounds its throughput, and the counters SGLang 0.5.23 reports about it.

Prefill (`PrefillForwards`): SGLang runs one forward at a time (`--prefill-concurrency 1`), and a forward takes
the waiting requests first come, first served, up to `--max-prefill-tokens` tokens of prompt (the first one
always fits). It lasts `prefill_overhead_s + prefill_per_token_s x` the batch's uncached prompt tokens, so a
prefill server's throughput is bounded and its waiting queue grows when requests arrive faster. With
`--prefill-concurrency 0` (the default) every request runs its own forward at once: no queue, no batching.
Each forward adds its duration to `total_prefill_busy_us` and its tokens to `total_prefill_uncached_tokens`.

Decode (`DecodeBatch`): continuous batching. One loop per server runs steps while any request is in the
batch; a step lasts `decode_step_s + decode_step_per_running_s x` the batch size and gives every request of
the batch one token. Requests join and leave between steps; at most `max_running_requests` are in the batch,
the others wait in the decode waiting queue. Each step is accumulated into `decode_moments` as SGLang does
(steps, sum of batch sizes, sum of step times in us, sum of squared batch sizes, sum of batch x time, tokens).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import TYPE_CHECKING, Protocol

from .requests import FORWARD, QUEUED, WAITING, Req

if TYPE_CHECKING:
    from .config import WorkerConfig
    from .faults import FaultInjector


class Engine(Protocol):
    """What the forwards and batches use of their engine (`engine.Engine`, which builds them)."""

    config: WorkerConfig
    faults: FaultInjector
    pause_mode: str | None
    last_gen_throughput: float
    publish_row: Callable[[int], None]  # publish rank N's /v1/loads row now (loads.publish)

    def match_prefix(self, req: Req) -> None: ...

    async def sleep(self, req: Req, delay: float) -> None: ...

GEN_THROUGHPUT_STEPS = 40  # SGLang logs (and reports) decode throughput every 40 steps


class PrefillForwards:
    def __init__(self, engine: "Engine", rank: int = 0) -> None:
        self.engine = engine
        self.rank = rank
        self.queue: deque[Req] = deque()  # waiting for a forward (SGLang's waiting queue), in order
        self.running = 0  # forwards in progress
        self.busy_us = 0
        self.uncached_tokens = 0
        self.forwards = 0

    @property
    def limit(self) -> int:
        return self.engine.config.prefill_concurrency

    async def run(self, req: Req) -> bool:
        """Wait for `req`'s forward and sit through it; False when it was aborted before its forward began."""
        if not self.limit:  # no bound: a forward of its own, now
            req.phase = FORWARD
            await self._compute(req, [req])
            return True
        req.phase = WAITING
        self.queue.append(req)
        try:
            while not req.done:
                if req.phase == FORWARD:  # a leader took it into its batch: wait for that forward to end
                    while not req.forward_done and not req.done:
                        req.wake.clear()
                        await req.wake.wait()
                    return True
                if self.queue and self.queue[0] is req and self.running < self.limit:
                    await self._lead(req)
                    return True
                req.wake.clear()
                await req.wake.wait()
            return req.phase == FORWARD
        finally:
            if req in self.queue:
                self.queue.remove(req)
                self._wake_next()

    async def _lead(self, req: Req) -> None:
        """Take `req` and those behind it up to the token budget into one forward, and run it."""
        budget = self.engine.config.max_prefill_tokens
        self.engine.publish_row(self.rank)  # the row a forward leaves shown: its batch still waiting
        batch: list[Req] = []
        tokens = 0
        while self.queue:
            head = self.queue[0]
            if head.done:
                self.queue.popleft()
                continue
            size = len(head.input_ids)
            if batch and tokens + size > budget:
                break
            self.queue.popleft()
            head.phase = FORWARD
            head.forward_done = False
            batch.append(head)
            tokens += size
        self.running += 1
        try:
            await self._compute(req, batch)
        finally:
            self.running -= 1
            for member in batch:
                member.forward_done = True
                member.poke()
            self._wake_next()

    async def _compute(self, req: Req, batch: list[Req]) -> None:
        engine = self.engine
        for member in batch:
            engine.match_prefix(member)
        uncached = sum(len(m.input_ids) - m.cached_tokens for m in batch)
        delay = engine.config.timing.prefill_time(uncached)
        started = time.monotonic()
        try:
            if delay:
                if self.limit:
                    await asyncio.sleep(delay)  # a forward runs to its end whoever leaves meanwhile
                else:
                    await engine.sleep(req, delay)
        finally:
            self.busy_us += int((time.monotonic() - started) * 1e6)
            self.uncached_tokens += uncached
            self.forwards += 1
            if self.limit:  # the batch is in the inflight queue now: 0.5.23 publishes its row after a forward
                for member in batch:
                    member.forward_done = True
                engine.publish_row(self.rank)

    def _wake_next(self) -> None:
        if self.queue:
            self.queue[0].poke()


class DecodeBatch:
    def __init__(self, engine: "Engine", rank: int = 0) -> None:
        self.engine = engine
        self.rank = rank
        self.members: dict[Req, None] = {}  # the running batch, in join order
        self.queued: deque[Req] = deque()  # KV in hand, waiting for a place in the batch
        self.moments = [0.0] * 6
        self._task: asyncio.Task | None = None
        self._changed = asyncio.Event()
        self._throughput_mark = (time.monotonic(), 0.0)

    @property
    def size(self) -> int:
        return len(self.members)

    async def join(self, req: Req) -> bool:
        """Wait for a place in the batch (the decode waiting queue); False when aborted meanwhile."""
        cap = self.engine.config.max_running_requests
        if self.queued or len(self.members) >= cap:
            req.phase = QUEUED
            self.queued.append(req)
            try:
                while not req.done and not (self.queued[0] is req and len(self.members) < cap):
                    req.wake.clear()
                    await req.wake.wait()
            finally:
                self.queued.remove(req)
                if self.queued:
                    self.queued[0].poke()
            if req.done:
                return False
        req.step_tokens = 0
        if not self.members:  # the row a batch starting now leaves shown until its 15th step
            self.engine.publish_row(self.rank)
        self.members[req] = None
        self.wake()
        if self._task is None:
            self._task = asyncio.ensure_future(self._loop())
        return True

    def leave(self, req: Req) -> None:
        self.members.pop(req, None)
        if self.queued:
            self.queued[0].poke()

    def wake(self) -> None:
        self._changed.set()

    def _steps(self, req: Req) -> bool:
        if req.done or self.engine.pause_mode is not None:
            return False
        hang = self.engine.faults.faults.hang_after_tokens
        return hang is None or len(req.output_ids) + req.step_tokens < hang

    async def _loop(self) -> None:
        timing = self.engine.config.timing
        try:
            while self.members:
                batch = [r for r in self.members if self._steps(r)]
                if not batch:
                    self._changed.clear()
                    await self._changed.wait()
                    continue
                step = timing.decode_step_time(len(batch))
                started = time.monotonic()
                await asyncio.sleep(step)
                step_us = (time.monotonic() - started) * 1e6
                for req in batch:
                    if req in self.members and not req.done:
                        req.step_tokens += 1
                        req.poke()
                self.account(len(batch), step_us, len(batch))
        finally:
            self._task = None

    def account(self, size: int, step_us: float, generated: int) -> None:
        """One decode step of `size` requests that took `step_us` and made `generated` tokens."""
        m = self.moments
        m[0] += 1.0
        m[1] += size
        m[2] += step_us
        m[3] += size * size
        m[4] += size * step_us
        m[5] += generated
        if int(m[0]) % self.engine.config.load_snapshot_publish_interval == 0:
            self.engine.publish_row(self.rank)
        if int(m[0]) % GEN_THROUGHPUT_STEPS == 0:
            then, tokens = self._throughput_mark
            now = time.monotonic()
            if now > then:
                self.engine.last_gen_throughput = round((m[5] - tokens) / (now - then), 2)
            self._throughput_mark = (now, m[5])

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
