"""Fan-outs that are fleet operations: run through the router's own flows, answered in SMG's fan-out shape.

SMG broadcasts `pause_generation`, an update with `abort_all_requests` or an `abort_request` to the selected
servers and lets the requests in flight fail. Here the same fan-outs run the flows behind the router's
`/pause_generation`, `/update_weights_from_disk`, ... endpoints (hold, quiesce, update, verify, release), so
requests wait in the router's hold, aborted ones are re-sent where that is safe (`retry_aborted`), and no
answer mixes versions. Bodies are SGLang's, checked as strictly as on those endpoints.

A flow always acts on the whole fleet, so the selector must select every server the flow acts on
(`FleetControl.targets()`): a selector that leaves one out is refused with 409 `partial_fleet`, since updating
or pausing part of a P/D fleet would pair servers on different weights. Selected servers the flows do not act
on (pending, or left unsafe by a role conversion) are listed in `skipped`: they serve nothing, and rejoin
only at the fleet's weight version.

The flow's per-server outcomes become SMG's per-worker results: `results[id]` holds the server's status and
its outcome (`success`, `message`, the version it serves, whether it is routable), `failed` the servers the
operation did not succeed on, `operation` the flow's own answer; `latency_ms` is the whole operation's.
"""

from __future__ import annotations

import time
from typing import Awaitable, Callable

from aiohttp import web

from router.api.bodies import parse_body
from router.api.control import init_update_group
from router.api.control_bodies import (BROADCAST_BODIES, UPDATE_BODIES, AbortRequest, ContinueGeneration,
                                       InitUpdateGroup, PauseGeneration, ReleaseMemory, ResumeMemory)
from router.api.rl.engine_relay import fanout_answer, rl_error
from router.core.errors import BadRequest
from router.core.keys import CONFIG, REGISTRY
from router.core.registry import Worker
from router.flows.fleet_control import FLEET_CONTROL, FleetControl
from router.flows.memory import MEMORY
from router.flows.pauses import PAUSES
from router.flows.request_aborts import ABORTS
from router.flows.weight_updates import UPDATES

MEMORY_PATHS = ("release_memory_occupation", "resume_memory_occupation")
Operation = Callable[[web.Application, dict], Awaitable[tuple[int, dict | None]]]


def _retry(app: web.Application, body) -> bool:
    return body.retry(app[CONFIG].weight_update_retry_aborted)


async def _pause(app, raw):
    body = parse_body(PauseGeneration, raw, "pause_generation")
    return await app[PAUSES].pause(body.forwarded(), retry=_retry(app, body))


async def _continue(app, raw):
    body = parse_body(ContinueGeneration, raw, "continue_generation")
    return await app[PAUSES].resume(body.forwarded())


async def _abort(app, raw):
    body = parse_body(AbortRequest, raw, "abort_request")
    if not body.abort_all and not body.rid:
        raise BadRequest("abort_request needs a non-empty rid or abort_all: true", param="rid")
    return await app[ABORTS].abort(rid=body.rid, abort_all=body.abort_all)


def _update(kind: str) -> Operation:
    async def run(app, raw):
        body = parse_body(UPDATE_BODIES[kind], raw, kind)
        return await app[UPDATES].update(kind, body.forwarded(), abort=body.abort_all_requests,
                                         retry=_retry(app, body))
    return run


def _broadcast(name: str) -> Operation:
    async def run(app, raw):
        return await app[UPDATES].broadcast("/" + name, parse_body(BROADCAST_BODIES[name], raw, name).forwarded())
    return run


async def _init_group(app, raw):
    return await init_update_group(app, parse_body(InitUpdateGroup, raw, "init_weights_update_group"))


async def _release_memory(app, raw):
    body = parse_body(ReleaseMemory, raw, "release_memory_occupation")
    return await app[MEMORY].release_memory(body.forwarded(), abort=body.abort_all_requests,
                                            retry=_retry(app, body))


async def _resume_memory(app, raw):
    body = parse_body(ResumeMemory, raw, "resume_memory_occupation")
    return await app[MEMORY].resume_memory(body.forwarded())


OPERATIONS: dict[str, Operation] = {
    "pause_generation": _pause,
    "continue_generation": _continue,
    "abort_request": _abort,
    **{kind: _update(kind) for kind in UPDATE_BODIES},
    "init_weights_update_group": _init_group,
    **{name: _broadcast(name) for name in BROADCAST_BODIES},
    "release_memory_occupation": _release_memory,
    "resume_memory_occupation": _resume_memory,
}


def is_fleet_operation(method: str, path: str) -> bool:
    """SGLang serves these on POST (and the memory ones on GET too); another method is relayed as it is."""
    return path in OPERATIONS and (method == "POST" or (method == "GET" and path in MEMORY_PATHS))


def _whole_fleet(flow: FleetControl, selected: list[Worker], path: str, selector: str
                 ) -> tuple[list[Worker], list[dict]]:
    """The servers the flow acts on, all of which must be selected (else 409), and the selected ones it
    skips."""
    chosen = {w.id for w in selected}
    fleet = flow.targets()
    missing = [w for w in fleet if w.id not in chosen]
    if missing:
        names = ", ".join(f"{w.id} ({w.url}, {w.role})" for w in missing)
        raise rl_error(409, "partial_fleet",
                       f"{path} is a fleet operation in pd-router: it acts on every server at once (hold, "
                       f"quiesce, verify, release), so the selector must select all {len(fleet)} of them; "
                       f"{selector!r} leaves out {names}. Select the whole fleet (for example engine=sglang).",
                       selector=selector, missing=[w.id for w in missing])
    in_fleet = {w.id for w in fleet}
    return fleet, [{"worker_id": w.id, "url": w.url, "state": w.state.value,
             "reason": f"{w.state.value}: not served to, so not part of fleet operations; it rejoins at the "
                       f"fleet's weight version"}
            for w in selected if w.id not in in_fleet]


async def run(app: web.Application, path: str, selected: list[Worker], selector: str, raw: dict
              ) -> tuple[int, dict]:
    fleet, skipped = _whole_fleet(app[FLEET_CONTROL], selected, path, selector)
    started = time.monotonic()
    status, answer = await OPERATIONS[path](app, raw)
    elapsed_ms = round((time.monotonic() - started) * 1000)
    return reshape(app, path, status, answer, fleet, elapsed_ms, skipped)


def reshape(app: web.Application, path: str, status: int, answer: dict | None, fleet: list[Worker],
            elapsed_ms: int, skipped: list[dict]) -> tuple[int, dict]:
    """The flow's (status, answer) as SMG's fan-out answer; an operation that failed as a whole (nothing
    per server to report: a quiesce deadline, no server) is an error of its own."""
    rows = answer.get("workers") if answer is not None else None
    per_server = bool(rows) and all(isinstance(r, dict) and "success" in r for r in rows)
    if status != 200 and not (per_server and not all(r["success"] for r in rows)):
        message = (answer or {}).get("message") or f"{path} failed"
        raise rl_error(status, "fleet_operation_failed", message,
                       operation={k: v for k, v in (answer or {}).items() if k not in ("workers", "error")},
                       workers=rows or [])
    if answer is None:  # SGLang's empty 200 (abort_request): every server took it
        rows = [{"url": w.url, "role": w.role.value, "success": True, "status": 200, "message": "ok"}
                for w in fleet]
        answer = {"success": True, "message": f"{path} succeeded"}
    registry = app[REGISTRY]
    results, failed = {}, []
    for row in rows:
        worker = registry.find(row["url"])
        worker_id = worker.id if worker is not None else row["url"]
        code = row["status"]
        body = {k: v for k, v in row.items() if k not in ("url", "role", "status")}
        if code:
            results[worker_id] = {"worker_id": worker_id, "url": row["url"], "status": code,
                                  "latency_ms": elapsed_ms, "body": body}
        if not row["success"]:
            failed.append({"worker_id": worker_id, "url": row["url"], "status": code or None,
                           "error": _failure_code(code, row.get("message", "")), "message": row.get("message", "")})
    operation = {k: v for k, v in answer.items() if k not in ("workers", "error")}
    return fanout_answer(results, failed, len(rows), operation=operation, skipped=skipped)


def _failure_code(status: int, message: str) -> str:
    if status == 0:  # WorkerResult's message: "unreachable: <exception>: ..."
        cause = message.removeprefix("unreachable:").strip().split(":", 1)[0]
        return "upstream_timeout" if "Timeout" in cause else "upstream_unreachable"
    if 200 <= status < 300:
        return "refused"  # the server said success: false, or it serves another version than the fleet's
    return "upstream_error"
