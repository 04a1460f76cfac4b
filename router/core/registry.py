"""The worker registry: the single source of truth for who serves which role.

Every change of worker state goes through a method of `Registry`, which keeps the routable snapshot of each
pool up to date (the request path only reads a cached tuple), wakes waiters, and tells listeners (metrics,
logs, policies). Decisions about *when* to change state live in the flows and the health checker; the
registry only applies them. A later multi-replica backend can replace this class behind the same methods.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable
from urllib.parse import urlsplit

from router.core.routability import Hold, HoldKind, judge
from router.core.states import Role, WorkerState
from router.core.worker_url import BadWorkerUrl, identity, parse_worker_url

if TYPE_CHECKING:
    from policies import ServerLoad

logger = logging.getLogger(__name__)


class UnknownWorker(LookupError):
    pass


class DuplicateWorker(ValueError):
    pass


def bootstrap_host_of(url: str) -> str:
    """The hostname decode servers use to reach a prefill's bootstrap server (IPv6 in brackets)."""
    host = urlsplit(url).hostname or ""
    return f"[{host}]" if ":" in host else host


def normalize_url(url: str) -> str:
    """The identity of a worker URL however it is written (core/worker_url.py)."""
    return identity(url)


@dataclass(eq=False, slots=True)
class Worker:
    id: str
    url: str
    role: Role
    bootstrap_port: int | None
    bootstrap_host: str
    state: WorkerState = WorkerState.ACTIVE
    # The health monitor's verdict (probes and circuit breaker) and why; set through `Registry.set_health`.
    monitor_healthy: bool = True
    monitor_reason: str = ""
    breaker: str = "closed"  # the circuit breaker's phase
    # Held out of routing by a fleet operation or by what the server said about itself (routability.Hold).
    hold: Hold | None = None
    # Judged by the registry after every change (routability.judge); never set elsewhere.
    healthy: bool = True  # the monitor's verdict and the weight check
    health_reason: str = ""
    routable: bool = False
    unroutable_reason: str = ""
    # Router-side count of requests holding this worker (selection → last byte or client gone).
    inflight: int = 0
    # Bumped on every change of role, port or state, so that stale asynchronous results can be discarded.
    revision: int = 0
    weight_version: str | None = None
    # Which role-switch API the server speaks ("pd_role_switch", "convert_pd_role"), learnt from it.
    switch_api: str | None = None
    server_version: str | None = None
    # Data-parallel ranks (dp_size x attn_dp_size, from /server_info: docs/DP_RANKS.md); whether they are
    # attention DP; why 0.5.23 would refuse to switch its role (None: it would not, for DP reasons).
    dp_ranks: int = 1
    attention_dp: bool = False
    dp_switch_refusal: str | None = None
    # The router's in-flight count per rank (`--dp-aware`: the request path keeps it; empty otherwise).
    rank_inflight: list[int] = field(default_factory=list)
    # Where the worker was registered ("--decode", "POST /workers", ...): named when its live role differs.
    source: str = ""
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
    # `user:password` of a URL registered with credentials: the control plane still sends them (HTTP Basic);
    # never in `url`, `to_dict`, a log line or a metric label.
    userinfo: str | None = field(default=None, repr=False)
    # The peers' worker-API fields (POST /workers, PATCH /workers/{id}): labels, priority and cost are kept and
    # shown (no pd-router policy weighs them, nor do the peers'); api_key is sent to this worker alone, as
    # `Authorization: Bearer` on its legs (`auth_line`) and its control-plane calls, never shown.
    labels: dict = field(default_factory=dict)
    priority: int | None = None
    cost: float | None = None
    api_key: str | None = field(default=None, repr=False)
    auth_line: bytes | None = field(default=None, repr=False)
    _idle: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    @property
    def held_out(self) -> bool:
        """Kept out of routing by an operation until what its hold's kind names brings it back (state `failed`
        on the wire, with `hold` set)."""
        return self.hold is not None

    @property
    def unsafe(self) -> bool:
        """Left unsafe by a failed operation: an operator reinstates or removes it (state `failed` on the wire,
        no hold). The one other meaning of that state is `held_out`."""
        return self.state is WorkerState.FAILED and self.hold is None

    def to_dict(self) -> dict:
        return {
            "id": self.id,
            "url": self.url,
            "role": self.role.value,
            "worker_type": self.role.value,
            "bootstrap_port": self.bootstrap_port,
            "state": self.state.value,
            "state_reason": self.state_reason,
            "hold": self.hold.to_dict() if self.hold is not None else None,
            "is_healthy": self.healthy,
            "health_reason": self.health_reason,
            "breaker": self.breaker,
            "routable": self.routable,
            "unroutable_reason": self.unroutable_reason,
            "inflight": self.inflight,
            "load": self.inflight,
            "revision": self.revision,
            "weight_version": self.weight_version,
            "switch_api": self.switch_api,
            "source": self.source,
            "requests_total": self.requests_total,
            "failures_total": self.failures_total,
            "dp_ranks": self.dp_ranks,
            "attention_dp": self.attention_dp,
            "ranks": rank_rows(self),
            "labels": self.labels,
            "priority": self.priority,
            "cost": self.cost,
            "api_key_set": self.api_key is not None,
        }


def rank_rows(worker: Worker, *, single: bool = False) -> list[dict]:
    """Each data-parallel rank: the router's in-flight count on it and the server's own last row for it (a
    one-rank server: none, unless `single`)."""
    if worker.dp_ranks <= 1 and not worker.rank_inflight and not single:
        return []
    load = worker.server_load
    reported = {r.dp_rank: r for r in load.report.ranks} if load is not None and load.report is not None else {}
    rows = []
    for rank in range(worker.dp_ranks):
        row = reported.get(rank)
        rows.append({"dp_rank": rank,
                     "inflight": worker.rank_inflight[rank] if rank < len(worker.rank_inflight) else 0,
                     "running": row.running if row else None, "waiting": row.waiting if row else None,
                     "token_usage": row.token_usage if row else None})
    return rows


# (event, worker, details); fleet-wide events ("fleet_version") carry worker None.
Listener = Callable[[str, "Worker | None", dict], None]


class Registry:
    """Workers of both pools, the fleet's weight version, and a cached routable snapshot per role.

    Routability is computed here and nowhere else (`routability.judge` over state, health verdict, breaker,
    weight version against `fleet_version`, and hold); every change of it emits a `routable` event.
    Events: added, removed, state, health, moved, info, held, hold_ended, routable, fleet_version.
    """

    def __init__(self) -> None:
        self._workers: dict[str, Worker] = {}
        self._by_url: dict[str, Worker] = {}
        self._routable: dict[Role, tuple[Worker, ...]] = {Role.PREFILL: (), Role.DECODE: ()}
        self._ids = itertools.count(1)
        self._listeners: list[Listener] = []
        self._fleet_version: str | None = None

    # ---- reads -------------------------------------------------------------------------------------
    def routable(self, role: Role) -> tuple[Worker, ...]:
        return self._routable[role]

    @property
    def fleet_version(self) -> str | None:
        """The weight version the fleet serves (None: none known; nobody is held to one)."""
        return self._fleet_version

    def workers(self, role: Role | None = None) -> list[Worker]:
        if role is None:
            return list(self._workers.values())
        return [w for w in self._workers.values() if w.role is role]

    def held(self, kind: HoldKind | str | None = None) -> list[Worker]:
        """Workers held out of routing (of one kind, or all)."""
        return [w for w in self._workers.values() if w.hold is not None and (kind is None or w.hold.kind == kind)]

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

    def _emit(self, event: str, worker: Worker | None, **details) -> None:
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
        source: str = "",
        worker_id: str | None = None,
    ) -> Worker:
        """`worker_id`: the id to give it when free (the one another router replica gave it), else a new one.
        The URL is kept in its canonical form, its credentials apart (`Worker.userinfo`, never shown)."""
        try:
            parsed = parse_worker_url(url)
            url, userinfo = parsed.url, parsed.userinfo
        except BadWorkerUrl:  # the callers check URLs first; a test's may be anything
            url, userinfo = url.strip().rstrip("/"), None
        if url in self._by_url:
            raise DuplicateWorker(f"worker {url} is already registered")
        if not worker_id or worker_id in self._workers:
            worker_id = self._new_id()
        worker = Worker(
            id=worker_id,
            url=url,
            role=role,
            bootstrap_port=bootstrap_port,
            bootstrap_host=bootstrap_host_of(url),
            state=state,
            monitor_healthy=healthy,
            state_reason=reason,
            source=source,
            userinfo=userinfo,
        )
        worker._idle.set()
        self._workers[worker.id] = worker
        self._by_url[url] = worker
        self._judge(worker)
        self._refresh(worker.role)
        logger.info("worker %s %s added as %s (bootstrap port %s, %s)", worker.id, url, role, bootstrap_port, state)
        self._emit("added", worker)
        if worker.routable:
            self._emit_routable(worker)
        return worker

    def _new_id(self) -> str:
        while (worker_id := f"w{next(self._ids)}") in self._workers:
            pass  # taken by an id given from outside
        return worker_id

    def remove(self, worker: Worker) -> None:
        if self._workers.pop(worker.id, None) is None:
            raise UnknownWorker(worker.id)
        self._by_url.pop(worker.url, None)
        worker.revision += 1
        was_routable, worker.routable, worker.unroutable_reason = worker.routable, False, "removed"
        self._refresh(worker.role)
        logger.info("worker %s %s removed", worker.id, worker.url)
        self._emit("removed", worker)
        if was_routable:
            self._emit_routable(worker)

    def set_state(self, worker: Worker, state: WorkerState, reason: str = "") -> None:
        if worker.state is state and worker.state_reason == reason:
            return
        old = worker.state
        ended = worker.hold if state is not WorkerState.FAILED else None
        if ended is not None:  # out of `failed` by another hand (an operator's reinstate): the hold is over
            worker.hold = None
        self._set_state(worker, state, reason)
        self._commit(worker, (worker.role,), "state", old=old.value, new=state.value, reason=reason)
        if ended is not None:
            self._emit("hold_ended", worker, kind=ended.kind.value, reason=reason)

    def _set_state(self, worker: Worker, state: WorkerState, reason: str) -> None:
        old = worker.state
        worker.state = state
        worker.state_reason = reason
        worker.state_since = time.monotonic()
        worker.revision += 1
        logger.info("worker %s %s: %s -> %s (%s)", worker.id, worker.url, old, state, reason or "-")

    def set_health(self, worker: Worker, healthy: bool, reason: str = "", *, breaker: str | None = None) -> None:
        """The health monitor's verdict (router/control/health.py); the registry adds the weight check."""
        breaker_changed = breaker is not None and breaker != worker.breaker
        if breaker_changed:
            worker.breaker = breaker
        worker.monitor_healthy = healthy
        worker.monitor_reason = reason
        was_healthy = worker.healthy
        self._commit(worker, (worker.role,))
        if worker.healthy is was_healthy and breaker_changed:
            self._emit("health", worker, healthy=worker.healthy, reason=worker.health_reason, breaker=worker.breaker)

    def move(self, worker: Worker, role: Role, bootstrap_port: int | None, state: WorkerState, reason: str) -> None:
        """Put a worker into the other pool (after a verified role switch, or its live role read)."""
        old_role = worker.role
        ended = worker.hold if state is not WorkerState.FAILED else None
        worker.hold = None if ended is not None else worker.hold
        worker.role = role
        worker.bootstrap_port = bootstrap_port
        worker.state = state
        worker.state_reason = reason
        worker.state_since = time.monotonic()
        worker.revision += 1
        logger.info("worker %s %s moved %s -> %s (bootstrap port %s)", worker.id, worker.url, old_role, role,
                    bootstrap_port)
        self._commit(worker, (old_role, role), "moved", old_role=old_role.value, new_role=role.value,
                     bootstrap_port=bootstrap_port)
        if ended is not None:
            self._emit("hold_ended", worker, kind=ended.kind.value, reason=reason)

    def update_info(self, worker: Worker, **fields) -> None:
        """Facts learnt from the server (bootstrap port, weight version, switch API, version)."""
        changed = {k: v for k, v in fields.items() if getattr(worker, k) != v}
        if not changed:
            return
        for key, value in changed.items():
            setattr(worker, key, value)
        worker.revision += 1
        self._commit(worker, (worker.role,), "info", **changed)

    def set_settings(self, worker: Worker, **settings) -> None:
        """The worker API's own fields (labels, priority, cost, api_key); the key is never in an event."""
        changed = {k: v for k, v in settings.items() if getattr(worker, k) != v}
        if not changed:
            return
        for key, value in changed.items():
            setattr(worker, key, value)
        if "api_key" in changed:
            worker.auth_line = f"Authorization: Bearer {worker.api_key}\r\n".encode() if worker.api_key else None
            changed["api_key"] = "set" if worker.api_key else None
        self._emit("info", worker, **changed)

    def hold_out(self, worker: Worker, kind: HoldKind | str, reason: str) -> None:
        """Hold a worker out of routing (state `failed`, the hold's kind naming what brings it back)."""
        hold = Hold(HoldKind(kind), reason)
        held = worker.hold
        if held is not None and (held.kind, held.reason) == (hold.kind, reason) and worker.state is WorkerState.FAILED:
            return
        old, state_reason = worker.state, f"left out by {hold.kind}: {reason}"
        worker.hold = hold
        self._set_state(worker, WorkerState.FAILED, state_reason)
        self._commit(worker, (worker.role,), "state", old=old.value, new=WorkerState.FAILED.value, reason=state_reason)
        self._emit("held", worker, kind=hold.kind.value, reason=reason)

    def end_hold(self, worker: Worker, kinds: Iterable[HoldKind | str], reason: str) -> bool:
        """End a hold of one of `kinds`: the worker is active again (still judged: health, weights)."""
        hold = worker.hold
        if hold is None or hold.kind not in {HoldKind(k) for k in kinds}:
            return False
        worker.hold = None
        old = worker.state
        if old is WorkerState.FAILED:
            self._set_state(worker, WorkerState.ACTIVE, reason)
            self._commit(worker, (worker.role,), "state", old=old.value, new=WorkerState.ACTIVE.value, reason=reason)
        else:
            self._commit(worker, (worker.role,))
        self._emit("hold_ended", worker, kind=hold.kind.value, reason=reason)
        return True

    def set_fleet_version(self, version: str | None, reason: str, *,
                          worker_versions: dict[Worker, str] | None = None) -> None:
        """The weight version the fleet serves: a worker on another one is not routed. `worker_versions`:
        the servers' versions read with it (an update's), applied in the same step, so that nobody is
        judged against the old fleet version or with its old weights in between."""
        changed = {w: v for w, v in (worker_versions or {}).items()
                   if self._workers.get(w.id) is w and w.weight_version != v}
        if version == self._fleet_version and not changed:
            return
        old, self._fleet_version = self._fleet_version, version
        if old != version:
            logger.info("fleet weight version %r -> %r (%s)", old, version, reason)
        before = {w.id: (w.healthy, w.routable) for w in self._workers.values()}
        for worker, weight_version in changed.items():
            worker.weight_version = weight_version
            worker.revision += 1
        for worker in self._workers.values():
            self._judge(worker)
        self._refresh(Role.PREFILL)
        self._refresh(Role.DECODE)
        if old != version:
            self._emit("fleet_version", None, old=old, new=version, reason=reason)
        for worker, weight_version in changed.items():
            self._emit("info", worker, weight_version=weight_version)
        for worker in list(self._workers.values()):
            healthy, routable = before[worker.id]
            self._announce(worker, healthy, routable)

    def mark_aborted(self, workers: Iterable[Worker]) -> None:
        for worker in workers:
            worker.abort_epoch += 1

    # ---- judging -----------------------------------------------------------------------------------
    def _judge(self, worker: Worker) -> None:
        verdict = judge(worker.state, worker.monitor_healthy, worker.monitor_reason, worker.breaker,
                        worker.weight_version, self._fleet_version, worker.hold)
        worker.healthy, worker.health_reason = verdict.healthy, verdict.health_reason
        worker.routable, worker.unroutable_reason = verdict.routable, verdict.reason

    def _commit(self, worker: Worker, roles: tuple[Role, ...], event: str | None = None, **details) -> None:
        """Judge the worker again, refresh the pools' snapshots, then tell the listeners what changed."""
        healthy, routable = worker.healthy, worker.routable
        if self._workers.get(worker.id) is worker:
            self._judge(worker)
        for role in dict.fromkeys(roles):
            self._refresh(role)
        if event is not None:
            self._emit(event, worker, **details)
        self._announce(worker, healthy, routable)

    def _announce(self, worker: Worker, healthy: bool, routable: bool) -> None:
        if worker.healthy is not healthy:
            logger.warning("worker %s %s is now %s (%s)", worker.id, worker.url,
                           "healthy" if worker.healthy else "unhealthy", worker.health_reason or "-")
            self._emit("health", worker, healthy=worker.healthy, reason=worker.health_reason, breaker=worker.breaker)
        if worker.routable is not routable:
            self._emit_routable(worker)

    def _emit_routable(self, worker: Worker) -> None:
        logger.info("worker %s %s (%s) is %s", worker.id, worker.url, worker.role,
                    "routable" if worker.routable else f"not routable: {worker.unroutable_reason}")
        self._emit("routable", worker, routable=worker.routable, reason=worker.unroutable_reason)

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

    def _refresh(self, role: Role) -> None:
        self._routable[role] = tuple(w for w in self._workers.values() if w.role is role and w.routable)
