"""Operations whose owner died: one live replica takes each over and completes or rolls it back.

An operation's lock is on its owner's lease; its record stays. When the watch shows a running record whose
lock is gone (and at start-up, for records left by replicas that are all gone), every replica races to take
it over (`EtcdCoordinator.adopt`: a transaction only one wins) and the winner decides from the record and the
server's live state, within a few seconds of the owner's death (its lease's TTL):

- conversion, before its switch was asked (step `start`): nothing changed on the server; the worker goes
  back to its pool, active (or to the pool of the role the server reports, if someone else switched it);
- conversion in its switch (step `switch`): the server may still be switching; its live role is read until it
  reports the new role (active there, with its live bootstrap port) or the switch's deadline passes (back
  in its old pool if it reports the old role and answers /health, else `failed` with the reason). A 0.5.23
  server that reports its old role is asked whether a switch is running (`prepare_only`, which changes
  nothing): if not, the owner died before its call reached it, and it goes back to its old pool at once;
- weight update: every server's live version is read; the fleet serves the version chosen from them (one a
  prefill and a decode server hold, the most common first), servers on another one are held out (`weights`),
  and the update's hold on admission is released;
- reinstate, abort_all: the record is closed (nothing half-done to finish);
- pause, continue, memory release/resume: the record is closed as failed; the fleet's pause or memory hold
  stays as it stood (repeat the call at any replica).
No server is left out of every pool without a reason in its state.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

from router.cluster.coordinator import EtcdCoordinator
from router.cluster.fleet_holds import FleetHolds
from router.cluster.keys import ClusterKeys, decode
from router.cluster.mirror import Change, Mirror
from router.cluster.replica import Membership
from router.control.live_state import LiveState, read_live_state
from router.control.upstream import HEALTH_TIMEOUT, Upstream
from router.core.coordination import Ticket, while_owned
from router.core.errors import RouterError
from router.core.registry import Registry, Role, Worker, WorkerState
from router.core.routability import HoldKind, choose_fleet_version

logger = logging.getLogger(__name__)

PD_ROLE_SWITCH = "pd_role_switch"  # the switch API of 0.5.23 servers (LiveState.switch_api)
UPDATE_KINDS = frozenset({"update_weights_from_disk", "update_weights_from_distributed",
                          "update_weights_from_tensor", "update_weight_version"})
POLL_S = 0.2
DEFAULT_SWITCH_S = 120.0
# How long a taker-over waits for servers an update reached to report its version. A server still loading
# after it is held out for its weights and let back by the reconciler once it serves the fleet's version.
SETTLE_S = 30.0


class Takeover:
    def __init__(self, keys: ClusterKeys, mirror: Mirror, membership: Membership, coordinator: EtcdCoordinator,
                 registry: Registry, upstream: Upstream, holds: FleetHolds,
                 spawn: Callable[[Awaitable], asyncio.Task], *, update_timeout_s: float = 600.0) -> None:
        self.keys = keys
        self.mirror = mirror
        self.membership = membership
        self.coordinator = coordinator
        self.registry = registry
        self.upstream = upstream
        self.holds = holds
        self.spawn = spawn
        self.update_timeout_s = update_timeout_s  # a weight update's deadline (its owner's, from its start)
        self.taken: list[dict] = []  # the last operations this replica took over (for the cluster view)
        self.count = 0
        self._running: set[str] = set()
        self._wake = asyncio.Event()

    def on_changes(self, changes: list[Change]) -> None:
        if any(self.keys.kind_of(c.key)[0] in ("lock", "op") for c in changes):
            self._wake.set()

    async def run(self) -> None:
        """Scan on every change of locks and records, and every lease TTL anyway (cancel to stop)."""
        while True:
            self.scan()
            try:
                async with asyncio.timeout(self.membership.ttl):
                    await self._wake.wait()
            except TimeoutError:
                pass
            self._wake.clear()

    def orphans(self) -> list:
        """Running records whose lock is gone or held for another operation."""
        found = []
        for kv in self.mirror.under(self.keys.ops):
            record = decode(kv.value)
            if record.get("state") != "running" or not record.get("scope"):
                continue
            lock = self.mirror.get(self.keys.lock(str(record["scope"])))
            if lock is None or decode(lock.value).get("op") != record.get("id"):
                found.append(kv)
        return found

    def scan(self) -> None:
        if not self.membership.alive:
            return
        for kv in self.orphans():
            op_id = str(decode(kv.value).get("id"))
            if op_id not in self._running:
                self._running.add(op_id)
                task = self.spawn(self._take(kv))
                task.add_done_callback(lambda _t, op_id=op_id: self._running.discard(op_id))

    async def _take(self, kv) -> None:
        ticket = await self.coordinator.adopt(kv)
        if ticket is None:
            return  # another replica took it (or etcd did not answer: the next scan tries again)
        record = decode(kv.value)
        started = time.monotonic()
        logger.warning("cluster: replica %s takes over %s %s from replica %s, whose lease ended",
                       self.membership.identity.id, ticket.kind, ticket.op_id, record.get("owner"))
        outcome, message = "failed", "taken over: nothing to finish"
        try:
            if ticket.kind == "conversion":
                # its waits end if this replica loses it in turn (the next replica takes it over then)
                outcome, message = await while_owned(self.coordinator, ticket, self._conversion(ticket, record))
            elif ticket.kind in UPDATE_KINDS:
                outcome, message = await while_owned(self.coordinator, ticket, self._weights(ticket, record))
                self._release_holds_of(ticket)  # the update's own hold (a pause's or a memory hold stays)
            else:
                message = (f"its owner {record.get('owner')} died during {ticket.kind}; closed by replica "
                           f"{self.membership.identity.id} (repeat the call if it is still wanted)")
        except RouterError as exc:  # lost in turn: left to the next replica
            message = exc.message
        except Exception as exc:  # the record must still end; the worker's state says what is known
            logger.exception("cluster: taking over %s %s failed", ticket.kind, ticket.op_id)
            message = f"takeover failed: {type(exc).__name__}: {exc}"
        finally:
            self.taken.append({"op": ticket.op_id, "kind": ticket.kind, "from": record.get("owner"),
                               "outcome": outcome, "message": message, "at": round(time.time(), 3),
                               "duration_s": round(time.monotonic() - started, 3)})
            del self.taken[:-20]
            self.count += 1
            await self.coordinator.release(ticket, outcome, message)
        logger.warning("cluster: %s %s taken over: %s (%s)", ticket.kind, ticket.op_id, outcome, message)

    def _release_holds_of(self, ticket: Ticket) -> None:
        for reason, info in list(self.holds.holds.items()):
            if isinstance(info, dict) and info.get("op") == ticket.op_id:
                self.holds.release(reason)

    # ---- a conversion ------------------------------------------------------------------------------------
    async def _conversion(self, ticket: Ticket, record: dict) -> tuple[str, str]:
        details = ticket.details
        url = str(details.get("worker_url", ""))
        old, new = Role(details.get("old_role")), Role(details.get("new_role"))
        worker = self.registry.find(url)
        owner = record.get("owner")
        why = f"conversion {ticket.op_id} {old}->{new}: its replica {owner} died"
        if worker is None:
            return "failed", f"{why}; the worker was removed meanwhile"
        if record.get("step") != "switch":
            live = await read_live_state(self.upstream, url)
            if live.role is new:  # switched by someone else: it serves its live role
                return self._activate(worker, live, new, f"{why}; the server reports role {new}")
            self._restore(worker, old, live, f"{why} before its switch: back in the {old} pool")
            return "restored", f"{why} before its switch was asked; {url} is back in the {old} pool"
        deadline = time.monotonic() + float(details.get("switch_timeout_s") or DEFAULT_SWITCH_S)
        live = await read_live_state(self.upstream, url)
        while live.role is not new and time.monotonic() < deadline:
            if live.role is old and await self._no_switch_running(url, live, new):
                # the owner died between recording the step and its call: nothing changed on the server
                self._restore(worker, old, live, f"{why} before its switch reached the server: back in the "
                                                 f"{old} pool")
                return "restored", (f"{why} before its switch reached the server (it reports role {old} and "
                                    f"no switch running); {url} is back in the {old} pool")
            # a polling cadence: the server says nothing when its switch ends
            await asyncio.sleep(POLL_S)
            live = await read_live_state(self.upstream, url)
        if live.role is new:
            return self._activate(worker, live, new, f"{why} during its switch; the server reports role {new}")
        if live.role is old and (await self.upstream.health(url, timeout=HEALTH_TIMEOUT)).ok:
            self._restore(worker, old, live, f"{why} during its switch; the server still reports role {old}")
            return "restored", f"{why} during its switch; {url} still reports role {old}: back in its pool"
        reason = (f"{why} during its switch; the server reports role {live.role or 'nothing'} "
                  f"({live.problem or 'not healthy'}): reinstate (POST /admin/workers/{worker.id}/reinstate) or "
                  f"remove it")
        self.registry.set_state(worker, WorkerState.FAILED, reason)
        return "failed", reason

    async def _no_switch_running(self, url: str, live: LiveState, new: Role) -> bool:
        """Whether a 0.5.23 server is not switching now, asked without changing anything: `prepare_only`
        runs every check of a switch (another switch in progress first) and stops there. A server that takes
        requests one after another answers after a switch under way, "already in target role": running.
        Servers of the convert API cannot tell: the taker-over waits for them as before."""
        if live.switch_api != PD_ROLE_SWITCH:
            return False
        reply = await self.upstream.post(url, "/pd_role_switch", {"new_role": new.value, "prepare_only": True},
                                         timeout=HEALTH_TIMEOUT)
        answer = reply.data if isinstance(reply.data, dict) else {}
        if reply.status == 200:
            return answer.get("success") is True and answer.get("message") == "ready"
        # refused before anything changed (busy, a check failed), but not because a switch is running
        return (reply.status == 400 and answer.get("safe_to_restore") is True
                and "in progress" not in str(answer.get("message", "")))

    def _activate(self, worker: Worker, live: LiveState, role: Role, reason: str) -> tuple[str, str]:
        port = live.bootstrap_port if role is Role.PREFILL else None
        self.registry.move(worker, role, port, WorkerState.ACTIVE, reason)
        return "converted", f"{reason}: active as {role}" + (f" (bootstrap port {port})" if port else "")

    def _restore(self, worker: Worker, role: Role, live: LiveState, reason: str) -> None:
        port = worker.bootstrap_port if role is worker.role else None
        if role is Role.PREFILL and live.bootstrap_port is not None:
            port = live.bootstrap_port
        self.registry.move(worker, role, port if role is Role.PREFILL else None, WorkerState.ACTIVE, reason)

    # ---- a weight update ------------------------------------------------------------------------------------
    async def _versions(self, workers: list[Worker]) -> dict[Worker, LiveState]:
        lives = await asyncio.gather(*(read_live_state(self.upstream, w.url) for w in workers))
        return {w: live for w, live in zip(workers, lives) if live.reachable and live.weight_version is not None}

    async def _weights(self, ticket: Ticket, record: dict) -> tuple[str, str]:
        workers = [w for w in self.registry.workers() if w.state is not WorkerState.PENDING]
        read = await self._versions(workers)
        options = ticket.details.get("options") if isinstance(ticket.details.get("options"), dict) else {}
        target, before = options.get("weight_version"), self.registry.fleet_version
        if record.get("step") == "update":
            # the servers may still be loading: wait, as the owner would have, for them to report the version
            # asked for (or, none named, to agree on a new one), up to SETTLE_S and the update's own deadline
            started = record.get("started_at") if isinstance(record.get("started_at"), (int, float)) else time.time()
            deadline = time.monotonic() + min(max(started + self.update_timeout_s - time.time(), 0.0), SETTLE_S)
            while not _updated(read, target, before) and time.monotonic() < deadline:
                await asyncio.sleep(POLL_S)  # a polling cadence: a server says nothing when its update ends
                read = await self._versions(workers)
        served = [(live.role or w.role, live.weight_version) for w, live in read.items()]
        # the version asked for, where a prefill and a decode server have it (the update took); else the one
        # the servers agree on most (it may have reached none: then nothing changed)
        chosen = target if _servable(served, target) else choose_fleet_version(served)
        owner = record.get("owner")
        why = f"{ticket.kind} {ticket.op_id}: its replica {owner} died"
        self.registry.set_fleet_version(chosen if chosen is not None else self.registry.fleet_version, why,
                                        worker_versions={w: live.weight_version for w, live in read.items()})
        out = []
        for worker, live in read.items():
            if self.registry.find(worker.id) is not worker:
                continue
            if live.weight_version != self.registry.fleet_version:
                self.registry.hold_out(worker, HoldKind.WEIGHTS, f"{why}; it serves {live.weight_version!r}, the "
                                                                 f"fleet {self.registry.fleet_version!r}")
                out.append(worker.url)
            elif worker.hold is not None and worker.hold.kind is HoldKind.WEIGHTS:
                self.registry.end_hold(worker, [HoldKind.WEIGHTS], f"{why}; it serves the fleet's version")
        versions = sorted({str(live.weight_version) for live in read.values()})
        message = (f"{why}; the servers report {', '.join(versions) or 'no version'}: the fleet serves "
                   f"{self.registry.fleet_version!r}" + (f", {', '.join(out)} held out" if out else ""))
        if out or len(versions) != 1:
            return "failed", message
        return ("rolled back" if self.registry.fleet_version == before != target else "succeeded"), message


def _updated(read: dict[Worker, LiveState], target: str | None, before: str | None) -> bool:
    """Every server read reports the version the update asked for (none named: one version, not the old)."""
    versions = {live.weight_version for live in read.values()}
    if target is not None:
        return versions == {target}
    return len(versions) == 1 and versions != {before}


def _servable(served: list[tuple[Role, str | None]], version: str | None) -> bool:
    return version is not None and {role for role, v in served if v == version} == {Role.PREFILL, Role.DECODE}
