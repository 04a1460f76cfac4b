"""Worker registration: sgl-router's worker API (`/workers`, `/add_worker`, `/remove_worker`,
`/list_workers`) that RL frameworks use, and mini_lb's `/register` that servers started with `--pdlb-url`
call."""

from __future__ import annotations

import asyncio
from urllib.parse import unquote

from aiohttp import web

from router.api.bodies import read_json_object
from router.control.upstream import live_role_of
from router.core.config import DISCOVER, validate_port, validate_worker_url
from router.core.errors import BadRequest, Conflict, NotFound, json_response
from router.core.keys import DISCOVERY, REGISTRY, UPSTREAM
from router.core.registry import DuplicateWorker, Role, Worker, WorkerState

# How long an API registration waits to learn a prefill's bootstrap port before answering.
REGISTER_SETTLE_SECS = 5.0
BUSY_STATES = (WorkerState.DRAINING, WorkerState.ABORTING, WorkerState.CONVERTING, WorkerState.VERIFYING)


def parse_role(value: object, field: str = "worker_type") -> Role | None:
    if value is None:
        return None
    if value == "regular":
        raise BadRequest("pd-router routes prefill/decode pairs only: worker_type must be 'prefill' or 'decode'",
                         param=field)
    try:
        return Role(value)
    except ValueError:
        raise BadRequest(f"{field} must be 'prefill' or 'decode', got {value!r}", param=field) from None


def parse_port(value: object, field: str = "bootstrap_port") -> int | None:
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    elif isinstance(value, str) and value.lower() in ("none", "null", ""):
        value = None
    if (problem := validate_port(value, field)) is not None:
        raise BadRequest(problem, param=field)
    return value


def checked_url(value: object) -> str:
    if (problem := validate_worker_url(value)) is not None:
        raise BadRequest(problem, param="url")
    return value.rstrip("/")


async def register_worker(app: web.Application, url: str, role: Role | None, port) -> Worker:
    """Add a worker (role asked from the server when not given); prefill ports learnt when not given."""
    registry, upstream = app[REGISTRY], app[UPSTREAM]
    if registry.find(url) is not None:
        raise Conflict(f"worker {url} is already registered")
    if role is None:
        reply = await upstream.model_info(url, timeout=5)
        live = live_role_of(reply.data) if reply.ok else None
        if live not in ("prefill", "decode"):
            raise BadRequest(f"worker_type is required: {url} did not report a prefill or decode role",
                             param="worker_type")
        role = Role(live)
    try:
        if role is Role.PREFILL and port is DISCOVER:
            worker = registry.add(url, role, None, state=WorkerState.PENDING, reason="learning its bootstrap port")
            task = app[DISCOVERY].watch(worker)
            await asyncio.wait({task}, timeout=REGISTER_SETTLE_SECS)
        else:
            worker = registry.add(url, role, None if role is Role.DECODE or port is DISCOVER else port)
            app[DISCOVERY].spawn(app[DISCOVERY].learn(worker))
    except DuplicateWorker as exc:
        raise Conflict(str(exc)) from None
    return worker


def unregister_worker(app: web.Application, worker: Worker) -> None:
    if worker.state in BUSY_STATES:
        raise Conflict(f"worker {worker.url} is {worker.state}: wait for that operation to end")
    app[REGISTRY].remove(worker)


def find_worker(app: web.Application, key: str) -> Worker:
    worker = app[REGISTRY].find(unquote(key))
    if worker is None:
        raise NotFound(f"unknown worker {key!r}")
    return worker


def workers_listing(app: web.Application) -> dict:
    workers = app[REGISTRY].workers()
    return {
        "workers": [w.to_dict() for w in workers],
        "total": len(workers),
        "stats": {
            "prefill_count": sum(w.role is Role.PREFILL for w in workers),
            "decode_count": sum(w.role is Role.DECODE for w in workers),
            "regular_count": 0,
        },
    }


# ---- handlers -----------------------------------------------------------------------------------------
async def list_workers(request: web.Request) -> web.Response:
    return json_response(workers_listing(request.app))


async def get_worker(request: web.Request) -> web.Response:
    return json_response(find_worker(request.app, request.match_info["worker_id"]).to_dict())


async def add_worker_json(request: web.Request) -> web.Response:
    body = await read_json_object(request)
    url = checked_url(body.get("url"))
    role = parse_role(body.get("worker_type", body.get("role")))
    port = parse_port(body["bootstrap_port"]) if body.get("bootstrap_port") is not None else DISCOVER
    worker = await register_worker(request.app, url, role, port)
    return json_response({"success": True, "message": f"Successfully added worker: {url}",
                          "worker_id": worker.id, "url": url, "worker": worker.to_dict()})


async def delete_worker(request: web.Request) -> web.Response:
    worker = find_worker(request.app, request.match_info["worker_id"])
    unregister_worker(request.app, worker)
    return json_response({"success": True, "message": f"Successfully removed worker: {worker.url}",
                          "worker_id": worker.id, "url": worker.url})


async def add_worker_legacy(request: web.Request) -> web.Response:
    url = checked_url(request.query.get("url"))
    role = parse_role(request.query.get("worker_type", request.query.get("role")))
    port = parse_port(request.query["bootstrap_port"]) if "bootstrap_port" in request.query else DISCOVER
    worker = await register_worker(request.app, url, role, port)
    return json_response({"success": True, "message": f"Successfully added worker: {url}",
                          "worker_id": worker.id})


async def remove_worker_legacy(request: web.Request) -> web.Response:
    url = request.query.get("url")
    if not url:
        raise BadRequest("missing query parameter url", param="url")
    worker = find_worker(request.app, url)
    unregister_worker(request.app, worker)
    return json_response({"success": True, "message": f"Successfully removed worker: {worker.url}"})


async def list_workers_legacy(request: web.Request) -> web.Response:
    registry = request.app[REGISTRY]
    return json_response({
        "urls": [w.url for w in registry.workers()],
        "prefill": [w.url for w in registry.workers(Role.PREFILL)],
        "decode": [w.url for w in registry.workers(Role.DECODE)],
    })


async def register(request: web.Request) -> web.Response:
    """mini_lb's `/register`: {"mode", "registry_url", "bootstrap_port"}; prefill needs a port, decode none."""
    body = await read_json_object(request)
    mode = body.get("mode")
    if mode not in ("prefill", "decode"):
        raise BadRequest("Invalid mode. Must be either PREFILL or DECODE.", param="mode")
    url = checked_url(body.get("registry_url"))
    port = parse_port(body.get("bootstrap_port"))
    if mode == "prefill" and port is None:
        raise BadRequest("Bootstrap port is required for prefill server", param="bootstrap_port")
    if mode == "decode" and port is not None:
        raise BadRequest("Bootstrap port should not be set for decode server", param="bootstrap_port")
    role = Role(mode)
    registry = request.app[REGISTRY]
    existing = registry.find(url)
    if existing is not None:
        if existing.role is role:
            # A server that restarted re-registers: take its (possibly new) port.
            registry.update_info(existing, bootstrap_port=port)
            if existing.state is WorkerState.FAILED:
                registry.set_state(existing, WorkerState.ACTIVE, "re-registered")
            return json_response({"success": True, "message": f"{mode} server {url} re-registered"})
        unregister_worker(request.app, existing)
    await register_worker(request.app, url, role, port)
    return json_response({"success": True, "message": f"registered {mode} server {url}"})


def setup(app: web.Application) -> None:
    r = app.router
    r.add_get("/workers", list_workers)
    r.add_post("/workers", add_worker_json)
    r.add_get("/workers/{worker_id:.+}", get_worker)
    r.add_delete("/workers/{worker_id:.+}", delete_worker)
    r.add_post("/add_worker", add_worker_legacy)
    r.add_post("/remove_worker", remove_worker_legacy)
    r.add_get("/list_workers", list_workers_legacy)
    r.add_post("/register", register)
