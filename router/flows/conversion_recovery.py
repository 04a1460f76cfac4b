"""A conversion whose router replica died, recovered from its record by the replica taking it over.

- before its switch was asked (step `start`): nothing changed on the server; the worker goes back to its pool,
  active (or to the pool of the role the server reports, if someone else switched it);
- in its switch (step `switch`): the server may still be switching; its live role is read until it reports the
  new role (active there, with its live bootstrap port) or the switch's deadline passes (back in its old pool
  if it is unchanged, `RoleSwitch.unchanged`, else `failed` with the reason). A 0.5.23 server that reports its
  old role is asked whether a switch is running (`RoleSwitch.no_switch_running`): if not, the owner died
  before its call reached it, and it goes back to its old pool at once.
"""

from __future__ import annotations

import asyncio
import time

from router.control.live_state import LiveState, read_live_state
from router.control.upstream import Upstream
from router.core.coordination import Ticket
from router.core.registry import Registry, Role, Worker, WorkerState
from router.flows.role_switch import RoleSwitch

POLL_S = 0.2  # a polling cadence: the server says nothing when its switch ends


async def recover_conversion(registry: Registry, upstream: Upstream, server: RoleSwitch, ticket: Ticket,
                             record: dict, *, default_switch_s: float) -> tuple[str, str]:
    details = ticket.details
    url = str(details.get("worker_url", ""))
    old, new = Role(details.get("old_role")), Role(details.get("new_role"))
    worker = registry.find(url)
    why = f"conversion {ticket.op_id} {old}->{new}: its replica {record.get('owner')} died"
    if worker is None:
        return "failed", f"{why}; the worker was removed meanwhile"
    if record.get("step") != "switch":
        live = await read_live_state(upstream, url)
        if live.role is new:  # switched by someone else: it serves its live role
            return _activate(registry, worker, live, new, f"{why}; the server reports role {new}")
        _restore(registry, worker, old, live, f"{why} before its switch: back in the {old} pool")
        return "restored", f"{why} before its switch was asked; {url} is back in the {old} pool"
    deadline = time.monotonic() + float(details.get("switch_timeout_s") or default_switch_s)
    live = await read_live_state(upstream, url)
    while live.role is not new and time.monotonic() < deadline:
        if live.role is old and await server.no_switch_running(url, live.switch_api, new):
            # the owner died between recording the step and its call: nothing changed on the server
            _restore(registry, worker, old, live, f"{why} before its switch reached the server: back in the "
                                                  f"{old} pool")
            return "restored", (f"{why} before its switch reached the server (it reports role {old} and no "
                                f"switch running); {url} is back in the {old} pool")
        await asyncio.sleep(POLL_S)
        live = await read_live_state(upstream, url)
    if live.role is new:
        return _activate(registry, worker, live, new, f"{why} during its switch; the server reports role {new}")
    safe, seen = await server.unchanged(url, old, live.role.value if live.role is not None else None)
    if safe:
        _restore(registry, worker, old, live, f"{why} during its switch; {seen}")
        return "restored", f"{why} during its switch; {url} still reports role {old}: back in its pool"
    reason = (f"{why} during its switch; {seen}{f' ({live.problem})' if live.problem else ''}: reinstate "
              f"(POST /admin/workers/{worker.id}/reinstate) or remove it")
    registry.set_state(worker, WorkerState.FAILED, reason)
    return "failed", reason


def _activate(registry: Registry, worker: Worker, live: LiveState, role: Role, reason: str) -> tuple[str, str]:
    port = live.bootstrap_port if role is Role.PREFILL else None
    registry.move(worker, role, port, WorkerState.ACTIVE, reason)
    return "converted", f"{reason}: active as {role}" + (f" (bootstrap port {port})" if port else "")


def _restore(registry: Registry, worker: Worker, role: Role, live: LiveState, reason: str) -> None:
    port = worker.bootstrap_port if role is worker.role else None
    if role is Role.PREFILL and live.bootstrap_port is not None:
        port = live.bootstrap_port
    registry.move(worker, role, port if role is Role.PREFILL else None, WorkerState.ACTIVE, reason)
