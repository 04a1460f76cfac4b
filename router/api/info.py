"""mini_lb's informational and fleet endpoints: health, info, models, cache flush — done concurrently and
with the servers' statuses taken into account (mini_lb ignores them)."""

from __future__ import annotations

from typing import Iterable
from urllib.parse import urlencode

from aiohttp import web

from router.api.shared_answers import SHARED_ANSWERS
from router.control.upstream import Reply, fan_out
from router.core.errors import BadRequest, ServiceUnavailable, json_response
from router.control.upstream import ADMIN_TIMEOUT, UPSTREAM
from router.core.keys import LIFECYCLE, REGISTRY, TRAFFIC
from router.core.redact import redact
from router.core.registry import Registry, Role, Worker, WorkerState
from router.core.router_identity import MARKER_FIELD, marker

# How long the public info routes reuse an answer (any registry change drops it sooner).
INFO_ANSWER_TTL = 1.0
# The routes answered once for concurrent callers (api/shared_answers.py), by name, and how long an answer is
# reused: the info routes' (/model_info is api/control.py's), and /health_generate's, fresh each time.
SHARED_ROUTES = {"health_generate": 0.0, "server_info": INFO_ANSWER_TTL, "model_info": INFO_ANSWER_TTL,
                 "models": INFO_ANSWER_TTL}


def worker_outcomes(results: Iterable[tuple[Worker, Reply]]) -> list[dict]:
    return [{"url": w.url, "role": w.role.value, "success": r.success(), "status": r.status,
             "message": r.message()} for w, r in results]


def reachable_workers(registry: Registry) -> list[Worker]:
    """Workers that exist as servers: everything but failed ones (pending ones may be down)."""
    return [w for w in registry.workers() if w.state is not WorkerState.FAILED]


def any_prefill_first(registry: Registry) -> list[Worker]:
    order = list(registry.routable(Role.PREFILL)) + list(registry.routable(Role.DECODE))
    order += [w for w in registry.workers() if w not in order and w.state is not WorkerState.FAILED]
    return order


async def health(request: web.Request) -> web.Response:
    registry = request.app[REGISTRY]
    pools = {}
    for role in Role:
        members = registry.workers(role)
        pools[role.value] = {"routable": len(registry.routable(role)), "total": len(members),
                             "unhealthy": sum(not w.healthy for w in members),
                             "breaker_open": sum(w.breaker == "open" for w in members)}
    ready = all(p["routable"] > 0 for p in pools.values())
    admission = request.app[TRAFFIC].admission_state()
    body = {"status": "ok" if ready else "unavailable", "pools": pools,
            "admission": {"in_flight": admission["active"], "queued": admission["waiting"],
                          "held": not admission["open"]}}
    lifecycle = request.app[LIFECYCLE]
    if lifecycle.shutting_down:  # a balancer stops sending here; keep-alive connections still get an answer
        body.update(status="shutting down", shutdown=lifecycle.to_dict(), message=lifecycle.refusal())
        return json_response(body, status=503)
    if not ready:
        empty = [name for name, p in pools.items() if p["routable"] == 0]
        body["message"] = f"no routable worker in pool(s): {', '.join(empty)}"
    return json_response(body, status=200 if ready else 503)


async def health_generate(app: web.Application) -> tuple[dict, int]:
    registry, upstream = app[REGISTRY], app[UPSTREAM]
    workers = [w for w in registry.workers() if w.routable]
    if not workers:
        raise ServiceUnavailable("no routable worker")
    replies = await fan_out(workers, lambda w: upstream.get(w.url, "/health_generate", timeout=ADMIN_TIMEOUT))
    outcomes = worker_outcomes(zip(workers, replies))
    roles_ok = {role: any(o["success"] for o in outcomes if o["role"] == role.value) for role in Role}
    ok = all(roles_ok.values()) and all(o["success"] for o in outcomes)
    return {"success": ok, "workers": outcomes}, 200 if ok else 503


def flush_timeout(request: web.Request) -> str:
    """The `?timeout=` to relay: SGLang 0.5.23 takes seconds >= 0 (`Query(0.0, ge=0.0)`) and answers anything
    else 422; checked here, so that a bad value is the client's 400 with an `error` object, not every worker's
    422 relayed as a failed flush. Encoded again: the decoded value is relayed as one parameter."""
    if "timeout" not in request.query:
        return ""
    raw = request.query["timeout"]
    try:
        seconds = float(raw)
    except ValueError:
        seconds = float("nan")
    if not seconds >= 0:  # NaN too
        raise BadRequest(f"timeout must be a number of seconds >= 0, got {raw!r}", param="timeout")
    return "?" + urlencode({"timeout": raw})


async def flush_cache(request: web.Request) -> web.Response:
    registry, upstream = request.app[REGISTRY], request.app[UPSTREAM]
    query = flush_timeout(request)
    workers = reachable_workers(registry)
    replies = await fan_out(workers, lambda w: upstream.post(w.url, "/flush_cache" + query, timeout=ADMIN_TIMEOUT))
    outcomes = worker_outcomes(zip(workers, replies))
    ok = all(o["success"] for o in outcomes)
    failed = [o["url"] for o in outcomes if not o["success"]]
    message = "Cache flushed on every worker." if ok else f"Flush cache failed on {', '.join(failed)}."
    return json_response({"success": ok, "message": message, "workers": outcomes}, status=200 if ok else 400)


async def server_info(app: web.Application) -> tuple[dict, int]:
    registry, upstream = app[REGISTRY], app[UPSTREAM]
    workers = reachable_workers(registry)
    results = list(zip(workers, await fan_out(workers, lambda w: upstream.server_info(w.url, timeout=ADMIN_TIMEOUT))))
    prefill = [redact(r.data) for w, r in results if w.role is Role.PREFILL and r.ok]
    decode = [redact(r.data) for w, r in results if w.role is Role.DECODE and r.ok]
    states = [s for d in decode if isinstance(d, dict) for s in (d.get("internal_states") or [])]
    if not states:  # what bench_one_batch_server.py expects when decode says nothing
        states = [{"last_gen_throughput": 0.0, "avg_spec_accept_length": None}]
    # `pd_router`: what tells a pd-router from a SGLang server (core/router_identity.py)
    return {"internal_states": states, "prefill": prefill, "decode": decode, MARKER_FIELD: marker()}, 200


async def models(app: web.Application) -> tuple[dict, int]:
    """The first worker's answer (prefill first)."""
    registry, upstream = app[REGISTRY], app[UPSTREAM]
    last: Reply | None = None
    for worker in any_prefill_first(registry):
        reply = await upstream.get(worker.url, "/v1/models", timeout=ADMIN_TIMEOUT)
        if reply.ok:
            return redact(reply.data), 200
        last = reply
    if last is None:
        raise ServiceUnavailable("There is no server registered")
    raise ServiceUnavailable(f"no worker answered: {last.message()}")


def shared_handler(name: str, produce):
    """A GET handler answering `produce(app)`'s (body, status), computed once for concurrent callers (and
    reused for the time SHARED_ROUTES gives `name`): see shared_answers."""

    async def handler(request: web.Request) -> web.Response:
        app = request.app
        body, status = await app[SHARED_ANSWERS][name].get(lambda: produce(app))
        return json_response(body, status=status)

    handler.__name__ = name
    return handler


def setup(app: web.Application) -> None:
    r = app.router
    r.add_get("/health", health)
    r.add_get("/health_generate", shared_handler("health_generate", health_generate))
    r.add_route("POST", "/flush_cache", flush_cache)
    r.add_route("GET", "/flush_cache", flush_cache)
    info = shared_handler("server_info", server_info)
    r.add_get("/get_server_info", info)
    r.add_get("/server_info", info)
    # /model_info and /get_model_info: api_control (with the fleet's live weight version)
    r.add_get("/v1/models", shared_handler("models", models))
