"""SMG's PD admission, in front of the pair selection (lightseekorg/smg `worker/prefill_admission.rs`'s rules).

- Prefill (`--prefill-max-inflight-requests-per-worker N`, `--prefill-queue-size`, `--prefill-queue-timeout-secs`):
  a prefill takes at most N of this router's requests at once (its legs in flight, a lingering one included:
  the prefill phase lasts until its own answer ends). When every routable prefill has N, the request waits in
  one strict FIFO queue, holding no worker; only the queue's head looks for room, when a prefill leg ends, when
  routability changes, and every second. A full queue is 429 at once, a wait past the timeout 429 too (SMG's
  `pd_prefill_queue_full`, `pd_prefill_queue_timeout`), neither retried. No routable prefill at all: the
  selection's own 503.
- Decode (`--pd-admission-wait-secs S`): a decode takes at most its running window (`max_running_requests`
  in its `/v1/loads` report) of this router's requests; when every routable decode that reports one is full,
  the request waits up to S seconds for room, then 503 (SMG's `worker_overload_protection_shed`). A decode
  without a report is never gated.

The request is admitted to a pool and its pair chosen in the same step of the event loop (the legs take their
workers before the first await), so the counts the gates read are the ones the choice changes. A waiter that
goes (its client left, its deadline passed) leaves the queue; the next head is woken.
"""

from __future__ import annotations

import asyncio

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from router.core.config import PdAdmissionConfig
from router.core.errors import ServiceUnavailable, TooManyRequests
from router.core.registry import Registry, Role, Worker
from router.dataplane.turns import Turns
DECODE_RECHECK_S = 0.5  # a decode's window comes from the load monitor's polls: looked at again this often


class PrefillQueue:
    """At most `limit` requests per prefill; the rest wait in one bounded FIFO queue."""

    def __init__(self, limit: int, queue_size: int, timeout: float, registry: Registry) -> None:
        self.limit, self.queue_size, self.timeout = limit, queue_size, timeout
        self.registry = registry
        self._turns = Turns()
        self.admitted_after_wait_total = 0
        self.full_total = 0
        self.timeouts_total = 0

    @property
    def waiting(self) -> int:
        return len(self._turns)

    def with_room(self, prefills: tuple[Worker, ...]) -> tuple[Worker, ...]:
        limit = self.limit
        return tuple(w for w in prefills if w.inflight < limit)

    def _ready(self) -> bool:
        """Room on a routable prefill, or none routable at all (the selection answers that)."""
        prefills = self.registry.routable(Role.PREFILL)
        return not prefills or any(w.inflight < self.limit for w in prefills)

    async def enter(self) -> None:
        """Return when a prefill has room for this request (or none is routable); 429 when the queue is full
        or the wait passes the timeout."""
        if not self._turns and self._ready():
            return
        if len(self._turns) >= self.queue_size:
            self.full_total += 1
            raise TooManyRequests(f"the prefill admission queue is full ({self.queue_size} waiting for a prefill "
                                  f"below --prefill-max-inflight-requests-per-worker {self.limit})",
                                  headers={"Retry-After": "1"}, type="pd_prefill_queue_full")
        try:
            async with asyncio.timeout(self.timeout):
                await self._turns.wait(self._ready)
        except TimeoutError:
            self.timeouts_total += 1
            raise TooManyRequests(f"timed out waiting for prefill admission ({self.timeout:g} s, "
                                  f"--prefill-queue-timeout-secs)", headers={"Retry-After": "1"},
                                  type="pd_prefill_queue_timeout") from None
        self.admitted_after_wait_total += 1

    def room_freed(self) -> None:
        self._turns.wake_head()

    def state(self) -> dict:
        return {"max_inflight_requests_per_worker": self.limit, "queue_size": self.queue_size,
                "queue_timeout_secs": self.timeout, "waiting": self.waiting,
                "admitted_after_wait_total": self.admitted_after_wait_total, "full_total": self.full_total,
                "timeouts_total": self.timeouts_total}


def running_window(worker: Worker) -> int | None:
    load = worker.server_load
    report = load.report if load is not None else None
    return report.running_window if report is not None else None


class DecodeGate:
    """A decode takes at most its running window of this router's requests; a request waits `wait_s` for room."""

    def __init__(self, wait_s: float, registry: Registry) -> None:
        self.wait_s, self.registry = wait_s, registry
        self._freed = asyncio.Event()
        self.shed_total = 0

    @staticmethod
    def with_room(decodes: tuple[Worker, ...]) -> tuple[Worker, ...]:
        return tuple(w for w in decodes if (window := running_window(w)) is None or w.inflight < window)

    def _ready(self) -> bool:
        decodes = self.registry.routable(Role.DECODE)
        return not decodes or bool(self.with_room(decodes))

    async def enter(self) -> None:
        if self._ready():
            return
        try:
            async with asyncio.timeout(self.wait_s):
                while not self._ready():
                    try:
                        async with asyncio.timeout(DECODE_RECHECK_S):
                            await self._freed.wait()
                    except TimeoutError:
                        pass
        except TimeoutError:
            self.shed_total += 1
            raise ServiceUnavailable(f"every decode is at its running window (max_running_requests) after "
                                     f"{self.wait_s:g} s (--pd-admission-wait-secs)", headers={"Retry-After": "1"},
                                     type="worker_overload_protection_shed") from None

    def room_freed(self) -> None:
        freed, self._freed = self._freed, asyncio.Event()  # every waiter looks again
        freed.set()


class PdAdmission:
    """Both gates, as the request path uses them (either may be off)."""

    def __init__(self, config: PdAdmissionConfig, registry: Registry) -> None:
        self.prefill = PrefillQueue(config.prefill_max_inflight_requests_per_worker,
                                    100 if config.prefill_queue_size is None else config.prefill_queue_size,
                                    60.0 if config.prefill_queue_timeout_secs is None
                                    else config.prefill_queue_timeout_secs,
                                    registry) if config.prefill_bounded else None
        self.decode = DecodeGate(config.pd_admission_wait_secs, registry) \
            if config.pd_admission_wait_secs is not None else None
        registry.subscribe(self._on_registry_event)

    @property
    def enabled(self) -> bool:
        return self.prefill is not None or self.decode is not None

    async def enter(self) -> None:
        if self.decode is not None:
            await self.decode.enter()
        if self.prefill is not None:
            await self.prefill.enter()

    def leg_ended(self, role: Role) -> None:
        gate = self.prefill if role is Role.PREFILL else self.decode
        if gate is not None:
            gate.room_freed()

    def _on_registry_event(self, event: str, worker, details: dict) -> None:
        if event in ("routable", "added", "removed", "moved"):
            for gate in (self.prefill, self.decode):
                if gate is not None:
                    gate.room_freed()

    def state(self) -> dict:
        return {"prefill": self.prefill.state() if self.prefill is not None else None,
                "decode": {"wait_secs": self.decode.wait_s, "shed_total": self.decode.shed_total}
                if self.decode is not None else None}


class PdAdmissionCollector:
    """Scrape-time metrics of the gates (registered by the composition root when one is on)."""

    def __init__(self, admission: PdAdmission) -> None:
        self.admission = admission

    def describe(self):
        return []

    def collect(self):
        prefill, decode = self.admission.prefill, self.admission.decode
        if prefill is not None:
            yield GaugeMetricFamily("pd_router_prefill_admission_waiting",
                                    "requests waiting for a prefill below --prefill-max-inflight-requests-per-worker",
                                    value=prefill.waiting)
        rejected = CounterMetricFamily("pd_router_pd_admission_rejected",
                                       "requests the PD admission gates turned away", labels=["reason"])
        if prefill is not None:
            rejected.add_metric(["pd_prefill_queue_full"], prefill.full_total)
            rejected.add_metric(["pd_prefill_queue_timeout"], prefill.timeouts_total)
        if decode is not None:
            rejected.add_metric(["worker_overload_protection_shed"], decode.shed_total)
        yield rejected
