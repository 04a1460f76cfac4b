"""A weight update of the whole fleet, step by step (each step has a deadline and is recorded with its outcome):

    hold      new requests wait in the router's bounded queue (FleetControl.holding)
    quiesce   drain, or abort (`abort_all_requests`) and wait (FleetControl.quiesce) — skipped when the
              fleet is paused (servers then update without their lock)
    update    the update goes to every P and D server at once; tensor and distributed updates are wrapped
              in `begin/end_weight_update` on servers that have them (0.5.23), unless the client opened
              the session itself through the router
    verify    every server must have succeeded and report the same live weight version; a server that
              failed, or reports another version, leaves routing (state `failed`)
    release   the held requests go on, to servers that all serve the same weights

The fleet never serves a silent mix of versions: the fleet's version is the registry's, which routes no
server on another one; a server left out is held out in the registry and rejoins only when its live version
is the fleet's (after a later update reaches it, or when the reconciler sees it was fixed: held_out.py).
When every server refused a disk update or a version relabel and all still report the version they had,
nothing changed: the fleet keeps serving. Also here: the fan-outs that change no routing (update groups,
sessions: `broadcast`).
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable

from aiohttp import web

from router.control.live_state import LiveState, read_live_state, read_weight_version
from router.control.upstream import INFO_TIMEOUT, fan_out
from router.core.coordination import Ticket
from router.core.errors import ServiceUnavailable
from router.core.registry import Role, Worker, WorkerState
from router.core.routability import HoldKind, choose_fleet_version
from router.flows.fleet import WorkerResult, http_status, summary
from router.flows.fleet_control import FleetControl
from router.flows.operations import Operation

DISK = "update_weights_from_disk"
DISTRIBUTED = "update_weights_from_distributed"
TENSOR = "update_weights_from_tensor"
VERSION = "update_weight_version"
UPDATE_KINDS = (DISK, DISTRIBUTED, TENSOR, VERSION)
SESSION_KINDS = frozenset({DISTRIBUTED, TENSOR})  # 0.5.23: only inside begin/end_weight_update
# A failed disk load is rolled back by SGLang and a version relabel is atomic: if every server refused
# and still reports its old version, nothing changed.
ATOMIC_KINDS = frozenset({DISK, VERSION})
CACHE_NOT_FLUSHED = "cache was not flushed"
# How long a replica taking an update over waits for the servers it reached to report its version. A server
# still loading after that is held out for its weights and let back by the reconciler once it serves the
# fleet's version.
SETTLE_S = 30.0
POLL_S = 0.2  # a polling cadence: a server says nothing when its update ends
SESSION_ALREADY_OPEN = "already open"
# What an update left in a server's cache (`WorkerResult.extra["cache"]`; absent: flushed by the update)
STALE = "stale"  # not flushed (requests were there): held out as `cache` until the router flushes it
KEPT = "kept"  # the client asked for no flush (`flush_cache: false`): its choice, nothing held


class WeightUpdates:
    def __init__(self, fleet: FleetControl) -> None:
        self.fleet = fleet
        self.registry = fleet.registry
        self.upstream = fleet.upstream
        self._no_session_api: set[str] = set()  # workers whose server has no begin/end_weight_update
        self.registry.subscribe(self._on_registry_event)

    def _on_registry_event(self, event: str, worker: Worker, details: dict) -> None:
        if event == "removed":
            self._no_session_api.discard(worker.id)

    async def update(self, kind: str, body: dict, *, abort: bool, retry: bool) -> tuple[int, dict]:
        target = body.get("new_version") if kind == VERSION else body.get("weight_version")
        options = {"abort_all_requests": abort, "retry_aborted": retry, "weight_version": target}
        return await self.fleet.operations.run(kind, options,
                                               lambda op: self._update(op, kind, body, target, abort, retry),
                                               changes_at="update")

    async def _update(self, op: Operation, kind: str, body: dict, target: str | None, abort: bool,
                      retry: bool) -> tuple[int, dict]:
        fleet, timeout = self.fleet, self.fleet.config.weight_update_timeout_secs
        deadline = op.started + timeout
        async with fleet.gate_closed(op, f"{kind} {op.id}"):
            workers = fleet.targets()
            if not workers:
                raise ServiceUnavailable("there is no server to update")
            # What each server serves before (read while quiescing): tells a refused update, where nothing
            # changed, from a half-done one.
            snapshot, quiet = await asyncio.gather(
                asyncio.gather(*(read_weight_version(self.upstream, w.url) for w in workers)),
                fleet.quiesce(op, workers, abort=abort, retry=retry))
            if not quiet:
                return fleet.quiesce_timeout_answer(op, "update")
            before = dict(zip(workers, snapshot))

            await op.owned.progress("update")  # a replica taking it over knows from here on
            step = op.step("update", timeout)
            results = await fleet.sent(fan_out(workers, lambda w: self._apply(kind, w, body, deadline)))
            step.end("ok" if all(o.success for o in results) else "failed", summary(results, kind))

            step = op.step("verify", INFO_TIMEOUT)
            versions = await asyncio.gather(*(read_weight_version(self.upstream, w.url) for w in workers))
            message = self.settle(kind, results, versions, before, target)
            step.end("ok" if all(o.success for o in results) else "failed", message)
            op.weight_version = self.registry.fleet_version
            op.workers = [o.to_dict() for o in results]
            status = http_status(results)
            return status, {
                "success": status == 200,
                "message": message,
                "num_paused_requests": _paused_count(results),
                "num_aborted_requests": op.aborted_requests,
                "num_finished_requests": op.finished_requests,  # in flight at the start, finished before the abort
                "weight_version": self.registry.fleet_version,
                "update_id": op.id,
                "workers": op.workers,
                "left_out": [w.url for w in workers if w.id in fleet.left_out],
            }

    async def _apply(self, kind: str, worker: Worker, body: dict, deadline: float) -> WorkerResult:
        """One server's update, wrapped in a begin/end_weight_update session where it needs one."""
        timeout = max(deadline - time.monotonic(), 1.0)
        wrap = kind in SESSION_KINDS and not self.fleet.session_open and worker.id not in self._no_session_api
        if wrap:
            begin = await self.upstream.post(worker.url, "/begin_weight_update", {}, timeout=timeout)
            if begin.status in (404, 405):  # a server from before sessions: nothing to wrap
                self._no_session_api.add(worker.id)
                wrap = False
            elif not begin.success() and SESSION_ALREADY_OPEN in begin.message():
                # A session left open (an earlier update that died half-way): close it, open ours.
                await self.upstream.post(worker.url, "/end_weight_update", {}, timeout=timeout)
                begin = await self.upstream.post(worker.url, "/begin_weight_update", {}, timeout=timeout)
            if wrap and not begin.success():
                result = WorkerResult.of(worker, begin)
                result.message = f"begin_weight_update failed: {result.message}"
                return result
        reply = await self.upstream.post(worker.url, "/" + kind, body, timeout=timeout)
        result = WorkerResult.of(worker, reply)
        if wrap:
            end = await self.upstream.post(worker.url, "/end_weight_update", {}, timeout=timeout)
            if result.success and not end.success():
                result = WorkerResult.of(worker, end)
                result.message = f"end_weight_update failed: {result.message}"
        if not result.success and reply.status == 400 and CACHE_NOT_FLUSHED in result.message:
            # 0.5.23 changed the weights but found requests still there when it flushed (a request got in
            # after the quiesce, or the server is paused in place: then it cannot become idle until continue).
            # The update took; the cache the old weights left is the router's to flush once the server is idle.
            wait = "" if self.fleet.paused is not None else "?timeout=5"
            flush = await self.upstream.post(worker.url, "/flush_cache" + wait, timeout=10)
            result.success = True
            if flush.ok:
                result.message += " The router flushed the cache once the server was idle."
            else:
                result.extra["cache"] = STALE
                result.message += (" It stays out of routing until the router has flushed its cache, once its "
                                   "requests are done.")
        elif result.success and body.get("flush_cache") is False:
            result.extra["cache"] = KEPT
        return result

    def settle(self, kind: str, results: list[WorkerResult], versions: list[str | None],
               before: dict[Worker, str | None], target: str | None) -> str:
        """Decide who serves after an update; set states and the fleet's version; return the message."""
        for result, version in zip(results, versions):
            result.extra["weight_version"] = version
        if (kind in ATOMIC_KINDS and not any(o.success for o in results)
                and all(o.answered for o in results)
                and all(v is not None and v == before[o.worker] for o, v in zip(results, versions))
                and len(set(versions)) == 1):
            for result in results:
                result.extra["routable"] = result.worker.routable
            return (summary(results, kind) + f" Nothing changed: every server still serves version "
                    f"{versions[0]!r}, and stays in routing.")
        # a server that took the update but reports no version is taken at its word
        chosen = version_after_update(target, [(o.worker.role, v if v is not None else target)
                                               for o, v in zip(results, versions) if o.success])
        for result, version in zip(results, versions):
            if result.success and chosen is not None and version is not None and version != chosen:
                result.success = False
                result.message = (f"{result.message} But it reports weight_version {version!r}, not the "
                                   f"fleet's {chosen!r}.").strip()
        served = sum(o.success for o in results)
        # The fleet's version and every server's new one in one step: nobody judged half-way.
        self.registry.set_fleet_version(
            chosen if served and chosen is not None else self.registry.fleet_version,
            f"{kind} {self.fleet.current.id if self.fleet.current else ''}".strip(),
            worker_versions={o.worker: v for o, v in zip(results, versions) if v is not None})
        for result, version in zip(results, versions):
            worker = result.worker
            cache = result.extra.get("cache")
            if result.success and cache == STALE:
                self.fleet.held_out.leave_out(worker, HoldKind.CACHE, f"{kind}: updated to {version!r}, but its "
                                                                      "cache still holds the old weights' KV")
            elif result.success:  # flushed by this update: a cache hold from an earlier one ends too
                kinds = (HoldKind.WEIGHTS,) if cache == KEPT else (HoldKind.WEIGHTS, HoldKind.CACHE)
                self.fleet.held_out.rejoin(worker, f"weights: updated to {version!r}", kinds=kinds)
            else:
                self.fleet.held_out.leave_out(worker, HoldKind.WEIGHTS, f"{kind} failed: {result.message}"[:500])
            result.extra["routable"] = worker.routable
        message = summary(results, kind)
        failed = len(results) - served
        if failed:
            message += (f" {failed} server(s) left out of routing until they serve version "
                        f"{self.registry.fleet_version!r}.")
        if stale := sum(o.success and o.extra.get("cache") == STALE for o in results):
            message += f" {stale} server(s) out of routing until their cache is flushed, once idle."
        return message

    # ---- an update whose replica died: settled by the replica taking it over (`core/recovery.py`) --------
    async def recover(self, ticket: Ticket, record: dict) -> tuple[str, str]:
        """Every server's live version is read (once the update's step was reached, again until they report
        what it asked for, up to SETTLE_S and the update's own deadline); the fleet serves the version
        `version_after_update` chooses from them, servers on another one are held out (`weights`), those it
        had held out for their weights and that serve it rejoin."""
        workers = [w for w in self.registry.workers() if w.state is not WorkerState.PENDING]
        read = await self._live_versions(workers)
        options = ticket.details.get("options") if isinstance(ticket.details.get("options"), dict) else {}
        target, before = options.get("weight_version"), self.registry.fleet_version
        if record.get("step") == "update":
            # the servers may still be loading: wait, as the owner would have, for them to report the version
            # asked for (or, none named, to agree on a new one), up to SETTLE_S and the update's own deadline
            started = record.get("started_at") if isinstance(record.get("started_at"), (int, float)) else time.time()
            timeout = self.fleet.config.weight_update_timeout_secs
            deadline = time.monotonic() + min(max(started + timeout - time.time(), 0.0), SETTLE_S)
            while not _updated(read, target, before) and time.monotonic() < deadline:
                await asyncio.sleep(POLL_S)
                read = await self._live_versions(workers)
        chosen = version_after_update(target, [(live.role or w.role, live.weight_version) for w, live in read.items()])
        why = f"{ticket.kind} {ticket.op_id}: its replica {record.get('owner')} died"
        self.registry.set_fleet_version(chosen if chosen is not None else self.registry.fleet_version, why,
                                        worker_versions={w: live.weight_version for w, live in read.items()})
        fleet_version, out = self.registry.fleet_version, []
        for worker, live in read.items():
            if live.weight_version != fleet_version:
                self.fleet.held_out.leave_out(worker, HoldKind.WEIGHTS, f"{why}; it serves {live.weight_version!r}, "
                                                                        f"the fleet {fleet_version!r}")
                out.append(worker.url)
            else:
                self.fleet.held_out.rejoin(worker, f"{why}; it serves the fleet's version", kinds=(HoldKind.WEIGHTS,))
        versions = sorted({str(live.weight_version) for live in read.values()})
        message = (f"{why}; the servers report {', '.join(versions) or 'no version'}: the fleet serves "
                   f"{fleet_version!r}" + (f", {', '.join(out)} held out" if out else ""))
        if out or len(versions) != 1:
            return "failed", message
        return ("rolled back" if fleet_version == before != target else "succeeded"), message

    async def _live_versions(self, workers: list[Worker]) -> dict[Worker, LiveState]:
        lives = await asyncio.gather(*(read_live_state(self.upstream, w.url) for w in workers))
        return {w: live for w, live in zip(workers, lives) if live.reachable and live.weight_version is not None}

    # ---- plain fan-outs ------------------------------------------------------------------------------
    async def broadcast(self, path: str, body: dict | None, *, timeout: float | None = None,
                        workers: list[Worker] | None = None,
                        per_worker: Callable[[Worker], dict] | None = None) -> tuple[int, dict]:
        """A control call that changes no routing (update groups, sessions): to every server, at once."""
        timeout = timeout or self.fleet.config.weight_update_timeout_secs
        workers = self.fleet.targets() if workers is None else workers
        results = await fan_out(workers, lambda w: self.fleet.call(
            w, path, per_worker(w) if per_worker else body, timeout))
        if path == "/begin_weight_update":
            self.fleet.session_open = any(o.success for o in results)
        elif path == "/end_weight_update":
            self.fleet.session_open = False
        return self.fleet.aggregate(None, results, path.strip("/"))


def version_after_update(target: str | None, reports: list[tuple[Role, str | None]]) -> str | None:
    """The one rule for the weight version a fleet serves after an update, at its own end (`reports`: the
    servers that took it) and at a takeover's (every server read): the version asked for where a prefill and
    a decode server report it; else the version `choose_fleet_version` picks among the reports (one a P/D
    pair serves, the most common first); None when no server reports one (the fleet's version stays)."""
    if target is not None and {role for role, v in reports if v == target} == {Role.PREFILL, Role.DECODE}:
        return target
    return choose_fleet_version(reports)


def _updated(read: dict[Worker, LiveState], target: str | None, before: str | None) -> bool:
    """Every server read reports the version the update asked for (none named: one version, not the old)."""
    versions = {live.weight_version for live in read.values()}
    if target is not None:
        return versions == {target}
    return len(versions) == 1 and versions != {before}


def _paused_count(results: list[WorkerResult]) -> int:
    total = 0
    for result in results:
        value = result.data.get("num_paused_requests") if isinstance(result.data, dict) else None
        if isinstance(value, list):
            total += sum(v for v in value if isinstance(v, int))
        elif isinstance(value, int) and not isinstance(value, bool):
            total += value
    return total


UPDATES = web.AppKey("weight_updates", WeightUpdates)
