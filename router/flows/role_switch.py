"""The server side of a live P/D role conversion: switch the server's role through whichever API it has,
and read its live role back.

Two server APIs: SGLang 0.5.23's `/pd_role_switch` (refuses while not idle, with `safe_to_restore` telling
whether the server is unchanged; `safe_to_restore` is false on success, so it is read only on failure) and
the earlier design's `/convert_pd_role` (reports the bootstrap port a new prefill listens on). A switch that
answered success is trusted only once the server reports the new role.
"""

from __future__ import annotations

import asyncio
import logging
import time

from router.control.upstream import HEALTH_TIMEOUT, INFO_TIMEOUT, Reply, Upstream, bootstrap_port_of, live_role_of
from router.core.registry import Registry, Role, Worker
from router.flows.conversion_record import Conversion, Plan
from router.flows.fleet import POLL_FIRST, POLL_MAX
from router.flows.steps import Step, StepFailed

logger = logging.getLogger(__name__)

PD_ROLE_SWITCH = "pd_role_switch"
CONVERT_PD_ROLE = "convert_pd_role"
SWITCH_APIS = (PD_ROLE_SWITCH, CONVERT_PD_ROLE)  # probing order when the server did not say

# 0.5.23 refuses a switch to decode without it. 0 skips the server's CUDA-graph headroom check; a failed
# capture only degrades decode to eager mode, so 0 is the value that lets a switch proceed everywhere.
DEFAULT_DECODE_CUDA_GRAPH_MEMORY_GB = 0.0
SWITCH_RETRY_FIRST, SWITCH_RETRY_MAX = 0.1, 2.0

# Server options the router knows, and the APIs that take each (server_patches' /convert_pd_role passes the
# CUDA-graph ones on to the in-place switch). Others go in `server_options`, sent verbatim.
BOTH_APIS = frozenset(SWITCH_APIS)
SERVER_OPTIONS: dict[str, frozenset[str]] = {
    "decode_cuda_graph_bs": BOTH_APIS,
    "decode_cuda_graph_memory_gb": BOTH_APIS,
    "bootstrap_port": frozenset({CONVERT_PD_ROLE}),
    "disable_radix_cache": frozenset({CONVERT_PD_ROLE}),
    "disable_cuda_graph": frozenset({CONVERT_PD_ROLE}),
}
# Fields of the switch call that the router sets from its plan: a client's `server_options` may not name them.
ROUTER_SWITCH_FIELDS = frozenset({"new_role", "server_url"})


class _Unsupported(Exception):
    """The server does not have this switch API (404/405): nothing happened."""


def _not_idle(message: str) -> bool:
    text = message.lower()
    return "not idle" in text or "drain all requests" in text


class RoleSwitch:
    """Calls to the server being converted (the flow, `Conversions`, decides what they mean)."""

    def __init__(self, registry: Registry, upstream: Upstream) -> None:
        self.registry = registry  # the switch API learnt by probing is remembered on the worker
        self.upstream = upstream

    # ---- the switch --------------------------------------------------------------------------------
    async def switch(self, conversion: Conversion, worker: Worker, plan: Plan, step: Step) -> dict:
        # The plan's API, then the one learnt from /server_info; a 404 there still tries the other one.
        apis = tuple(dict.fromkeys([a for a in (plan.api, worker.switch_api) if a] + list(SWITCH_APIS)))
        unsupported: list[str] = []
        for api in apis:
            try:
                answer = await self._call(api, conversion, worker, plan, step)
            except _Unsupported:
                unsupported.append(api)
                continue
            conversion.api = api
            if worker.switch_api is None or worker.switch_api in unsupported:  # learnt by probing
                self.registry.update_info(worker, switch_api=api)
            return answer
        raise StepFailed(f"the server has no role-switch API (neither {' nor '.join('/' + a for a in apis)} "
                         f"exists): start it with --enable-pd-role-switch", safe=True)

    def _body(self, api: str, conversion: Conversion, worker: Worker, plan: Plan) -> dict:
        options = {k: v for k, v in plan.server_options.items() if api in SERVER_OPTIONS.get(k, ())}
        ignored = sorted(k for k in plan.server_options if api not in SERVER_OPTIONS.get(k, ()))
        if ignored:
            note = f"ignored options that /{api} does not take: {', '.join(ignored)}"
            if note not in conversion.notes:
                conversion.notes.append(note)
        if api == PD_ROLE_SWITCH:
            # The router's own fields last: nothing the client sent overrides the plan.
            body = {**options, **plan.raw_server_options, "new_role": conversion.new_role.value}
        else:
            # `check_idle` is left to its default (true: refuse when busy): the router has emptied the server
            # already, and retries a "not idle" refusal until the step's deadline.
            body = {**options, **plan.raw_server_options, "server_url": worker.url}
        if conversion.new_role is Role.DECODE:
            body.setdefault("decode_cuda_graph_memory_gb", DEFAULT_DECODE_CUDA_GRAPH_MEMORY_GB)
        return body

    async def _call(self, api: str, conversion: Conversion, worker: Worker, plan: Plan, step: Step) -> dict:
        body = self._body(api, conversion, worker, plan)
        deadline = step.t0 + step.deadline_s
        delay = SWITCH_RETRY_FIRST
        while True:
            started = time.monotonic()
            # The step's own deadline ends a call that outlives it (as a timeout); the call's is a backstop.
            reply = await self.upstream.post(worker.url, "/" + api, body,
                                             timeout=max(deadline - started, 0.0) + 1.0)
            conversion.server_switch_s = time.monotonic() - started
            step.attempts += 1
            if reply.status in (404, 405):
                raise _Unsupported(api)
            if reply.success():
                step.message = f"/{api}: {reply.message() or 'ok'}"
                return reply.data if isinstance(reply.data, dict) else {}
            message = reply.message()
            if reply.status == 0:
                # A connection never made means nothing reached the server; a timeout or a cut answer may have.
                raise StepFailed(f"/{api} got no answer: {message}", safe=None if reply.reached else True)
            data = reply.data if isinstance(reply.data, dict) else {}
            safe = data.get("safe_to_restore")
            if _not_idle(message) and safe is not False:
                # Transient (0.5.23: e.g. a decode holding KV of an aborted request for up to 30 s).
                step.message = f"/{api} refused, will retry: {message}"
                await asyncio.sleep(min(delay, max(deadline - time.monotonic(), 0)))
                delay = min(delay * 2, SWITCH_RETRY_MAX)
                continue
            if safe is True or reply.status == 422:
                raise StepFailed(f"/{api} refused ({reply.status}): {message}", safe=True)
            if safe is False:
                raise StepFailed(f"/{api} failed and the server is not safe to route to ({reply.status}): "
                                 f"{message}", safe=False)
            raise StepFailed(f"/{api} failed ({reply.status}): {message}", safe=None)

    async def live_role(self, worker: Worker) -> tuple[str | None, Reply | None]:
        model, server = await asyncio.gather(self.upstream.model_info(worker.url, timeout=INFO_TIMEOUT),
                                             self.upstream.server_info(worker.url, timeout=INFO_TIMEOUT))
        role = live_role_of(model.data if model.ok else None, server.data if server.ok else None)
        return role, server if server.ok else None

    # ---- "safe to restore": one rule ---------------------------------------------------------------------
    async def unchanged(self, url: str, old: Role, live: str | None) -> tuple[bool, str]:
        """Whether a server whose switch ended without a clear answer is unchanged, so safe to route to in its
        old pool (the flow after a failed step, a replica taking a conversion over): it still reports its old
        role (`live`, just read) and answers /health. Returns that and what was seen."""
        if live != old.value:
            return False, f"the server reports role {live or 'nothing'}"
        health = await self.upstream.health(url, timeout=HEALTH_TIMEOUT)
        if not health.ok:
            return False, f"the server still reports role {live} but /health answered {health.status or 'nothing'}"
        return True, f"the server still reports role {live}"

    async def no_switch_running(self, url: str, switch_api: str | None, new: Role) -> bool:
        """Whether a 0.5.23 server is not switching now, asked without changing anything: `prepare_only`
        runs every check of a switch (another switch in progress first) and stops there. A server that takes
        requests one after another answers after a switch under way, "already in target role": running.
        Servers of the convert API cannot tell (False: wait for them)."""
        if switch_api != PD_ROLE_SWITCH:
            return False
        reply = await self.upstream.post(url, "/pd_role_switch", {"new_role": new.value, "prepare_only": True},
                                         timeout=HEALTH_TIMEOUT)
        answer = reply.data if isinstance(reply.data, dict) else {}
        if reply.status == 200:
            return answer.get("success") is True and answer.get("message") == "ready"
        # refused before anything changed (busy, a check failed), but not because a switch is running
        return (reply.status == 400 and answer.get("safe_to_restore") is True
                and "in progress" not in str(answer.get("message", "")))

    # ---- verification --------------------------------------------------------------------------------
    async def verify(self, conversion: Conversion, worker: Worker, answer: dict, step: Step,
                     seen: dict) -> int | None:
        """Poll the live role until it is the new one; return the bootstrap port a new prefill listens on."""
        delay = POLL_FIRST
        while True:
            step.attempts += 1
            live, server = await self.live_role(worker)
            seen["live"] = live
            if live == conversion.new_role.value:
                break
            step.message = f"the server reports role {live or 'unknown'}"
            await asyncio.sleep(delay)
            delay = min(delay * 2, POLL_MAX)
        if conversion.new_role is Role.DECODE:
            step.message = "role decode confirmed"
            return None
        port = answer.get("bootstrap_port")
        source = f"/{conversion.api}'s answer"
        if not isinstance(port, int) or isinstance(port, bool):
            port, source = bootstrap_port_of(server.data if server is not None else None), "/server_info"
        if port is None:
            step.message = ("role prefill confirmed; the server reports no bootstrap port: routing with "
                            "bootstrap_port null (decode servers use their own default)")
            logger.warning("conversion %s: %s", conversion.id, step.message)
        else:
            step.message = f"role prefill confirmed; bootstrap port {port} (from {source})"
        return port

    @staticmethod
    def verify_timeout(conversion: Conversion, step: Step, seen: dict) -> StepFailed:
        live = seen.get("live")
        if live == conversion.old_role.value:  # nothing changed, if it is healthy: the flow checks
            return StepFailed(f"the switch answered success but the server still reports role {live} after "
                              f"{step.deadline_s:g} s", safe=None, status=502)
        return StepFailed(f"the server's role could not be confirmed within {step.deadline_s:g} s "
                          f"(it reports {live or 'nothing'})", safe=False, status=504)
