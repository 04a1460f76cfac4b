"""A worker's way into and out of the fleet: one flow for every door.

The worker API (`POST /workers`, `/add_worker`, mini_lb's `/register`, `DELETE /workers/{id}`,
`/remove_worker`), the worker sources (discovery file, etcd, Kubernetes pods) and the health checker
(`--remove-unhealthy-workers`) all add and remove workers through `WorkerLifecycle`, so each does exactly
what the others do:

    register     allowed (--worker-allow) -> not this router -> not known -> the fleet is available ->
                 readmitted if the replicas' cluster removed it -> live role read when none was given ->
                 registered (pending) -> settled (its server read) -> published to every replica,
                 rolled back if that fails
    reregister   a known server again (mini_lb's /register after a restart): the reinstate checks, routed
    unregister   out of every replica's fleet, refused while an operation owns it

Built by the composition root with what it needs; the API and the sources hold it, not the app.
"""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

from aiohttp import web

from router.control.live_state import LiveStateReader, read_live_state, rejoin_check
from router.control.upstream import INFO_TIMEOUT, Upstream
from router.core.allowlists import WorkerAllowList, resolve
from router.core.config import DISCOVER, RouterConfig
from router.core.coordination import FleetMembership
from router.core.errors import BadRequest, Conflict, Forbidden, ServiceUnavailable, WorkerRemoved
from router.core.registry import DuplicateWorker, Registry, Role, Worker, WorkerState
from router.core.router_identity import is_own_address, literal_addresses, router_description, router_instance_of
from router.core.worker_url import identity, parse_worker_url

# How long an API registration waits to learn a prefill's bootstrap port before answering.
REGISTER_SETTLE_SECS = 5.0
RESOLVE_TIMEOUT_S = 2.0
BUSY_STATES = (WorkerState.DRAINING, WorkerState.ABORTING, WorkerState.CONVERTING, WorkerState.VERIFYING)


class WorkerLifecycle:
    def __init__(self, config: RouterConfig, registry: Registry, upstream: Upstream, live_state: LiveStateReader,
                 coordinator: FleetMembership, allowed: WorkerAllowList) -> None:
        self.config = config
        self.registry = registry
        self.upstream = upstream
        self.live_state = live_state
        self.coordinator = coordinator
        self.allowed = allowed

    # ---- in ------------------------------------------------------------------------------------------------
    async def register(self, url: str, role: Role | None, port, *, source: str,
                       settle: float | None = REGISTER_SETTLE_SECS, seed: bool = False,
                       settings: dict | None = None) -> Worker:
        """Add a worker, pending until its server has been read (live role, bootstrap port, weights, readiness;
        waited for up to `settle` seconds): a live role other than `role` puts it in its live role's pool.
        `settle=None` leaves it pending for `LiveStateReader.start_up` to read with the others (before the router
        serves). `seed`: a listing the router started with (a source's first), not a registration on purpose.
        `settings`: the peers' worker fields the worker keeps (labels, priority, cost, api_key: its own key,
        sent from its first reading on)."""
        key = (settings or {}).get("api_key")
        if key:
            self.upstream.set_worker_key(identity(url), key)
        try:
            return await self._register(url, role, port, source=source, settle=settle, seed=seed,
                                        settings=settings)
        except BaseException:
            if key and self.registry.find(url) is None:
                self.upstream.set_worker_key(identity(url), None)
            raise

    async def _register(self, url: str, role: Role | None, port, *, source: str, settle: float | None, seed: bool,
                        settings: dict | None) -> Worker:
        registry, live_state = self.registry, self.live_state
        await self.check_allowed(url)
        await self.check_not_a_router(url, probe=settle is not None and settle > 0 and role is not None)
        if registry.find(url) is not None:
            raise Conflict(f"worker {identity(url)} is already registered")
        await self.coordinator.check_available("add worker")
        await self._readmit(url, seed=seed, source=source)
        if role is None:
            live = await read_live_state(self.upstream, url)
            if live.router is not None:
                raise BadRequest(f"{identity(url)} is {router_description(live.router)}: a worker must be a "
                                 f"SGLang server", param="url")
            if live.role is None:
                raise BadRequest(f"worker_type is required: {identity(url)} did not report a prefill or decode "
                                 f"role", param="worker_type")
            role = live.role
        given = port is not DISCOVER and role is Role.PREFILL
        try:
            worker = live_state.register(url, role, port if given else None,
                                         port_given=given or role is Role.DECODE, source=source)
        except DuplicateWorker as exc:
            raise Conflict(str(exc)) from None
        if settings:
            registry.set_settings(worker, **settings)
        if settle is not None:
            await live_state.settle(worker, settle)
        try:
            await self.coordinator.publish()  # every router replica of the fleet knows it before the answer
        except ServiceUnavailable:
            if registry.find(worker.id) is worker:  # not added, as the answer says
                registry.remove(worker)
            raise
        return worker

    async def reregister(self, worker: Worker, role: Role, port: int | None) -> None:
        """A known server registers again (mini_lb's /register, e.g. after it restarted): the checks of an
        operator's reinstate (live role as registered, /health, not paused, the fleet's weights), then routed."""
        registry = self.registry
        if worker.state in BUSY_STATES:
            raise Conflict(f"worker {worker.url} is {worker.state}: wait for that operation to end",
                           worker_id=worker.id, state=worker.state.value)
        await self.coordinator.check_available("re-register")
        revision = worker.revision
        await rejoin_check(registry, self.upstream, worker, what="re-register", role=role)
        if registry.find(worker.id) is not worker or worker.revision != revision:
            raise Conflict(f"worker {worker.id} changed while it was being checked", worker_id=worker.id)
        if worker.role is not role:
            registry.move(worker, role, port, WorkerState.ACTIVE, f"re-registered as {role}")
        else:
            registry.update_info(worker, bootstrap_port=port)
            if worker.state is not WorkerState.ACTIVE:
                registry.set_state(worker, WorkerState.ACTIVE, "re-registered")
        await self.coordinator.publish()

    def apply_settings(self, worker: Worker, settings: dict) -> None:
        """PATCH/PUT /workers/{id}: the peers' fields the worker keeps, changed (its api_key from the next call
        on)."""
        if "api_key" in settings:
            self.upstream.set_worker_key(worker.url, settings["api_key"])
        self.registry.set_settings(worker, **settings)

    # ---- out -----------------------------------------------------------------------------------------------
    async def unregister(self, worker: Worker, *, by: str = "the worker API") -> None:
        """Out of the fleet: removed on every router replica, and kept out of their command lines (refused while
        an operation runs on it)."""
        if worker.state in BUSY_STATES:
            raise Conflict(f"worker {worker.url} is {worker.state}: wait for that operation to end")
        await self.coordinator.remove_worker(worker, by)
        if self.registry.find(worker.id) is worker:
            self.registry.remove(worker)

    # ---- the checks ----------------------------------------------------------------------------------------
    async def check_allowed(self, url: str) -> None:
        """403 unless --worker-allow lets workers be registered at this URL (anyone may, without the flag)."""
        if self.allowed.restricts:
            parts = urlsplit(url)
            if (refusal := await self.allowed.refusal(parts.hostname or "", parts.port or 0, resolve)) is not None:
                raise Forbidden(f"worker {identity(url)} may not be registered: {refusal}", param="url")

    async def check_not_a_router(self, url: str, *, probe: bool) -> None:
        """400 for a URL that is this router (its own listening address and port, any replica of it) or, with
        `probe`, that answers as a pd-router does. (A source's worker is probed by its first reading instead:
        found to be a pd-router, it is left failed, never routed.)"""
        config = self.config
        parsed = parse_worker_url(url)
        addresses = literal_addresses(parsed.host)
        if addresses is None and parsed.port == config.port:  # a name on our port: what does it stand for?
            addresses = await _resolved(parsed.host, parsed.port)
        listening = None
        if config.host and literal_addresses(config.host) is None:
            listening = await _resolved(config.host, config.port)
        if is_own_address(addresses or [], parsed.port, config.host, config.port, listening):
            raise BadRequest(f"{parsed.url} is this router itself (it listens on {config.host or '0.0.0.0'}:"
                             f"{config.port}): a worker must be a SGLang server", param="url")
        if probe:
            reply = await self.upstream.server_info(url, timeout=INFO_TIMEOUT)
            if (instance := router_instance_of(reply.data)) is not None:
                raise BadRequest(f"{parsed.url} is {router_description(instance)}: a worker must be a SGLang "
                                 f"server", param="url")

    async def _readmit(self, url: str, *, seed: bool, source: str) -> None:
        """A server the router replicas' cluster removed: a seed names it in vain (409), a registration on
        purpose clears the removal's record (docs/CLUSTER.md, "Removed workers")."""
        url = identity(url)  # the removal's record is the worker's identity's (credentials apart)
        removal = self.coordinator.removal(url)
        if removal is None:
            return
        if seed:
            raise WorkerRemoved(f"worker {url} was {removal}: {source} does not add it again (POST /workers "
                                f"does)", param="url")
        await self.coordinator.readmit(url)


async def _resolved(host: str, port: int) -> list:
    """The addresses `host` stands for ([] when it does not resolve in time)."""
    try:
        async with asyncio.timeout(RESOLVE_TIMEOUT_S):
            return await resolve(host, port)
    except (OSError, TimeoutError):
        return []


WORKER_LIFECYCLE = web.AppKey("worker_lifecycle", WorkerLifecycle)
