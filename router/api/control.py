"""SGLang's control endpoints, served by the router for the whole fleet (every P and D server).

Request bodies are SGLang 0.5.23's (`io_struct.py`), declared in `control_bodies.py` and checked strictly (a
JSON object, known fields, their types) before anything reaches a server; the router adds a few fields of its
own (`retry_aborted`, and `abort_all_requests` on `release_memory_occupation`), which it strips before
forwarding. Answers keep SGLang's shape and add the fleet's detail: `{"success", "message",
"num_paused_requests", "workers": [{url, role, success, status, message, ...}]}`; 200 when every server
succeeded, 400 when one refused, 502 when one did not answer, 504 when the fleet did not quiesce in time (then
nothing was changed).
"""

from __future__ import annotations

import asyncio
from aiohttp import web

from router.api.bodies import Empty, read_body
from router.api.control_bodies import (BROADCAST_BODIES, UPDATE_BODIES, AbortRequest, ContinueGeneration,
                                       InitUpdateGroup, PauseGeneration, ReleaseMemory, Retryable, ResumeMemory)
from router.api.info import any_prefill_first, shared_handler
from router.core.errors import BadRequest, NotFound, ServiceUnavailable, json_response
from router.control.upstream import INFO_TIMEOUT, UPSTREAM
from router.core.keys import CONFIG, REGISTRY
from router.core.redact import redact
from router.core.router_identity import MARKER_FIELD, marker
from router.flows.fleet import read_fleet_weight_version
from router.flows.fleet_control import FLEET_CONTROL, FleetControl
from router.flows.memory import MEMORY
from router.flows.pauses import PAUSES
from router.flows.request_aborts import ABORTS
from router.flows.weight_updates import DISK, DISTRIBUTED, TENSOR, UPDATES, VERSION


def _fleet(request: web.Request) -> FleetControl:
    return request.app[FLEET_CONTROL]


def _retry(request: web.Request, body: Retryable) -> bool:
    return body.retry(request.app[CONFIG].weight_update_retry_aborted)


def _answer(result: tuple[int, dict | None]) -> web.Response:
    """SGLang's answer shape; a failure also carries the router's `error` object, like every other 4xx/5xx."""
    status, body = result
    if body is None:
        return web.Response(status=status)
    if status >= 400 and "error" not in body:
        kind = {400: "refused", 502: "upstream_error", 504: "timeout"}.get(status, "upstream_error")
        body["error"] = {"message": body.get("message") or "failed", "type": kind, "code": status}
    return json_response(body, status=status)


# ---- handlers ------------------------------------------------------------------------------------------
async def abort_request(request: web.Request) -> web.Response:
    body = await read_body(request, AbortRequest, "abort_request")
    if not body.abort_all and not body.rid:
        raise BadRequest("abort_request needs a non-empty rid or abort_all: true", param="rid")
    return _answer(await request.app[ABORTS].abort(rid=body.rid, abort_all=body.abort_all))


async def pause_generation(request: web.Request) -> web.Response:
    body = await read_body(request, PauseGeneration, "pause_generation")
    return _answer(await request.app[PAUSES].pause(body.forwarded(), retry=_retry(request, body)))


async def continue_generation(request: web.Request) -> web.Response:
    body = await read_body(request, ContinueGeneration, "continue_generation")
    return _answer(await request.app[PAUSES].resume(body.forwarded()))


def _update_handler(kind: str):
    model = UPDATE_BODIES[kind]

    async def handler(request: web.Request) -> web.Response:
        body = await read_body(request, model, kind)
        return _answer(await request.app[UPDATES].update(kind, body.forwarded(), abort=body.abort_all_requests,
                                                   retry=_retry(request, body)))

    handler.__name__ = kind
    return handler


async def init_weights_update_group(request: web.Request) -> web.Response:
    body = await read_body(request, InitUpdateGroup, "init_weights_update_group")
    return _answer(await init_update_group(request.app, body))


async def init_update_group(app: web.Application, body: InitUpdateGroup) -> tuple[int, dict]:
    """Every server joins the trainer's group with ranks of its own: the router gives each server the next
    `tp_size` ranks from `rank_offset` (a body copied to all would give them all the same ranks)."""
    updates, upstream = app[UPDATES], app[UPSTREAM]
    workers = app[FLEET_CONTROL].targets()
    if not workers:
        raise ServiceUnavailable("there is no server")
    infos = await asyncio.gather(*(upstream.server_info(w.url, timeout=INFO_TIMEOUT) for w in workers))
    offsets, tp_sizes, rank = {}, {}, body.rank_offset
    for worker, info in zip(workers, infos):
        tp = info.data.get("tp_size") if info.ok and isinstance(info.data, dict) else None
        tp_sizes[worker.id] = tp if isinstance(tp, int) and not isinstance(tp, bool) and tp > 0 else 1
        offsets[worker.id] = rank
        rank += tp_sizes[worker.id]
    if rank > body.world_size:
        raise BadRequest(f"world_size {body.world_size} is too small: the fleet's {len(workers)} servers take "
                         f"ranks {body.rank_offset}..{rank - 1} (tp sizes "
                         f"{[tp_sizes[w.id] for w in workers]})", param="world_size", ranks_needed=rank)
    forwarded = body.forwarded()
    status, answer = await updates.broadcast("/init_weights_update_group", forwarded, workers=workers,
                                          per_worker=lambda w: {**forwarded, "rank_offset": offsets[w.id]})
    by_url = {w.url: w.id for w in workers}
    for row in answer["workers"]:
        row["rank_offset"] = offsets[by_url[row["url"]]]
        row["tp_size"] = tp_sizes[by_url[row["url"]]]
    answer["ranks_used"] = rank
    return status, answer


def _broadcast_handler(name: str):
    model = BROADCAST_BODIES[name]

    async def handler(request: web.Request) -> web.Response:
        body = await read_body(request, model, name)
        return _answer(await request.app[UPDATES].broadcast("/" + name, body.forwarded()))

    handler.__name__ = name
    return handler


async def release_memory_occupation(request: web.Request) -> web.Response:
    body = await read_body(request, ReleaseMemory, "release_memory_occupation")
    return _answer(await request.app[MEMORY].release_memory(body.forwarded(), abort=body.abort_all_requests,
                                                       retry=_retry(request, body)))


async def resume_memory_occupation(request: web.Request) -> web.Response:
    body = await read_body(request, ResumeMemory, "resume_memory_occupation")
    return _answer(await request.app[MEMORY].resume_memory(body.forwarded()))


async def get_weight_version(request: web.Request) -> web.Response:
    control = _fleet(request)
    fleet = await control.fleet_version_now()
    return json_response({**fleet.to_dict(), "fleet_weight_version": control.fleet_version})


async def model_info(app: web.Application) -> tuple[dict, int]:
    """One server's model info, with the weight version the fleet serves now (0.5.23's `/model_info` can
    lag it), or null and each server's version when they disagree."""
    registry, upstream = app[REGISTRY], app[UPSTREAM]
    data, last = None, None
    for worker in any_prefill_first(registry):
        reply = await upstream.model_info(worker.url, timeout=INFO_TIMEOUT)
        if reply.ok and isinstance(reply.data, dict):
            data = redact(reply.data)
            break
        last = reply
    if data is None:
        raise ServiceUnavailable("There is no server registered" if last is None
                                 else f"no worker answered: {last.message()}")
    fleet = await read_fleet_weight_version(registry, upstream, app[FLEET_CONTROL].targets())
    data["weight_version"] = fleet.version
    if not fleet.consistent:
        data["weight_versions"] = fleet.workers
    data[MARKER_FIELD] = marker()  # what tells a pd-router from a SGLang server (core/router_identity.py)
    return data, 200


async def weight_updates(request: web.Request) -> web.Response:
    return json_response(_fleet(request).state())


async def weight_update(request: web.Request) -> web.Response:
    op = _fleet(request).find(request.match_info["op_id"])
    if op is None:
        raise NotFound(f"no fleet operation {request.match_info['op_id']!r} (the last 50 are kept)")
    return json_response(op.to_dict())


async def rejoin(request: web.Request) -> web.Response:
    """Check now the servers left out for their weights (and active ones with another version)."""
    await read_body(request, Empty, "weight_updates/rejoin")
    return json_response(await _fleet(request).reconcile())


# ---- routes --------------------------------------------------------------------------------------------
def setup(app: web.Application) -> None:
    r = app.router
    r.add_post("/abort_request", abort_request)
    r.add_post("/pause_generation", pause_generation)
    r.add_post("/continue_generation", continue_generation)
    for kind in (DISK, DISTRIBUTED, TENSOR, VERSION):
        r.add_post("/" + kind, _update_handler(kind))
    r.add_post("/init_weights_update_group", init_weights_update_group)
    for name in ("destroy_weights_update_group", "begin_weight_update", "end_weight_update"):
        r.add_post("/" + name, _broadcast_handler(name))
    for method in ("GET", "POST"):  # SGLang takes both
        r.add_route(method, "/release_memory_occupation", release_memory_occupation)
        r.add_route(method, "/resume_memory_occupation", resume_memory_occupation)
    r.add_get("/get_weight_version", get_weight_version)
    r.add_get("/weight_version", get_weight_version)
    info = shared_handler("model_info", model_info)
    r.add_get("/model_info", info)
    r.add_get("/get_model_info", info)
    r.add_get("/weight_updates", weight_updates)
    r.add_get("/weight_updates/{op_id}", weight_update)
    r.add_post("/weight_updates/rejoin", rejoin)
