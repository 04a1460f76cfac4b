"""Role switching, both server APIs (``--api 0.5.23`` or ``--api convert``).

- 0.5.23 ``POST /pd_role_switch`` (needs ``--enable-pd-role-switch``): refused unless fully idle;
  ``safe_to_restore`` is true on refusals and **false on success** (as on the real server);
  switching to decode needs ``decode_cuda_graph_memory_gb``; the same role answers "ok";
  ``prepare_only`` answers "ready". The bootstrap listener stays open: once it served a prefill
  it keeps answering as one (a stale registration), so decode legs pointed at it hang until
  their deadline, as they do on real servers.
- ``--api patched``: 0.5.23 with server_patches: ``/pd_role_switch`` as above, and ``POST /convert_pd_role``
  over the same in-place switch with server_patches' contract (``server_patches.convert_contract``: strict
  body, the bootstrap port never moves, ``check_idle``, answers with ``old_role``/``new_role``/
  ``safe_to_restore``); ``GET /convert_pd_role`` shows a conversion in progress (a second one gets 409).
- earlier design ``POST /convert_pd_role``: decode->prefill opens a new bootstrap listener on the
  first free port from ``--convert-bootstrap-base`` and reports it; prefill->decode closes it.
  ``check_idle`` means what server_patches' endpoint makes it mean on 0.5.23: check that the server is
  idle before converting. ``true`` (the default) refuses at once when busy; ``false`` waits until it is
  idle, up to ``idle_timeout_s`` (default 30), then converts (or refuses at that deadline).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from server_patches import convert_contract as contract

from . import outputs
from .bootstrap import first_free_port
from .httputil import is_response, json_response, read_json

if TYPE_CHECKING:
    from .server import Server

SIM_FAULT = "simulated conversion failure"
DEFAULT_IDLE_TIMEOUT_S = 30.0
MAX_IDLE_TIMEOUT_S = 600.0
IDLE_POLL_S = 0.01


def add_routes(router: web.UrlDispatcher, worker: "Server") -> None:
    switcher = RoleSwitcher(worker)
    if worker.config.api == "convert":
        router.add_post("/convert_pd_role", switcher.convert_pd_role)
    elif worker.config.at_least("0.5.23"):
        router.add_post("/pd_role_switch", switcher.pd_role_switch)
        if worker.config.api == "patched":
            router.add_post("/convert_pd_role", switcher.convert_pd_role_patched)
            router.add_get("/convert_pd_role", switcher.conversion_state)


class RoleSwitcher:
    def __init__(self, worker: "Server") -> None:
        self.worker = worker
        self.engine = worker.engine
        self.waiting_for_idle = False  # a /convert_pd_role with check_idle false is waiting for the drain
        self.patched_conversion: dict | None = None  # --api patched: the conversion in progress
        worker.role_switcher = self
        self.arriving = 0  # switch calls held by the switch_arrival_delay_s fault

    # ------------------------------------------------------------ 0.5.23

    def _answer(self, success: bool, message: str, old: str, new: str, safe: bool) -> web.Response:
        return json_response({"rid": None, "http_worker_ipc": None, "success": success, "message": message,
                              "old_role": old, "new_role": new, "safe_to_restore": safe},
                             200 if success else 400)

    async def pd_role_switch(self, request: web.Request) -> web.Response:
        if not await self._arrived(request):
            return web.Response(status=499)  # nobody reads it: its client is gone
        body = await read_json(request, handler="pd_role_switch")
        if is_response(body):
            return body
        if not isinstance(body, dict):
            body = {}
        new = body.get("new_role", "")
        if new not in ("prefill", "decode", ""):
            return json_response(outputs.not_a_choice(request.path, "pd_role_switch", "PdRoleSwitchReqInput",
                                                      "new_role", new, body, ("prefill", "decode", "")), 400)
        engine = self.engine
        old = engine.role
        if not self.worker.config.enable_pd_role_switch:
            return self._answer(False, "--enable-pd-role-switch is not set on this server", old, new, True)
        rejection = self._reject_reason(new)
        if rejection is not None:
            return self._answer(False, rejection[0], old, new, rejection[1])
        if new == old:
            return self._answer(True, "ok", old, new, False)
        if not engine.is_fully_idle():
            return self._answer(False, "instance is not idle; drain all requests before switching", old, new, True)
        if new == "decode":
            gb = body.get("decode_cuda_graph_memory_gb")
            if gb is None:
                return self._answer(False, "decode_cuda_graph_memory_gb is required before capturing decode graphs",
                                    old, new, True)
            if gb < 0:
                return self._answer(False, "decode_cuda_graph_memory_gb must be non-negative", old, new, True)
        fault = self.worker.faults.faults.conversion_failure
        if fault == "safe":
            return self._answer(False, f"failed to check decode CUDA graph headroom: {SIM_FAULT}", old, new, True)
        if body.get("prepare_only"):
            return self._answer(True, "ready", old, new, True)
        engine.switch_in_progress = True
        try:
            if self.worker.config.role_switch_s:
                await asyncio.sleep(self.worker.config.role_switch_s)
            if fault == "unsafe":
                engine.unhealthy = True
                return self._answer(False, f"role switch failed; instance unhealthy, restart required: {SIM_FAULT}",
                                    old, new, False)
            await self._become(new)
        finally:
            engine.switch_in_progress = False
        return self._answer(True, "ok", old, new, False)

    async def _arrived(self, request: web.Request) -> bool:
        """After the `switch_arrival_delay_s` fault: False when the caller left meanwhile."""
        faults = self.worker.faults.faults
        delay, faults.switch_arrival_delay_s = faults.switch_arrival_delay_s, 0.0  # one call's
        loop = asyncio.get_running_loop()
        deadline = loop.time() + delay
        self.arriving += delay > 0
        try:
            while loop.time() < deadline:
                if request.transport is None or request.transport.is_closing():
                    return False
                await asyncio.sleep(0.01)  # a cadence: a closed connection says nothing to a waiting handler
            return True
        finally:
            self.arriving -= delay > 0

    def _reject_reason(self, new: str) -> tuple[str, bool] | None:
        engine = self.engine
        if engine.unhealthy:
            return "instance is unhealthy after a failed role switch; restart required", False
        if engine.switch_in_progress:
            return "another role switch is already in progress", False
        if new not in ("prefill", "decode"):
            return f"invalid new_role={new!r}", True
        if engine.role == "null":
            return "instance is not running in PD disaggregation mode", True
        return None

    async def _become(self, role: str) -> None:
        worker = self.worker
        self.engine.role = role
        self.engine.counters.role_switches += 1
        if role == "prefill":
            if worker.listener is None:
                port = worker.launch_bootstrap_port if worker.launch_bootstrap_port is not None else 0
                await worker.open_listener(port, registered=True)
            worker.listener.registered = True  # type: ignore[union-attr]

    # ------------------------------------------------------------ earlier design

    async def convert_pd_role(self, request: web.Request) -> web.Response:
        body = await read_json(request, handler="convert_pd_role")
        if is_response(body):
            return body
        if not isinstance(body, dict):
            body = {}
        engine = self.engine
        check_idle = body.get("check_idle", True)
        idle_timeout = body.get("idle_timeout_s", DEFAULT_IDLE_TIMEOUT_S)
        if not isinstance(check_idle, bool):
            return self._convert_answer(False, f"check_idle must be a boolean, got {check_idle!r}", None)
        if isinstance(idle_timeout, bool) or not isinstance(idle_timeout, (int, float)) or \
                not 0 < idle_timeout <= MAX_IDLE_TIMEOUT_S:
            return self._convert_answer(
                False, f"idle_timeout_s must be a number in (0, {MAX_IDLE_TIMEOUT_S:g}], got {idle_timeout!r}", None)
        if engine.unhealthy:
            return self._convert_answer(False, "The server is unhealthy after a failed conversion.", None)
        if engine.role == "null":
            return self._convert_answer(False, "The server is not running in PD disaggregation mode.", None)
        if not await self._idle(wait_s=0.0 if check_idle else float(idle_timeout)):
            waited = "" if check_idle else f" after waiting {idle_timeout:g} s"
            return self._convert_answer(
                False, f"The server is not idle{waited}, please drain it before converting.", None)
        fault = self.worker.faults.faults.conversion_failure
        if fault is not None:
            if fault == "unsafe":
                engine.unhealthy = True
            return self._convert_answer(False, f"Failed to convert the role: {SIM_FAULT}.", None)
        if self.worker.config.role_switch_s:
            await asyncio.sleep(self.worker.config.role_switch_s)
        engine.counters.role_switches += 1
        if engine.role == "prefill":
            await self.worker.close_listener()
            engine.role = "decode"
            return self._convert_answer(True, "The role of this server is now DECODE.", body.get("bootstrap_port"))
        port = first_free_port(self.worker.config.host, self.worker.config.convert_bootstrap_base)
        await self.worker.open_listener(port, registered=True)
        engine.role = "prefill"
        return self._convert_answer(True, "The role of this server is now PREFILL.", self.worker.bootstrap_port)

    async def _idle(self, wait_s: float) -> bool:
        """Whether the server is idle now, or becomes idle within wait_s."""
        engine = self.engine
        deadline = asyncio.get_running_loop().time() + wait_s
        try:
            while not (engine.is_fully_idle() and not engine.requests):
                if asyncio.get_running_loop().time() >= deadline:
                    return False
                self.waiting_for_idle = True  # shown in /_sim/state
                await asyncio.sleep(IDLE_POLL_S)
            return True
        finally:
            self.waiting_for_idle = False

    # ------------------------------------------------------------ 0.5.23 with server_patches

    async def convert_pd_role_patched(self, request: web.Request) -> web.Response:
        """server_patches.runtime.convert_endpoint's answers, over this simulator's in-place switch."""
        worker, engine = self.worker, self.engine
        port = worker.launch_bootstrap_port

        def respond(status: int, success: bool, message: str, **kw: Any) -> web.Response:
            return json_response(contract.answer(success, message, port, error=not success, **kw), status)

        raw = await request.read()
        try:
            req = contract.parse_convert_request(orjson.loads(raw) if raw.strip() else {})
        except (contract.BadConvertRequest, orjson.JSONDecodeError) as e:
            message = str(e) if isinstance(e, contract.BadConvertRequest) else f"body is not valid JSON: {e}"
            return respond(400, False, message)
        problem = contract.bootstrap_port_problem(req, port)
        if problem:
            return respond(400, False, problem)
        if self.patched_conversion is not None:
            return respond(409, False, "another conversion of this server is in progress")
        old = engine.role
        no_cache = self.worker.config.prefix_cache_tokens == 0
        view = contract.ServerView(role=old, bootstrap_port=port or 0,
                                   radix_cache_disabled_in={"prefill": no_cache, "decode": True},
                                   cuda_graph_disabled=True, device="cpu")
        try:
            plan = contract.plan_conversion(req, view)
        except contract.ConversionRefused as e:
            return respond(400, False, str(e), old_role=old)
        self.patched_conversion = {"started": asyncio.get_running_loop().time(), "old_role": old,
                                   "new_role": plan.new_role}
        try:
            rejection = self._reject_reason(plan.new_role)
            if rejection is not None:
                return respond(400, False, rejection[0], old_role=old, new_role=plan.new_role,
                               safe_to_restore=rejection[1])
            if not await self._idle(plan.idle_wait_s):
                return respond(400, False, "instance is not idle; drain all requests before switching",
                               old_role=old, new_role=plan.new_role, safe_to_restore=True)
            engine.switch_in_progress = True
            try:
                if worker.config.role_switch_s:
                    await asyncio.sleep(worker.config.role_switch_s)
                await self._become(plan.new_role)
            finally:
                engine.switch_in_progress = False
            return json_response(contract.answer(True, f"converted {old} -> {plan.new_role}", port, old_role=old,
                                                 new_role=plan.new_role, safe_to_restore=False))
        finally:
            self.patched_conversion = None

    async def conversion_state(self, request: web.Request) -> web.Response:
        current = self.patched_conversion or {}
        return json_response({
            "in_progress": bool(current), "old_role": current.get("old_role"), "new_role": current.get("new_role"),
            "waiting_for_idle": self.waiting_for_idle,
            "elapsed_s": round(asyncio.get_running_loop().time() - current["started"], 3) if current else None,
            "role": self.engine.role, "bootstrap_port": self.worker.launch_bootstrap_port,
        })

    def _convert_answer(self, success: bool, message: str, port: Any) -> web.Response:
        return json_response({"success": success, "message": message, "bootstrap_port": port},
                             200 if success else 400)
