"""The worker registry: the single source of truth for who serves which role.

Every change of worker state goes through a method of `Registry`, which keeps the routable snapshot of each
pool up to date (the request path only reads a cached tuple), wakes waiters, and tells listeners (metrics,
logs, policies). Decisions about *when* to change state live in the flows and the health checker; the
registry only applies them. A later multi-replica backend can replace this class behind the same methods.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from policies import ServerLoad

logger = logging.getLogger(__name__)


class Role(str, enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"

    @property
    def opposite(self) -> "Role":
        return Role.DECODE if self is Role.PREFILL else Role.PREFILL

    def __str__(self) -> str:
        return self.value


class WorkerState(str, enum.Enum):
    PENDING = "pending"  # registered, not yet confirmed reachable (bootstrap port still unknown)
    ACTIVE = "active"  # routable when healthy
    DRAINING = "draining"  # no new requests; in-flight ones finish
    ABORTING = "aborting"  # in-flight requests being aborted
    CONVERTING = "converting"  # the server is switching role
    VERIFYING = "verifying"  # checking the live role after a switch
    # No "paused": a fleet-wide hold (weight update, pause_generation) is the router's, in admission, and
    # leaves each worker routable, so /health stays ready and requests wait in the queue instead of failing.
    FAILED = "failed"  # left unsafe by a failed operation: never routed to until an operator acts

    def __str__(self) -> str:
        return self.value


class UnknownWorker(LookupError):
    pass


class DuplicateWorker(ValueError):
    pass


def bootstrap_host_of(url: str) -> str:
    """The hostname decode servers use to reach a prefill's bootstrap server (IPv6 in brackets)."""
    host = urlsplit(url).hostname or ""
    return f"[{host}]" if ":" in host else host


def normalize_url(url: str) -> str:
    return url.rstrip("/")


@dataclass(eq=False, slots=True)
class Worker:
    id: str
    url: str
    role: Role
    bootstrap_port: int | None
    bootstrap_host: str
    state: WorkerState = WorkerState.ACTIVE
    healthy: bool = True
    # Set by the health monitor: why the worker is (un)healthy, and its circuit breaker's phase.
    health_reason: str = ""
    breaker: str = "closed"
    # Router-side count of requests holding this worker (selection → last byte or client gone).
    inflight: int = 0
    # Bumped on every change of role, port or state, so that stale asynchronous results can be discarded.
    revision: int = 0
    weight_version: str | None = None
    # Which role-switch API the server speaks ("pd_role_switch", "convert_pd_role"), learnt from it.
    switch_api: str | None = None
    server_version: str | None = None
    state_reason: str = ""
    state_since: float = field(default_factory=time.monotonic)
    added_at: float = field(default_factory=time.time)
    # Bumped whenever the router aborts everything on this worker (conversion, weight update), so the
    # request path can tell a router-made abort (retry elsewhere) from a client's own abort.
    abort_epoch: int = 0
    requests_total: int = 0
    failures_total: int = 0
    # The server's own last load report (router/load_monitor.py writes it; policies read it). None: unknown.
    server_load: ServerLoad | None = None
    _idle: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    @property
    def routable(self) -> bool:
        return self.state is WorkerState.ACTIVE and self.healthy

    def to_dict(self) -> dict:
        return {
            "id": self.id,
            "url": self.url,
            "role": self.role.value,
            "worker_type": self.role.value,
            "bootstrap_port": self.bootstrap_port,
            "state": self.state.value,
            "state_reason": self.state_reason,
            "is_healthy": self.healthy,
            "health_reason": self.health_reason,
            "breaker": self.breaker,
            "routable": self.routable,
            "inflight": self.inflight,
            "load": self.inflight,
            "revision": self.revision,
            "weight_version": self.weight_version,
            "switch_api": self.switch_api,
            "requests_total": self.requests_total,
            "failures_total": self.failures_total,
        }


Listener = Callable[[str, Worker, dict], None]


class Registry:
    """Workers of both pools, with a cached routable snapshot per role for the request path."""

    def __init__(self) -> None:
        self._workers: dict[str, Worker] = {}
        self._by_url: dict[str, Worker] = {}
        self._routable: dict[Role, tuple[Worker, ...]] = {Role.PREFILL: (), Role.DECODE: ()}
        self._ids = itertools.count(1)
        self._listeners: list[Listener] = []
        self._changed = asyncio.Event()

    # ---- reads -------------------------------------------------------------------------------------
    def routable(self, role: Role) -> tuple[Worker, ...]:
        return self._routable[role]

    def workers(self, role: Role | None = None) -> list[Worker]:
        if role is None:
            return list(self._workers.values())
        return [w for w in self._workers.values() if w.role is role]

    def get(self, key: str) -> Worker:
        """By id, or by URL (with or without a trailing slash)."""
        worker = self._workers.get(key) or self._by_url.get(normalize_url(key))
        if worker is None:
            raise UnknownWorker(key)
        return worker

    def find(self, key: str) -> Worker | None:
        try:
            return self.get(key)
        except UnknownWorker:
            return None

    def __len__(self) -> int:
        return len(self._workers)

    # ---- listeners ---------------------------------------------------------------------------------
    def subscribe(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def _emit(self, event: str, worker: Worker, **details) -> None:
        for listener in self._listeners:
            try:
                listener(event, worker, details)
            except Exception:  # a broken listener must not break the registry
                logger.exception("registry listener failed on %s", event)

    # ---- mutations ---------------------------------------------------------------------------------
    def add(
        self,
        url: str,
        role: Role,
        bootstrap_port: int | None,
        *,
        state: WorkerState = WorkerState.ACTIVE,
        healthy: bool = True,
        reason: str = "registered",
    ) -> Worker:
        url = normalize_url(url)
        if url in self._by_url:
            raise DuplicateWorker(f"worker {url} is already registered")
        worker = Worker(
            id=f"w{next(self._ids)}",
            url=url,
            role=role,
            bootstrap_port=bootstrap_port,
            bootstrap_host=bootstrap_host_of(url),
            state=state,
            healthy=healthy,
            state_reason=reason,
        )
        worker._idle.set()
        self._workers[worker.id] = worker
        self._by_url[url] = worker
        self._refresh(worker.role)
        logger.info("worker %s %s added as %s (bootstrap port %s, %s)", worker.id, url, role, bootstrap_port, state)
        self._emit("added", worker)
        return worker

    def remove(self, worker: Worker) -> None:
        if self._workers.pop(worker.id, None) is None:
            raise UnknownWorker(worker.id)
        self._by_url.pop(worker.url, None)
        worker.revision += 1
        self._refresh(worker.role)
        logger.info("worker %s %s removed", worker.id, worker.url)
        self._emit("removed", worker)

    def set_state(self, worker: Worker, state: WorkerState, reason: str = "") -> None:
        if worker.state is state and worker.state_reason == reason:
            return
        old = worker.state
        worker.state = state
        worker.state_reason = reason
        worker.state_since = time.monotonic()
        worker.revision += 1
        self._refresh(worker.role)
        logger.info("worker %s %s: %s -> %s (%s)", worker.id, worker.url, old, state, reason or "-")
        self._emit("state", worker, old=old.value, new=state.value, reason=reason)

    def set_health(self, worker: Worker, healthy: bool, reason: str = "", *, breaker: str | None = None) -> None:
        """Health is separate from state: probes and the circuit breaker decide it (router/health.py)."""
        breaker_changed = breaker is not None and breaker != worker.breaker
        if breaker_changed:
            worker.breaker = breaker
        if worker.healthy is healthy:
            worker.health_reason = reason
            if breaker_changed:
                self._emit("health", worker, healthy=healthy, reason=reason, breaker=breaker)
            return
        worker.healthy = healthy
        worker.health_reason = reason
        self._refresh(worker.role)
        logger.warning("worker %s %s is now %s (%s)", worker.id, worker.url,
                       "healthy" if healthy else "unhealthy", reason or "-")
        self._emit("health", worker, healthy=healthy, reason=reason, breaker=worker.breaker)

    def move(self, worker: Worker, role: Role, bootstrap_port: int | None, state: WorkerState, reason: str) -> None:
        """Put a worker into the other pool (after a verified role switch)."""
        old_role = worker.role
        worker.role = role
        worker.bootstrap_port = bootstrap_port
        worker.state = state
        worker.state_reason = reason
        worker.state_since = time.monotonic()
        worker.revision += 1
        self._refresh(old_role)
        self._refresh(role)
        logger.info("worker %s %s moved %s -> %s (bootstrap port %s)", worker.id, worker.url, old_role, role,
                    bootstrap_port)
        self._emit("moved", worker, old_role=old_role.value, new_role=role.value, bootstrap_port=bootstrap_port)

    def update_info(self, worker: Worker, **fields) -> None:
        """Facts learnt from the server (bootstrap port, weight version, switch API, version)."""
        changed = {k: v for k, v in fields.items() if getattr(worker, k) != v}
        if not changed:
            return
        for key, value in changed.items():
            setattr(worker, key, value)
        worker.revision += 1
        self._refresh(worker.role)
        self._emit("info", worker, **changed)

    def mark_aborted(self, workers: Iterable[Worker]) -> None:
        for worker in workers:
            worker.abort_epoch += 1

    # ---- in-flight accounting (hot path) -----------------------------------------------------------
    def acquire(self, worker: Worker) -> None:
        worker.inflight += 1
        worker.requests_total += 1
        worker._idle.clear()

    def release(self, worker: Worker) -> None:
        worker.inflight -= 1
        if worker.inflight <= 0:
            worker.inflight = 0
            worker._idle.set()

    async def wait_idle(self, worker: Worker, timeout: float) -> bool:
        """Wait until no routed request holds the worker; False if the deadline passed first."""
        try:  # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancel racing the wake-up
            async with asyncio.timeout(timeout):
                await worker._idle.wait()
            return True
        except TimeoutError:
            return worker.inflight == 0

    # ---- change notification -----------------------------------------------------------------------
    async def wait_changed(self, timeout: float) -> None:
        try:
            await asyncio.wait_for(self._changed.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    def _refresh(self, role: Role) -> None:
        self._routable[role] = tuple(w for w in self._workers.values() if w.role is role and w.routable)
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()
