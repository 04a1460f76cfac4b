"""Admission: a bound on requests in flight, a bounded wait queue, and the fleet-wide gate.

A request enters when the gate is open and a slot is free; otherwise it waits in a bounded queue with a
deadline. A weight update closes the gate (`close_gate(reason)`, shown as the fleet's `holds` in the admin API): new
requests wait instead of failing, and are let through in arrival order once no reason keeps it closed. Beyond the queue bound, or past the deadline, the client gets
503 with Retry-After.

`--rate-limit-tokens-per-second R` (sgl-router's, SMG's): new requests also take a token from a bucket refilled
at R per second and holding at most `--max-concurrent-requests` (at least R, when that is unbounded): a burst
passes, a sustained rate above R gets 429 with the seconds until the next token in Retry-After (the peers queue
such requests; here the queue is for capacity and the gate, a rate answer is at once).

At shutdown, `close` stops admitting (new requests get 503 at once; those admitted go on, retries included),
and once the grace period is over `turn_away` answers 503 to every request still queued and to every retry.
"""

from __future__ import annotations

import asyncio
import collections
import time

from aiohttp import web

from router.core.config import AdmissionConfig
from router.core.errors import ServiceUnavailable, TooManyRequests


class Admission:
    def __init__(self, config: AdmissionConfig, clock=time.monotonic) -> None:
        self._limit = config.max_concurrent_requests if config.max_concurrent_requests > 0 else None
        self._queue_size = config.queue_size
        self._timeout = config.queue_timeout_secs
        self._clock = clock
        rate = config.rate_limit_tokens_per_second
        self._rate = float(rate) if rate else None
        self._capacity = float(max(self._limit or 0, rate or 0, 1))
        self._tokens = self._capacity
        self._refilled_at = clock()
        self.active = 0
        self._waiters: collections.deque[asyncio.Future] = collections.deque()
        self._gate_reasons: set[str] = set()
        self._open = asyncio.Event()
        self._open.set()
        self._closed: str | None = None  # why new requests are refused (shutdown)
        self._turned_away: str | None = None  # why queued requests and retries are refused too
        # Figures for the admin API and the weight-update report.
        self.held_total = 0
        self.rejected_total = 0
        self.last_gate_wait_max = 0.0

    # ---- the fleet-wide gate -------------------------------------------------------------------------
    @property
    def is_open(self) -> bool:
        return not self._gate_reasons

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    @property
    def gate_reasons(self) -> str:
        """What keeps the gate closed (a weight update, a pause, released memory), for messages."""
        return ", ".join(sorted(self._gate_reasons)) or "nothing"

    def close_gate(self, reason: str) -> None:
        self._gate_reasons.add(reason)
        self._open.clear()

    def open_gate(self, reason: str) -> None:
        self._gate_reasons.discard(reason)
        if not self._gate_reasons:
            self._open.set()
            self._wake()

    async def wait_open(self, deadline: float) -> None:
        """For retries of requests already admitted: wait for the gate to open, with the request's deadline."""
        if self.is_open:
            return
        self._check_turned_away()
        remaining = deadline - self._clock()
        try:
            await asyncio.wait_for(self._open.wait(), max(remaining, 0))
        except asyncio.TimeoutError:
            raise ServiceUnavailable(f"the fleet is held ({self.gate_reasons}) past the request deadline",
                                     headers={"Retry-After": "5"}) from None
        self._check_turned_away()

    # ---- shutdown --------------------------------------------------------------------------------
    def close(self, reason: str) -> None:
        """Admit nothing new: 503 at once (a balancer or client sends it elsewhere). Requests already admitted
        or queued go on."""
        self._closed = reason

    def turn_away(self, reason: str) -> None:
        """The end of the grace period: every queued request and every retry gets 503 (none reached a server)."""
        self.close(reason)
        self._turned_away = reason
        self.close_gate(reason)  # for good: wait_open leaves its fast path and refuses
        self._open.set()  # wake the retries waiting for the gate to open: they refuse too
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                self.rejected_total += 1
                waiter.set_exception(ServiceUnavailable(reason, headers={"Retry-After": "1"}))

    def _check_turned_away(self) -> None:
        if self._turned_away is not None:
            raise ServiceUnavailable(self._turned_away, headers={"Retry-After": "1"})

    # ---- slots -----------------------------------------------------------------------------------
    def _can_enter(self) -> bool:
        return self.is_open and (self._limit is None or self.active < self._limit)

    def _wake(self) -> None:
        while self._waiters and self._can_enter():
            waiter = self._waiters.popleft()
            if not waiter.done():
                self.active += 1  # the slot is handed over to the waiter
                waiter.set_result(None)

    def _take_token(self) -> None:
        now = self._clock()
        self._tokens = min(self._capacity, self._tokens + (now - self._refilled_at) * self._rate)
        self._refilled_at = now
        if self._tokens < 1.0:
            self.rejected_total += 1
            wait = (1.0 - self._tokens) / self._rate
            raise TooManyRequests(f"over the rate limit ({self._rate:g} requests/s, --rate-limit-tokens-per-second)",
                                  headers={"Retry-After": str(max(1, int(wait + 0.999)))})
        self._tokens -= 1.0

    async def _enter(self) -> None:
        if self._closed is not None:
            self.rejected_total += 1
            raise ServiceUnavailable(self._closed, headers={"Retry-After": "1"})
        if self._rate is not None:
            self._take_token()
        if not self._waiters and self._can_enter():
            self.active += 1
            return
        if len(self._waiters) >= self._queue_size:
            self.rejected_total += 1
            if self.is_open:
                raise TooManyRequests("too many requests in flight and the wait queue is full",
                                      headers={"Retry-After": "1"})
            raise ServiceUnavailable(f"the fleet is held ({self.gate_reasons}) and the wait queue is full",
                                     headers={"Retry-After": "5"})
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        self.held_total += 1
        started = self._clock()
        try:
            await asyncio.wait_for(asyncio.shield(waiter), self._timeout)
        except asyncio.TimeoutError:
            self.rejected_total += 1
            if waiter.done() and not waiter.cancelled():
                self.active -= 1  # handed over just as we gave up
            waiter.cancel()
            raise ServiceUnavailable(f"no capacity within the queue timeout ({self._timeout:g} s)",
                                     headers={"Retry-After": "5"}) from None
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.active -= 1
                self._wake()
            waiter.cancel()
            raise
        finally:
            try:
                self._waiters.remove(waiter)
            except ValueError:
                pass
            self.last_gate_wait_max = max(self.last_gate_wait_max, self._clock() - started)

    def _leave(self) -> None:
        self.active -= 1
        if self._waiters:
            self._wake()

    def slot(self) -> "_Slot":
        """`async with admission.slot():` holds one slot (a plain class: cheaper than a generator-based
        context manager on the request path)."""
        return _Slot(self)

    def state(self) -> dict:
        return {
            "open": self.is_open,
            "closed": self._closed,
            "holds": sorted(self._gate_reasons),
            "active": self.active,
            "waiting": self.waiting,
            "max_concurrent_requests": self._limit or 0,
            "queue_size": self._queue_size,
            "held_total": self.held_total,
            "rejected_total": self.rejected_total,
        }


class _Slot:
    __slots__ = ("_admission",)

    def __init__(self, admission: Admission) -> None:
        self._admission = admission

    async def __aenter__(self) -> None:
        await self._admission._enter()

    async def __aexit__(self, *exc) -> None:
        self._admission._leave()


ADMISSION = web.AppKey("admission", Admission)
