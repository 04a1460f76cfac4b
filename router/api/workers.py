"""Worker registration: sgl-router's worker API (`/workers`, `/add_worker`, `/remove_worker`,
`/list_workers`) that RL frameworks use, and mini_lb's `/register` that servers started with `--pdlb-url`
call. The bodies are read here; what registering and removing do is the worker lifecycle's
(`flows/worker_lifecycle.py`), the same for the worker sources and the health checker."""

from __future__ import annotations

from urllib.parse import unquote

from aiohttp import web

from router.api.bodies import read_json_object
from router.control.worker_sources import WORKER_SOURCES
from router.core.config import DISCOVER
from router.core.errors import BadRequest, NotFound, json_response
from router.core.keys import REGISTRY
from router.core.registry import Role, Worker
from router.core.worker_entry import REGISTER_FIELDS, WorkerEntry, WorkerEntryError, parse_worker_entry
from router.flows.worker_lifecycle import WORKER_LIFECYCLE



def entry_of(data: dict, *, names: dict[str, str] | None = None) -> WorkerEntry:
    """The worker-entry body (core/worker_entry.py: the one model of every way a worker gets in), or 400
    naming every problem (unknown fields first)."""
    try:
        return parse_worker_entry(data, names=names)
    except WorkerEntryError as exc:
        raise BadRequest("; ".join(exc.problems), param=exc.param, problems=exc.problems) from None


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
    entry = entry_of(await read_json_object(request))
    worker = await request.app[WORKER_LIFECYCLE].register(
        entry.address, entry.given_role, entry.bootstrap_port_of(null_means=DISCOVER), source="POST /workers",
        settings=entry.settings)
    body = {"success": True, "message": f"Successfully added worker: {worker.url}", "worker_id": worker.id,
            "url": worker.url, "worker": worker.to_dict()}
    if entry.ignored:  # the peers' fields that mean nothing to pd-router's pools (docs/guides/workers.md: Worker entries)
        body["ignored_fields"] = list(entry.ignored)
    return json_response(body)


async def delete_worker(request: web.Request) -> web.Response:
    worker = find_worker(request.app, request.match_info["worker_id"])
    await request.app[WORKER_LIFECYCLE].unregister(worker, by="DELETE /workers")
    return json_response({"success": True, "message": f"Successfully removed worker: {worker.url}",
                          "worker_id": worker.id, "url": worker.url})


async def add_worker_legacy(request: web.Request) -> web.Response:
    entry = entry_of(dict(request.query))  # the body's fields as query parameters
    worker = await request.app[WORKER_LIFECYCLE].register(
        entry.address, entry.given_role, entry.bootstrap_port_of(null_means=None), source="POST /add_worker")
    return json_response({"success": True, "message": f"Successfully added worker: {worker.url}",
                          "worker_id": worker.id})


async def remove_worker_legacy(request: web.Request) -> web.Response:
    url = request.query.get("url")
    if not url:
        raise BadRequest("missing query parameter url", param="url")
    worker = find_worker(request.app, url)
    await request.app[WORKER_LIFECYCLE].unregister(worker, by="POST /remove_worker")
    return json_response({"success": True, "message": f"Successfully removed worker: {worker.url}"})


async def discovery_sources(request: web.Request) -> web.Response:
    """The worker sources (--discovery-file): what each lists, what it registered, what waits and why."""
    return json_response(request.app[WORKER_SOURCES].to_dict())


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
    entry = entry_of(body, names=REGISTER_FIELDS)
    url, port = entry.address, entry.bootstrap_port_of(null_means=None)
    if port is DISCOVER:  # mini_lb's body always has the field (null for a decode)
        port = None
    if mode == "prefill" and port is None:
        raise BadRequest("Bootstrap port is required for prefill server", param="bootstrap_port")
    if mode == "decode" and port is not None:
        raise BadRequest("Bootstrap port should not be set for decode server", param="bootstrap_port")
    role = Role(mode)
    lifecycle = request.app[WORKER_LIFECYCLE]
    await lifecycle.check_allowed(url)  # a re-registration too: it may change the worker's port
    existing = request.app[REGISTRY].find(url)
    if existing is not None:
        await lifecycle.reregister(existing, role, port)
        return json_response({"success": True, "message": f"{mode} server {existing.url} re-registered"})
    worker = await lifecycle.register(url, role, port, source=f"POST /register mode={mode}")
    return json_response({"success": True, "message": f"registered {mode} server {worker.url}"})


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
    r.add_get("/admin/discovery", discovery_sources)
