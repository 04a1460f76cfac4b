"""The servers are the truth about themselves: reading each server's live state into the registry.

A worker is registered `pending` (not routed) until its server has been read: its live role (0.5.23's
`/model_info` `disaggregation_mode`; `/server_info` `internal_states[0]` for the conversion API, whose top
level keeps the launch role), its live bootstrap port, its weight version, and its readiness (0.5.23's
`/ready`: 503 while paused). Then (`apply`):
- a live role other than the registration's puts it in the pool of its live role, with its live bootstrap
  port, and a warning naming the flag and the server (a router restarted after a conversion still has the
  old roles on its command line);
- a server that is not ready is held out (`paused`) until `/ready` answers 200 (`watch_held`) or
  continue_generation reaches it;
- a server on another weight version than the fleet's is held out (`weights`) until it serves the fleet's;
- an unreachable server stays pending and is read again every `retry_interval` until it answers or is removed.
At start-up (`start_up`) every server is read before the router serves (bounded); the fleet's weight version
is then chosen from what they report (`routability.choose_fleet_version`), before any of them is routed.
The same reading runs when a worker is registered through the API and when it comes back from being unhealthy
(`refresh`), and `rejoin_check` is the check a known worker passes to be routed again (reinstate, /register).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Awaitable, Callable

from aiohttp import web

from router.control.upstream import (
    HEALTH_TIMEOUT,
    INFO_TIMEOUT,
    Reply,
    Upstream,
    bootstrap_port_of,
    live_role_of,
    switch_api_of,
    weight_version_of,
)
from router.core.dp_ranks import attention_dp, rank_count, switch_refusal
from router.core.errors import BadGateway, Conflict
from router.core.registry import Registry, Role, Worker, WorkerState
from router.core.routability import HoldKind, choose_fleet_version, rejoin_refusal
from router.core.router_identity import router_description, router_instance_of

logger = logging.getLogger(__name__)

NOT_READY = "not ready: /ready answers 503 (paused, starting or unhealthy)"
# States in which what the server says may move the worker to another pool (no flow owns it).
OWN_STATES = frozenset({WorkerState.PENDING, WorkerState.ACTIVE})


@dataclass(frozen=True, slots=True)
class LiveState:
    """What a server says about itself now."""

    reachable: bool
    role: Role | None = None  # None: the server does not say (the registration's role stands)
    bootstrap_port: int | None = None
    weight_version: str | None = None
    ready: bool | None = None  # None: no /ready (before 0.5.23)
    switch_api: str | None = None
    server_version: str | None = None
    problem: str = ""  # why it could not be read
    router: str | None = None  # the instance of the pd-router that answered (a pd-router is never a worker)
    dp_ranks: int | None = None  # None: /server_info not read (router/core/dp_ranks.py)
    attention_dp: bool = False
    dp_switch_refusal: str | None = None

    def facts(self) -> dict:
        """The registry's worker fields this reading knows."""
        facts: dict = {}
        if self.switch_api is not None:
            facts["switch_api"] = self.switch_api
        if self.weight_version is not None:
            facts["weight_version"] = self.weight_version
        if self.server_version is not None:
            facts["server_version"] = self.server_version
        if self.dp_ranks is not None:
            facts.update(dp_ranks=self.dp_ranks, attention_dp=self.attention_dp,
                         dp_switch_refusal=self.dp_switch_refusal)
        return facts


async def read_weight_version(upstream: Upstream, url: str, timeout: float = INFO_TIMEOUT, *,
                              server: Reply | None = None, model: Reply | None = None) -> str | None:
    """The weight version a server serves now; the one reader (the live state, the weight flows, a takeover).
    0.5.23: `/server_info` internal_states[0] (`weight_version_of`); 0.5.6: `GET /get_weight_version`; older:
    `/model_info`. None when the server does not answer. `server`, `model`: those answers, already read."""
    if server is None:
        server = await upstream.server_info(url, timeout=timeout)
    if server.status == 0:
        return None
    if (version := weight_version_of(server.data if server.ok else None)) is not None:
        return version
    legacy = await upstream.get(url, "/get_weight_version", timeout=timeout)
    if legacy.ok and isinstance(legacy.data, dict) and legacy.data.get("weight_version") is not None:
        return str(legacy.data["weight_version"])
    if model is None:
        model = await upstream.model_info(url, timeout=timeout)
    if model.ok and isinstance(model.data, dict) and model.data.get("weight_version") is not None:
        return str(model.data["weight_version"])
    return None


async def read_live_state(upstream: Upstream, url: str, timeout: float = INFO_TIMEOUT) -> LiveState:
    model, server, ready = await asyncio.gather(upstream.model_info(url, timeout=timeout),
                                                upstream.server_info(url, timeout=timeout),
                                                upstream.ready(url, timeout=timeout))
    if model.status == 0 and server.status == 0:
        return LiveState(False, problem=server.text or model.text)
    router = router_instance_of(server.data) or router_instance_of(model.data)  # whatever the status
    if router is not None:
        return LiveState(True, router=router, problem=f"{url} is {router_description(router)}")
    model_info = model.data if model.ok else None
    server_info = server.data if server.ok else None
    live = live_role_of(model_info, server_info)
    version = server_info.get("version") if isinstance(server_info, dict) else None
    return LiveState(
        reachable=True,
        role=Role(live) if live in (Role.PREFILL.value, Role.DECODE.value) else None,
        bootstrap_port=bootstrap_port_of(server_info),
        weight_version=await read_weight_version(upstream, url, timeout, server=server, model=model),
        ready=ready,
        switch_api=switch_api_of(server_info),
        server_version=version if isinstance(version, str) else None,
        dp_ranks=rank_count(server_info) if server_info is not None else None,
        attention_dp=attention_dp(server_info),
        dp_switch_refusal=switch_refusal(server_info),
    )


async def rejoin_check(registry: Registry, upstream: Upstream, worker: Worker, *, what: str,
                       role: Role | None = None, timeout: float = HEALTH_TIMEOUT) -> LiveState:
    """What a known worker must pass to be routed again (an operator's reinstate, a server's /register):
    it reports a prefill/decode role (`role`, when the caller names one), answers /health, is not paused, and
    carries the fleet's weights. Raises BadGateway (the server cannot tell or is unhealthy) or Conflict."""
    # Both read at once; what the live state refuses is answered without waiting for /health, which 0.5.23 holds
    # while it is paused until its scheduler answers anything else (up to 20 s, then 503).
    health_probe = asyncio.ensure_future(upstream.health(worker.url, timeout=timeout))
    try:
        live = await read_live_state(upstream, worker.url)
        prefix = f"cannot {what} {worker.url}"
        if live.router is not None:
            raise Conflict(f"{prefix}: it is {router_description(live.router)}, not a SGLang server")
        if live.role is None:
            raise BadGateway(f"{prefix}: it reports no prefill/decode role "
                             f"({live.problem or 'live role unknown'})")
        if role is not None and live.role is not role:
            raise Conflict(f"{prefix} as {role}: the server's live role is {live.role}", live_role=live.role.value)
        if live.ready is False:
            raise Conflict(f"{prefix}: it is {NOT_READY}")
        health = await health_probe
    finally:
        health_probe.cancel()
    if not health.ok:
        raise BadGateway(f"{prefix}: /health answered {health.status or 'nothing'} {health.message()}")
    if (refusal := rejoin_refusal(live.weight_version, registry.fleet_version)) is not None:
        raise Conflict(f"{prefix}: {refusal}", fleet_weight_version=registry.fleet_version)
    return live


class LiveStateReader:
    def __init__(self, registry: Registry, upstream: Upstream, spawn: Callable[[Awaitable], asyncio.Task],
                 retry_interval: float = 5.0) -> None:
        self.registry = registry
        self.upstream = upstream
        self.spawn = spawn
        self.retry_interval = max(retry_interval, 0.2)
        self._tasks: dict[str, asyncio.Task] = {}
        self._port_given: set[str] = set()  # workers whose registration named a bootstrap port
        self._held_watch: asyncio.Task | None = None
        registry.subscribe(self._on_registry_event)

    def _on_registry_event(self, event: str, worker: Worker | None, details: dict) -> None:
        if event == "removed" and worker is not None:
            self._port_given.discard(worker.id)
            task = self._tasks.pop(worker.id, None)
            if task is not None:
                task.cancel()

    # ---- registration ------------------------------------------------------------------------------
    def register(self, url: str, role: Role, port: int | None, *, port_given: bool, source: str) -> Worker:
        """Add a worker, pending until its server has been read."""
        worker = self.registry.add(url, role, port, state=WorkerState.PENDING, reason="reading its live state",
                                   source=source)
        if port_given:
            self._port_given.add(worker.id)
        return worker

    def watch(self, worker: Worker) -> asyncio.Task:
        """Read a pending worker in the background (until it answers, is removed, or discovery closes)."""
        task = self._tasks.get(worker.id)
        if task is None or task.done():
            task = self.spawn(self._resolve(worker))
            self._tasks[worker.id] = task
            task.add_done_callback(lambda done, wid=worker.id: self._forget(wid, done))
        return task

    def _forget(self, worker_id: str, task: asyncio.Task) -> None:
        """A watch that ended leaves no entry behind."""
        if self._tasks.get(worker_id) is task:
            del self._tasks[worker_id]

    @property
    def watching(self) -> list[str]:
        """Ids of the workers being read now."""
        return list(self._tasks)

    async def start_up(self, timeout: float) -> None:
        """Read every pending server (bounded by `timeout`), choose the fleet's weight version from what they
        report, then let them in. Those not read by then keep being read in the background."""
        pending = [w for w in self.registry.workers() if w.state is WorkerState.PENDING]
        reads = {w: asyncio.ensure_future(read_live_state(self.upstream, w.url, min(timeout, INFO_TIMEOUT)))
                 for w in pending}
        if reads:
            await asyncio.wait(reads.values(), timeout=max(timeout, 0.01))
        read: dict[Worker, LiveState] = {}
        for worker, task in reads.items():
            if task.done() and not task.cancelled() and task.exception() is None and task.result().reachable:
                read[worker] = task.result()
            else:
                task.cancel()
        if self.registry.fleet_version is None:
            chosen = choose_fleet_version((live.role or w.role, live.weight_version) for w, live in read.items())
            versions = sorted({str(live.weight_version) for live in read.values() if live.weight_version})
            if chosen is not None:
                self.registry.set_fleet_version(chosen, f"read from the servers at start-up (they report "
                                                        f"{', '.join(versions)})")
            if len(versions) > 1:
                logger.warning("the servers disagree on the weight version (%s): the fleet serves %r; servers "
                               "on another version are held out until they serve it", ", ".join(versions), chosen)
        for worker, live in read.items():
            self.apply(worker, live)
        for worker in pending:
            if worker not in read and self.registry.find(worker.id) is worker:
                logger.warning("worker %s (%s) is not reachable yet; it stays pending (not routed) and joins its "
                               "pool when it answers", worker.url, worker.source or worker.role)
                self.watch(worker)
        self._held_watch = self.spawn(self._watch_held())

    async def settle(self, worker: Worker, timeout: float) -> None:
        """Wait (bounded) for a pending worker's first reading (an API registration answers after it)."""
        await asyncio.wait({self.watch(worker)}, timeout=timeout)

    async def refresh(self, worker: Worker) -> bool:
        """Read a known worker's live state again and apply it; False if unreachable."""
        revision = worker.revision
        live = await read_live_state(self.upstream, worker.url)
        if not live.reachable:
            return False
        if worker.revision != revision and worker.state is not WorkerState.PENDING:
            return True  # changed meanwhile (a flow, an update): this answer may be stale
        self.apply(worker, live)
        return True

    # ---- applying what a server said ---------------------------------------------------------------
    def apply(self, worker: Worker, live: LiveState) -> None:
        registry = self.registry
        if registry.find(worker.id) is not worker:
            return  # removed meanwhile
        if live.router is not None:  # never routed, probed or fanned out to; shown with the reason
            logger.error("%s (%s) is %s, not a SGLang server: it is left failed, never routed", worker.url,
                         worker.source or worker.role, router_description(live.router))
            if worker.state is not WorkerState.FAILED:
                registry.set_state(worker, WorkerState.FAILED,
                                   f"is {router_description(live.router)}, not a SGLang server: never routed")
            return
        registry.update_info(worker, **live.facts())
        held = worker.held_out  # as it is before this reading applies
        if worker.state not in OWN_STATES and not held:
            return  # a flow owns it (converting, draining), or an operator must act (failed, unsafe)
        if registry.fleet_version is None and live.weight_version is not None:
            routed = [(w.role, w.weight_version) for w in registry.workers() if w.routable]
            registry.set_fleet_version(choose_fleet_version([*routed, (live.role or worker.role, live.weight_version)]),
                                       f"the first version reported ({worker.url})")
        pending = worker.state is WorkerState.PENDING
        role = live.role or worker.role
        moved = role is not worker.role and not held
        if moved:
            port = self._live_port(worker, role, live)
            logger.warning("%s %s is now %s (live role): routing it as %s%s", worker.source or "registered as",
                           worker.url, role, role, f" with bootstrap port {port}" if role is Role.PREFILL else "")
            registry.move(worker, role, port, worker.state, f"live role {role} (registered as {worker.role})")
        if not pending:
            self._judge_holds(worker, live)
            return
        if role is Role.PREFILL and not moved:
            if worker.id not in self._port_given:
                registry.update_info(worker, bootstrap_port=self._live_port(worker, role, live))
            elif live.bootstrap_port not in (None, worker.bootstrap_port):
                logger.warning("prefill %s: registered with bootstrap port %s, the server reports %s; routing "
                               "with %s as registered", worker.url, worker.bootstrap_port, live.bootstrap_port,
                               worker.bootstrap_port)
        if (hold := self._hold_for(live)) is not None:
            registry.hold_out(worker, *hold)
        else:
            registry.set_state(worker, WorkerState.ACTIVE, "live state read" + (f": live role {role}" if moved else ""))

    def _hold_for(self, live: LiveState) -> tuple[HoldKind, str] | None:
        """Why a server that answered must still not be routed: paused (not ready), or other weights."""
        if live.ready is False:
            return HoldKind.PAUSED, NOT_READY
        fleet = self.registry.fleet_version
        if rejoin_refusal(live.weight_version, fleet) is not None:
            return HoldKind.WEIGHTS, f"serves weight_version {live.weight_version!r}, the fleet serves {fleet!r}"
        return None

    def _judge_holds(self, worker: Worker, live: LiveState) -> None:
        """A known worker read again: held out if paused or on other weights; a pause hold ends once the
        server is ready (its weights are judged then)."""
        hold = worker.hold
        if hold is not None and hold.kind is HoldKind.PAUSED and live.ready is True:
            self.registry.end_hold(worker, [HoldKind.PAUSED], "ready again (/ready answers 200)")
        if worker.hold is None and worker.state is WorkerState.ACTIVE and (found := self._hold_for(live)) is not None:
            self.registry.hold_out(worker, *found)

    def _live_port(self, worker: Worker, role: Role, live: LiveState) -> int | None:
        if role is Role.DECODE:
            return None
        if live.bootstrap_port is None:
            logger.warning("prefill %s did not report its bootstrap port; routing with bootstrap_port null: "
                           "decode servers will use their own default", worker.url)
        return live.bootstrap_port

    # ---- background reading ------------------------------------------------------------------------
    async def _resolve(self, worker: Worker) -> None:
        while self.registry.find(worker.id) is worker and worker.state is WorkerState.PENDING:
            live = await read_live_state(self.upstream, worker.url)
            if live.reachable:
                self.apply(worker, live)
                return
            await asyncio.sleep(self.retry_interval)

    async def _watch_held(self) -> None:
        """Servers held out as paused are read again until `/ready` answers 200 (not paused any more)."""
        while True:
            await asyncio.sleep(self.retry_interval)
            await asyncio.gather(*(self.refresh(w) for w in self.registry.held(HoldKind.PAUSED)))

    async def close(self) -> None:
        tasks = [*self._tasks.values(), *([self._held_watch] if self._held_watch is not None else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()


LIVE_STATE = web.AppKey("live_state", LiveStateReader)
