"""SGLang's control endpoints, served by the router for the whole fleet (every P and D server).

Request bodies are SGLang 0.5.23's (`io_struct.py`), checked strictly (a JSON object, known fields, their
types) before anything reaches a server; the router adds a few fields of its own (`retry_aborted`, and
`abort_all_requests` on `release_memory_occupation`), which it strips before forwarding. Answers keep
SGLang's shape and add the fleet's detail: `{"success", "message", "num_paused_requests", "workers":
[{url, role, success, status, message, ...}]}`; 200 when every server succeeded, 400 when one refused,
502 when one did not answer, 504 when the fleet did not quiesce in time (then nothing was changed).
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

from aiohttp import web

from router.api.conversion import CONVERSIONS
from router.api.info import any_prefill_first
from router.api.workers import read_json_object
from router.core.errors import BadRequest, NotFound, ServiceUnavailable, json_response
from router.core.keys import CONFIG, METRICS, REGISTRY, TASKS, TRAFFIC, UPSTREAM, WEIGHTS
from router.flows.fleet import INFO_TIMEOUT, fleet_weight_version
from router.flows.weights import DISK, DISTRIBUTED, TENSOR, UPDATE_KINDS, VERSION, WeightFlow

PAUSE_MODES = ("abort", "retract", "in_place")
SELECTORS = ("target", "draft", "all")


# ---- body validation -----------------------------------------------------------------------------------
def _is_str(v: Any) -> bool:
    return isinstance(v, str)


def _is_bool(v: Any) -> bool:
    return isinstance(v, bool)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _optional(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: v is None or check(v)


def _list_of(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, list) and all(check(x) for x in v)


def _one_of(*values: str) -> Callable[[Any], bool]:
    return lambda v: v in values


# field -> (check, what it must be, required)
Schema = dict[str, tuple[Callable[[Any], bool], str, bool]]
STR = (_is_str, "a string", False)
OPT_STR = (_optional(_is_str), "a string or null", False)
BOOL = (_is_bool, "a boolean", False)
INT = (_is_int, "an integer", False)
SELECTOR = (_one_of(*SELECTORS), f"one of {', '.join(SELECTORS)}", False)
TAGS = (_optional(_list_of(_is_str)), "a list of strings or null", False)
ROUTER_FIELDS: Schema = {"retry_aborted": BOOL}

SCHEMAS: dict[str, Schema] = {
    DISK: {"model_path": (_is_str, "a string", True), "load_format": OPT_STR, "abort_all_requests": BOOL,
           "weight_version": OPT_STR, "is_async": BOOL, "torch_empty_cache": BOOL, "keep_pause": BOOL,
           "recapture_cuda_graph": BOOL, "token_step": INT, "flush_cache": BOOL,
           "manifest": (_optional(lambda v: isinstance(v, dict)), "an object or null", False)},
    DISTRIBUTED: {"names": (_list_of(_is_str), "a list of strings", True),
                  "dtypes": (_list_of(_is_str), "a list of strings", True),
                  "shapes": (_list_of(_list_of(_is_int)), "a list of lists of integers", True),
                  "group_name": STR, "flush_cache": BOOL, "abort_all_requests": BOOL, "weight_version": OPT_STR,
                  "load_format": OPT_STR, "selector": SELECTOR, "torch_empty_cache": BOOL},
    TENSOR: {"serialized_named_tensors": (_list_of(_is_str), "a list of base64 strings", True),
             "load_format": OPT_STR, "flush_cache": BOOL, "abort_all_requests": BOOL, "weight_version": OPT_STR,
             "selector": SELECTOR, "torch_empty_cache": BOOL},
    VERSION: {"new_version": (_is_str, "a string", True), "abort_all_requests": BOOL},
    "init_weights_update_group": {"master_address": (_is_str, "a string", True),
                                  "master_port": (_is_int, "an integer", True),
                                  "rank_offset": (_is_int, "an integer", True),
                                  "world_size": (_is_int, "an integer", True),
                                  "group_name": STR, "backend": STR},
    "destroy_weights_update_group": {"group_name": STR},
    "begin_weight_update": {"selector": SELECTOR},
    "end_weight_update": {},
    "pause_generation": {"mode": (_one_of(*PAUSE_MODES), f"one of {', '.join(PAUSE_MODES)}", False)},
    "continue_generation": {"torch_empty_cache": BOOL},
    "release_memory_occupation": {"tags": TAGS, "abort_all_requests": BOOL},
    "resume_memory_occupation": {"tags": TAGS},
    "abort_request": {"rid": STR, "abort_all": BOOL},
    "weight_updates/rejoin": {},
}
# Fields the router reads itself and does not forward, per endpoint.
OWN_FIELDS = {"release_memory_occupation": ("abort_all_requests",)}
RETRY_ENDPOINTS = frozenset({DISK, DISTRIBUTED, TENSOR, VERSION, "pause_generation", "release_memory_occupation"})


def validate(name: str, body: dict) -> tuple[dict, dict]:
    """Check a body against the endpoint's schema; return (what to forward, the router's own fields)."""
    schema = SCHEMAS[name]
    allowed = {**schema, **(ROUTER_FIELDS if name in RETRY_ENDPOINTS else {})}
    problems = []
    unknown = sorted(set(body) - set(allowed))
    if unknown:
        problems.append(f"unknown field(s) {', '.join(unknown)} (known: {', '.join(sorted(allowed)) or 'none'})")
    for key, (check, what, required) in allowed.items():
        if key not in body:
            if required:
                problems.append(f"{key} is required")
        elif not check(body[key]):
            problems.append(f"{key} must be {what}, got {body[key]!r}"[:300])
    if problems:
        raise BadRequest(f"invalid {name} request: " + "; ".join(problems),
                         param=unknown[0] if unknown else None)
    own_keys = set(ROUTER_FIELDS) | set(OWN_FIELDS.get(name, ()))
    forwarded = {k: v for k, v in body.items() if k not in own_keys}
    own = {k: v for k, v in body.items() if k in own_keys}
    return forwarded, own


async def _body(request: web.Request, name: str) -> tuple[dict, dict]:
    return validate(name, await read_json_object(request))


def _flow(request: web.Request) -> WeightFlow:
    return request.app[WEIGHTS]


def _retry(request: web.Request, own: dict) -> bool:
    return own.get("retry_aborted", request.app[CONFIG].weight_update_retry_aborted)


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
    body, _ = await _body(request, "abort_request")
    abort_all = body.get("abort_all", False)
    rid = body.get("rid")
    if not abort_all and not rid:
        raise BadRequest("abort_request needs a non-empty rid or abort_all: true", param="rid")
    return _answer(await _flow(request).abort(rid=rid, abort_all=abort_all))


async def pause_generation(request: web.Request) -> web.Response:
    body, own = await _body(request, "pause_generation")
    return _answer(await _flow(request).pause(body, retry=_retry(request, own)))


async def continue_generation(request: web.Request) -> web.Response:
    body, _ = await _body(request, "continue_generation")
    return _answer(await _flow(request).resume(body))


def _update_handler(kind: str):
    default_abort = kind == VERSION  # SGLang's default: only a version relabel aborts unless told

    async def handler(request: web.Request) -> web.Response:
        body, own = await _body(request, kind)
        abort = body.get("abort_all_requests", default_abort)
        return _answer(await _flow(request).update(kind, body, abort=abort, retry=_retry(request, own)))

    handler.__name__ = kind
    return handler


async def init_weights_update_group(request: web.Request) -> web.Response:
    """Every server joins the trainer's group with ranks of its own: the router gives each server the next
    `tp_size` ranks from `rank_offset` (a body copied to all would give them all the same ranks)."""
    body, _ = await _body(request, "init_weights_update_group")
    flow, upstream = _flow(request), request.app[UPSTREAM]
    workers = flow.targets()
    if not workers:
        raise ServiceUnavailable("there is no server")
    infos = await asyncio.gather(*(upstream.server_info(w.url, timeout=INFO_TIMEOUT) for w in workers))
    offsets, tp_sizes, rank = {}, {}, body["rank_offset"]
    for worker, info in zip(workers, infos):
        tp = info.data.get("tp_size") if info.ok and isinstance(info.data, dict) else None
        tp_sizes[worker.id] = tp if _is_int(tp) and tp > 0 else 1
        offsets[worker.id] = rank
        rank += tp_sizes[worker.id]
    if rank > body["world_size"]:
        raise BadRequest(f"world_size {body['world_size']} is too small: the fleet's {len(workers)} servers take "
                         f"ranks {body['rank_offset']}..{rank - 1} (tp sizes "
                         f"{[tp_sizes[w.id] for w in workers]})", param="world_size", ranks_needed=rank)
    status, answer = await flow.broadcast("/init_weights_update_group", body, workers=workers,
                                          per_worker=lambda w: {**body, "rank_offset": offsets[w.id]})
    by_url = {w.url: w.id for w in workers}
    for row in answer["workers"]:
        row["rank_offset"] = offsets[by_url[row["url"]]]
        row["tp_size"] = tp_sizes[by_url[row["url"]]]
    answer["ranks_used"] = rank
    return _answer((status, answer))


def _broadcast_handler(name: str):
    async def handler(request: web.Request) -> web.Response:
        body, _ = await _body(request, name)
        return _answer(await _flow(request).broadcast("/" + name, body))

    handler.__name__ = name
    return handler


async def release_memory_occupation(request: web.Request) -> web.Response:
    body, own = await _body(request, "release_memory_occupation")
    return _answer(await _flow(request).release_memory(body, abort=own.get("abort_all_requests", False),
                                                       retry=_retry(request, own)))


async def resume_memory_occupation(request: web.Request) -> web.Response:
    body, _ = await _body(request, "resume_memory_occupation")
    return _answer(await _flow(request).resume_memory(body))


async def get_weight_version(request: web.Request) -> web.Response:
    flow = _flow(request)
    fleet = await flow.fleet_version_now()
    return json_response({**fleet.to_dict(), "fleet_weight_version": flow.fleet_version})


async def model_info(request: web.Request) -> web.Response:
    """One server's model info, with the weight version the fleet serves now (0.5.23's `/model_info` can
    lag it), or null and each server's version when they disagree."""
    registry, upstream = request.app[REGISTRY], request.app[UPSTREAM]
    data, last = None, None
    for worker in any_prefill_first(registry):
        reply = await upstream.model_info(worker.url, timeout=INFO_TIMEOUT)
        if reply.ok and isinstance(reply.data, dict):
            data = reply.data
            break
        last = reply
    if data is None:
        raise ServiceUnavailable("There is no server registered" if last is None
                                 else f"no worker answered: {last.message()}")
    fleet = await fleet_weight_version(registry, upstream, _flow(request).targets())
    data["weight_version"] = fleet.version
    if not fleet.consistent:
        data["weight_versions"] = fleet.workers
    return json_response(data)


async def weight_updates(request: web.Request) -> web.Response:
    return json_response(_flow(request).state())


async def weight_update(request: web.Request) -> web.Response:
    op = _flow(request).find(request.match_info["op_id"])
    if op is None:
        raise NotFound(f"no fleet operation {request.match_info['op_id']!r} (the last 50 are kept)")
    return json_response(op.to_dict())


async def rejoin(request: web.Request) -> web.Response:
    """Check now the servers left out for their weights (and active ones with another version)."""
    await _body(request, "weight_updates/rejoin")
    return json_response(await _flow(request).reconcile())


# ---- wiring --------------------------------------------------------------------------------------------
async def _weights_ctx(app: web.Application):
    flow = WeightFlow(app[CONFIG], app[REGISTRY], app[UPSTREAM], app[TRAFFIC], app[TASKS].spawn)
    app[WEIGHTS] = flow
    if CONVERSIONS in app:
        flow.conversions_running = app[CONVERSIONS].running
    if METRICS in app:
        flow.observers.append(_metrics_observer(app[METRICS]))
    flow.start()
    yield
    await flow.close()


def _metrics_observer(metrics) -> Callable:
    def observe(op) -> None:
        if op.kind in UPDATE_KINDS:
            metrics.observe_weight_update(op.state, op.duration_s or 0.0)
        metrics.observe_abort(op.kind, op.aborted_requests)

    return observe


def setup(app: web.Application) -> None:
    app.cleanup_ctx.append(_weights_ctx)
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
    r.add_get("/model_info", model_info)
    r.add_get("/get_model_info", model_info)
    r.add_get("/weight_updates", weight_updates)
    r.add_get("/weight_updates/{op_id}", weight_update)
    r.add_post("/weight_updates/rejoin", rejoin)
