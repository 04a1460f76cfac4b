"""Fleet-wide building blocks of the control flows: fan a call out to many servers, read the live weight
version of each, and wait until a set of servers is really quiet (router side and server side)."""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from router.control.live_state import read_weight_version
from router.control.upstream import INFO_TIMEOUT, Reply, Upstream
from router.core.reabort import abort_until_ended, wake_when_router_idle
from router.core.redact import redact_text
from router.core.registry import Registry, Worker

logger = logging.getLogger(__name__)

POLL_FIRST, POLL_MAX = 0.01, 0.2  # polling a server until it has switched: first and longest wait


@dataclass(slots=True)
class WorkerResult:
    """One server's answer to one fan-out call."""

    worker: Worker
    success: bool
    status: int
    message: str
    data: object = None
    extra: dict = field(default_factory=dict)

    @classmethod
    def of(cls, worker: Worker, reply: Reply, **extra) -> "WorkerResult":
        return cls(worker, reply.success(), reply.status, _message(reply), reply.data, extra)

    @property
    def answered(self) -> bool:
        """The server gave an answer of its own (a refusal is an answer; unreachable or a 5xx is not)."""
        return 0 < self.status < 500

    def to_dict(self) -> dict:
        return {"url": self.worker.url, "role": self.worker.role.value, "success": self.success,
                "status": self.status, "message": self.message, **self.extra}


def _message(reply: Reply) -> str:
    if reply.status == 0:
        return f"unreachable: {reply.text}"
    if isinstance(reply.data, dict):
        return reply.message()
    return redact_text(reply.text.strip()[:500])


def http_status(results: list[WorkerResult]) -> int:
    """200 when every server succeeded; 502 when one did not answer (unreachable, 5xx); else 400 (SGLang's
    status for a refused control call)."""
    if all(o.success for o in results):
        return 200
    if any(not o.success and not o.answered for o in results):
        return 502
    return 400


def summary(results: list[WorkerResult], what: str) -> str:
    failed = [o for o in results if not o.success]
    if not failed:
        messages = {o.message for o in results}
        return messages.pop() if len(messages) == 1 else f"{what} succeeded on {len(results)} servers."
    details = "; ".join(f"{o.worker.url} ({o.worker.role}): {o.message}" for o in failed)
    return f"{what} failed on {len(failed)} of {len(results)} servers: {details}"


# ---- weight versions ---------------------------------------------------------------------------------
@dataclass(slots=True)
class FleetVersion:
    version: str | None  # the one version every routable server reports, else None
    consistent: bool
    workers: list[dict]

    def to_dict(self) -> dict:
        return {"weight_version": self.version, "consistent": self.consistent, "workers": self.workers}


async def read_fleet_weight_version(registry: Registry, upstream: Upstream, workers: list[Worker] | None = None,
                                    timeout: float = INFO_TIMEOUT) -> FleetVersion:
    """Read every server's live version; the fleet's version is the one its routable servers agree on.
    Servers left out of routing are listed (with `routable: false`) but do not make the fleet disagree."""
    workers = list(registry.workers()) if workers is None else workers
    versions = await asyncio.gather(*(read_weight_version(upstream, w.url, timeout) for w in workers))
    rows = []
    for worker, version in zip(workers, versions):
        routed = worker.routable  # as it was served: a version read now takes a stray server out at once
        if version is not None and version != worker.weight_version and registry.find(worker.id) is worker:
            registry.update_info(worker, weight_version=version)
        rows.append({"url": worker.url, "role": worker.role.value, "weight_version": version,
                     "state": worker.state.value, "routable": routed})
    served = {row["weight_version"] for row in rows if row["routable"]}
    if not served:  # nothing routable: the fleet's version is whatever the servers agree on, if they do
        served = {row["weight_version"] for row in rows}
    consistent = len(served) == 1 and None not in served
    return FleetVersion(served.pop() if consistent else None, consistent, rows)


def most_common(values: Iterable[str | None]) -> str | None:
    counts = collections.Counter(v for v in values if v is not None)
    return counts.most_common(1)[0][0] if counts else None


# ---- quiescing ---------------------------------------------------------------------------------------
@dataclass(slots=True)
class Quiet:
    ok: bool
    duration_s: float
    busy: list[dict]  # what was still running at the deadline
    aborts_sent: int = 0
    silent: list[str] = field(default_factory=list)  # servers that tell nothing about their load
    router_idle_s: float | None = None  # when no replica had a request left on them (None: not yet)
    server_polls: int = 0  # load reads of the servers


async def wait_quiet(registry: Registry, upstream: Upstream, workers: list[Worker], deadline: float, *,
                     abort: bool, elsewhere: Callable[[Worker], int] = lambda worker: 0,
                     watch: Callable[[Quiet], None] = lambda progress: None) -> Quiet:
    """Wait until no routed request holds any of `workers` and each server reports nothing running or
    waiting (`/v1/loads`, else `/get_load`). With `abort`, send `abort_all` first and again to servers
    still busy (`abort_until_ended`'s timing: SGLang's abort is asynchronous, and a leg already on the wire
    can reach the server after it). The caller has taken them out of routing (their state, or the fleet's
    hold), so nothing new arrives from the router. The one idle wait of every flow (a conversion's drain or
    abort on one server, a fleet's quiesce), so one replica or five read the same:
    `elsewhere`: the requests other router replicas of the fleet still have on a worker (they count too).
    `watch`: told what is still busy after each look (ok False), for a flow's visible state; a deadline of
    `math.inf` leaves the deadline to the caller (cancelling the wait)."""
    started = time.monotonic()
    aborts = 0
    router_idle: float | None = None
    polls = 0
    silent: set[Worker] = set()
    progress = Quiet(False, 0.0, [], 0)

    async def abort_all(targets: Sequence[Worker]) -> None:
        nonlocal aborts
        aborts += len(targets)
        await asyncio.gather(*(upstream.abort(w.url, abort_all=True, timeout=INFO_TIMEOUT) for w in targets))

    async def still_busy() -> list[Worker]:
        """One look: the router's side first (every replica's), then the servers' own load."""
        nonlocal router_idle, polls, progress
        remote = {w: n for w in workers if (n := elsewhere(w))}
        busy: list[dict] = [{"url": w.url, "role": w.role.value, "router_inflight": w.inflight,
                             **({"other_replicas_inflight": remote[w]} if w in remote else {})}
                            for w in workers if w.inflight or w in remote]
        busy_workers = [w for w in workers if w.inflight or w in remote]
        if not busy:
            router_idle = time.monotonic() - started if router_idle is None else router_idle
            polls += 1
            loads = await asyncio.gather(*(upstream.load(w.url, timeout=INFO_TIMEOUT) for w in workers))
            for worker, load in zip(workers, loads):
                if load is None:
                    silent.add(worker)
                elif not load.idle:
                    busy.append({"url": worker.url, "role": worker.role.value, "running": load.running,
                                 "waiting": load.waiting, "pd_queues": load.queued})
                    busy_workers.append(worker)
        progress = Quiet(not busy, time.monotonic() - started, busy, aborts, sorted(w.url for w in silent),
                         router_idle, polls)
        if busy and time.monotonic() < deadline:
            watch(progress)
        return busy_workers

    if abort:  # every server, busy or not: a request may reach one after the router's count says it is idle
        await abort_all(workers)
    await abort_until_ended(still_busy, abort_all if abort else None, deadline, aborted_at=time.monotonic(),
                            wait=lambda busy, seconds: wake_when_router_idle(registry, busy, seconds))
    if progress.ok and silent:
        logger.warning("servers %s report no load: quiet judged from the router's side only",
                       ", ".join(w.url for w in silent))
    progress.aborts_sent = aborts
    return progress
