"""Worker registration: sgl-router's worker API (`/workers`, `/add_worker`, `/remove_worker`,
`/list_workers`) that RL frameworks use, and mini_lb's `/register` that servers started with `--pdlb-url`
call."""

from __future__ import annotations

import asyncio
from urllib.parse import unquote, urlsplit

from aiohttp import web

from router.api.bodies import read_json_object
from router.control.live_state import LIVE_STATE, read_live_state, rejoin_check
from router.control.upstream import INFO_TIMEOUT, UPSTREAM
from router.control.worker_sources import WORKER_SOURCES
from router.core.config import DISCOVER
from router.core.allowlists import resolve
from router.core.errors import (BadRequest, Conflict, Forbidden, NotFound, ServiceUnavailable, WorkerRemoved,
                                json_response)
from router.core.keys import CONFIG, COORDINATOR, REGISTRY, WORKER_ALLOW
from router.core.registry import DuplicateWorker, Role, Worker, WorkerState
from router.core.router_identity import is_own_address, literal_addresses, router_description, router_instance_of
from router.core.worker_entry import REGISTER_FIELDS, WorkerEntry, WorkerEntryError, parse_worker_entry
from router.core.worker_url import identity, parse_worker_url

# How long an API registration waits to learn a prefill's bootstrap port before answering.
REGISTER_SETTLE_SECS = 5.0
RESOLVE_TIMEOUT_S = 2.0
BUSY_STATES = (WorkerState.DRAINING, WorkerState.ABORTING, WorkerState.CONVERTING, WorkerState.VERIFYING)


def entry_of(data: dict, *, names: dict[str, str] | None = None) -> WorkerEntry:
    """The worker-entry body (core/worker_entry.py: the one model of every way a worker gets in), or 400
    naming every problem (unknown fields first)."""
    try:
        return parse_worker_entry(data, names=names)
    except WorkerEntryError as exc:
        raise BadRequest("; ".join(exc.problems), param=exc.param, problems=exc.problems) from None


async def check_worker_allowed(app: web.Application, url: str) -> None:
    """403 unless --worker-allow lets workers be registered at this URL (anyone may, without the flag)."""
    allowed = app[WORKER_ALLOW]
    if allowed.restricts:
        parts = urlsplit(url)
        if (refusal := await allowed.refusal(parts.hostname or "", parts.port or 0, resolve)) is not None:
            raise Forbidden(f"worker {identity(url)} may not be registered: {refusal}", param="url")


async def check_not_a_router(app: web.Application, url: str, *, probe: bool) -> None:
    """400 for a URL that is this router (its own listening address and port, any replica of it) or, with
    `probe`, that answers as a pd-router does. (A source's worker is probed by its first reading instead:
    found to be a pd-router, it is left failed, never routed.)"""
    config = app[CONFIG]
    parsed = parse_worker_url(url)
    addresses = literal_addresses(parsed.host)
    if addresses is None and parsed.port == config.port:  # a name on our port: what does it stand for?
        try:
            async with asyncio.timeout(RESOLVE_TIMEOUT_S):
                addresses = await resolve(parsed.host, parsed.port)
        except (OSError, TimeoutError):
            addresses = []
    listening = None
    if config.host and literal_addresses(config.host) is None:
        try:
            async with asyncio.timeout(RESOLVE_TIMEOUT_S):
                listening = await resolve(config.host, config.port)
        except (OSError, TimeoutError):
            listening = []
    if is_own_address(addresses or [], parsed.port, config.host, config.port, listening):
        raise BadRequest(f"{parsed.url} is this router itself (it listens on {config.host or '0.0.0.0'}:"
                         f"{config.port}): a worker must be a SGLang server", param="url")
    if probe:
        reply = await app[UPSTREAM].server_info(url, timeout=INFO_TIMEOUT)
        if (instance := router_instance_of(reply.data)) is not None:
            raise BadRequest(f"{parsed.url} is {router_description(instance)}: a worker must be a SGLang server",
                             param="url")


async def register_worker(app: web.Application, url: str, role: Role | None, port, *, source: str,
                          settle: float | None = REGISTER_SETTLE_SECS, seed: bool = False,
                          settings: dict | None = None) -> Worker:
    """`settings`: the peers' worker fields the worker keeps (labels, priority, cost, api_key: its own key, sent
    from its first reading on)."""
    key = (settings or {}).get("api_key")
    if key:
        app[UPSTREAM].set_worker_key(identity(url), key)
    try:
        worker = await _register_worker(app, url, role, port, source=source, settle=settle, seed=seed,
                                        settings=settings)
    except BaseException:
        if key and app[REGISTRY].find(url) is None:
            app[UPSTREAM].set_worker_key(identity(url), None)
        raise
    return worker


async def _register_worker(app: web.Application, url: str, role: Role | None, port, *, source: str,
                           settle: float | None, seed: bool, settings: dict | None) -> Worker:
    """Add a worker, pending until its server has been read (live role, bootstrap port, weights, readiness;
    waited for up to `settle` seconds): a live role other than `role` puts it in its live role's pool.
    `settle=None` leaves it pending for `LiveStateReader.start_up` to read with the others (before the router serves).
    `seed`: a listing the router started with (a source's first), not a registration on purpose."""
    registry, upstream, live_state = app[REGISTRY], app[UPSTREAM], app[LIVE_STATE]
    await check_worker_allowed(app, url)
    await check_not_a_router(app, url, probe=settle is not None and settle > 0 and role is not None)
    if registry.find(url) is not None:
        raise Conflict(f"worker {identity(url)} is already registered")
    await app[COORDINATOR].check_available("add worker")
    await readmit(app, url, seed=seed, source=source)
    if role is None:
        live = await read_live_state(upstream, url)
        if live.router is not None:
            raise BadRequest(f"{identity(url)} is {router_description(live.router)}: a worker must be a SGLang "
                             f"server", param="url")
        if live.role is None:
            raise BadRequest(f"worker_type is required: {identity(url)} did not report a prefill or decode role",
                             param="worker_type")
        role = live.role
    given = port is not DISCOVER and role is Role.PREFILL
    try:
        worker = live_state.register(url, role, port if given else None, port_given=given or role is Role.DECODE,
                                    source=source)
    except DuplicateWorker as exc:
        raise Conflict(str(exc)) from None
    if settings:
        registry.set_settings(worker, **settings)
    if settle is not None:
        await live_state.settle(worker, settle)
    try:
        await app[COORDINATOR].publish()  # every router replica of the fleet knows it before the answer
    except ServiceUnavailable:
        if registry.find(worker.id) is worker:  # not added, as the answer says
            registry.remove(worker)
        raise
    return worker


async def readmit(app: web.Application, url: str, *, seed: bool, source: str) -> None:
    """A server the router replicas' cluster removed: a seed names it in vain (409), a registration on purpose
    clears the removal's record (docs/CLUSTER.md, "Removed workers")."""
    url = identity(url)  # the removal's record is the worker's identity's (credentials apart)
    removal = app[COORDINATOR].removal(url)
    if removal is None:
        return
    if seed:
        raise WorkerRemoved(f"worker {url} was {removal}: {source} does not add it again (POST /workers does)",
                            param="url")
    await app[COORDINATOR].readmit(url)


async def reregister_worker(app: web.Application, worker: Worker, role: Role, port: int | None) -> None:
    """A known server registers again (mini_lb's /register, e.g. after it restarted): the checks of an
    operator's reinstate (live role as registered, /health, not paused, the fleet's weights), then routed."""
    registry = app[REGISTRY]
    if worker.state in BUSY_STATES:
        raise Conflict(f"worker {worker.url} is {worker.state}: wait for that operation to end",
                       worker_id=worker.id, state=worker.state.value)
    await app[COORDINATOR].check_available("re-register")
    revision = worker.revision
    await rejoin_check(registry, app[UPSTREAM], worker, what="re-register", role=role)
    if registry.find(worker.id) is not worker or worker.revision != revision:
        raise Conflict(f"worker {worker.id} changed while it was being checked", worker_id=worker.id)
    if worker.role is not role:
        registry.move(worker, role, port, WorkerState.ACTIVE, f"re-registered as {role}")
    else:
        registry.update_info(worker, bootstrap_port=port)
        if worker.state is not WorkerState.ACTIVE:
            registry.set_state(worker, WorkerState.ACTIVE, "re-registered")
    await app[COORDINATOR].publish()


async def unregister_worker(app: web.Application, worker: Worker, *, by: str = "the worker API") -> None:
    """Out of the fleet: removed on every router replica, and kept out of their command lines (refused while
    an operation runs on it)."""
    if worker.state in BUSY_STATES:
        raise Conflict(f"worker {worker.url} is {worker.state}: wait for that operation to end")
    await app[COORDINATOR].remove_worker(worker, by)
    if app[REGISTRY].find(worker.id) is worker:
        app[REGISTRY].remove(worker)


def apply_settings(app: web.Application, worker: Worker, settings: dict) -> None:
    """PATCH/PUT /workers/{id}: the peers' fields the worker keeps, changed (its api_key from the next call on)."""
    if "api_key" in settings:
        app[UPSTREAM].set_worker_key(worker.url, settings["api_key"])
    app[REGISTRY].set_settings(worker, **settings)


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
    worker = await register_worker(request.app, entry.address, entry.given_role,
                                   entry.bootstrap_port_of(null_means=DISCOVER), source="POST /workers",
                                   settings=entry.settings)
    body = {"success": True, "message": f"Successfully added worker: {worker.url}", "worker_id": worker.id,
            "url": worker.url, "worker": worker.to_dict()}
    if entry.ignored:  # the peers' fields that mean nothing to pd-router's pools (docs/guides/workers.md: Worker entries)
        body["ignored_fields"] = list(entry.ignored)
    return json_response(body)


async def delete_worker(request: web.Request) -> web.Response:
    worker = find_worker(request.app, request.match_info["worker_id"])
    await unregister_worker(request.app, worker, by="DELETE /workers")
    return json_response({"success": True, "message": f"Successfully removed worker: {worker.url}",
                          "worker_id": worker.id, "url": worker.url})


async def add_worker_legacy(request: web.Request) -> web.Response:
    entry = entry_of(dict(request.query))  # the body's fields as query parameters
    worker = await register_worker(request.app, entry.address, entry.given_role,
                                   entry.bootstrap_port_of(null_means=None), source="POST /add_worker")
    return json_response({"success": True, "message": f"Successfully added worker: {worker.url}",
                          "worker_id": worker.id})


async def remove_worker_legacy(request: web.Request) -> web.Response:
    url = request.query.get("url")
    if not url:
        raise BadRequest("missing query parameter url", param="url")
    worker = find_worker(request.app, url)
    await unregister_worker(request.app, worker, by="POST /remove_worker")
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
    await check_worker_allowed(request.app, url)  # a re-registration too: it may change the worker's port
    existing = request.app[REGISTRY].find(url)
    if existing is not None:
        await reregister_worker(request.app, existing, role, port)
        return json_response({"success": True, "message": f"{mode} server {existing.url} re-registered"})
    worker = await register_worker(request.app, url, role, port, source=f"POST /register mode={mode}")
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
