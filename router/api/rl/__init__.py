"""SMG's RL control plane (`/v1/rl/*`), wire-compatible with the `smg.rl` client of smg 1.13.0.

    GET       /v1/rl/workers                         discovery rows (workers.py)
    GET       /v1/rl/workers/{id}                    one row; 404 worker_not_found
    GET|POST  /v1/rl/workers/{id}/engine/{path}      one server's answer in SMG's call envelope (relay.py)
    GET|POST  /v1/rl/engine/{path}?selector=...      every selected server (selector.py): fleet operations
                                                     through the router's flows (fleet_fanouts.py), the rest relayed

The routes are admin routes (access.py: not public, not generation), so `smg.rl.RL(url, api_key=...)`'s
Bearer key is the router's admin key. Errors are the router's error object with SMG's error code as
`error.type` (`worker_not_found`, `selector_required`, `invalid_selector`, `no_workers_match`,
`invalid_engine_path`, `unknown_engine_path`, `partial_fleet`, `fleet_operation`, `upstream_unreachable`,
`upstream_timeout`, `fleet_operation_failed`). SMG's `--enable-rl` is accepted and changes nothing: these
routes are always served.
"""

from __future__ import annotations

from aiohttp import web

from router.api.access import JSON_BODY
from router.api.rl import fleet_fanouts
from router.api.rl.engine_relay import (FLEET_ONLY_PATHS, RELAY, engine_path, forwarded_headers, query_without_selector,
                                 rl_error)
from router.api.rl.selector import SelectorError, parse
from router.api.rl.worker_rows import FACTS, PROTOCOL_VERSION, row_of, selector_keys, sorted_by_url
from router.core.errors import json_response
from router.core.keys import REGISTRY
from router.core.registry import Worker

FANOUT_PREFIX = "/v1/rl/engine/"
# Its own route, so the access middleware bounds its body by --max-payload-size as on /update_weights_from_tensor
# (serialized tensors), not by the admin bound.
TENSOR_FANOUT = FANOUT_PREFIX + "update_weights_from_tensor"


def _worker(request: web.Request) -> Worker:
    worker_id = request.match_info["worker_id"]
    worker = request.app[REGISTRY].find(worker_id)
    if worker is None:
        raise rl_error(404, "worker_not_found", f"no worker {worker_id!r} (GET /v1/rl/workers lists them)",
                       id=worker_id)
    return worker


async def list_workers(request: web.Request) -> web.Response:
    workers = sorted_by_url(request.app[REGISTRY].workers())
    facts = await request.app[FACTS].of(workers)
    rows = [row_of(w, facts[w.id]) for w in workers]
    return json_response({"protocol_version": PROTOCOL_VERSION, "workers": rows, "total": len(rows)})


async def get_worker(request: web.Request) -> web.Response:
    worker = _worker(request)
    facts = await request.app[FACTS].of([worker])
    return json_response(row_of(worker, facts[worker.id]))


async def worker_engine(request: web.Request) -> web.Response:
    """One engine call on one server; the answer's status is the engine's."""
    worker = _worker(request)
    path = engine_path(request.match_info["path"])
    if path in FLEET_ONLY_PATHS:
        raise rl_error(409, "fleet_operation",
                       f"{path} changes what a server serves: pd-router runs it for the whole fleet (hold, "
                       f"quiesce, verify, release), never on one server of a P/D fleet. Fan it out instead: "
                       f"POST /v1/rl/engine/{path}?selector=engine%3Dsglang", worker_id=worker.id, path=path)
    query = f"?{request.rel_url.raw_query_string}" if request.rel_url.raw_query_string else ""
    status, envelope = await request.app[RELAY].one(worker, request.method, path + query, request.get(JSON_BODY),
                                                   forwarded_headers(request))
    return json_response(envelope, status=status)


async def engine_fanout(request: web.Request) -> web.Response:
    path = engine_path(request.match_info.get("path") or request.path.removeprefix(FANOUT_PREFIX))
    text = request.query.get("selector", "").strip()
    if not text:
        raise rl_error(400, "selector_required", "a fan-out needs ?selector=... (for the whole fleet: "
                                                 "selector=engine%3Dsglang)")
    try:
        selector = parse(text)
    except SelectorError as exc:
        raise rl_error(400, "invalid_selector", f"invalid selector {text!r}: {exc}", offset=exc.offset) from None
    workers = sorted_by_url(request.app[REGISTRY].workers())
    facts = await request.app[FACTS].of(workers)
    targets = [w for w in workers if selector.matches(selector_keys(w, facts[w.id]))]
    if not targets:
        raise rl_error(400, "no_workers_match", f"no worker matches the selector {text!r} (GET /v1/rl/workers "
                                                "lists the workers and their labels)", selector=text)
    body = request.get(JSON_BODY)
    if fleet_fanouts.is_fleet_operation(request.method, path):
        status, answer = await fleet_fanouts.run(request.app, path, targets, text, body or {})
    else:
        status, answer = await request.app[RELAY].many(targets, request.method, path + query_without_selector(request),
                                                       body, forwarded_headers(request))
    return json_response(answer, status=status)


def setup(app: web.Application) -> None:
    r = app.router
    r.add_get("/v1/rl/workers", list_workers)
    r.add_get("/v1/rl/workers/{worker_id}", get_worker)
    r.add_post(TENSOR_FANOUT, engine_fanout)
    for method in ("GET", "POST"):
        r.add_route(method, "/v1/rl/workers/{worker_id}/engine/{path:.+}", worker_engine)
        r.add_route(method, "/v1/rl/engine/{path:.+}", engine_fanout)
