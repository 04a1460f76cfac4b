"""Role switching, both server APIs (``--api 0.5.23`` or ``--api convert``).

- 0.5.23 ``POST /pd_role_switch`` (needs ``--enable-pd-role-switch``): refused unless fully idle;
  ``safe_to_restore`` is true on refusals and **false on success** (as on the real server);
  switching to decode needs ``decode_cuda_graph_memory_gb``; the same role answers "ok";
  ``prepare_only`` answers "ready". The bootstrap listener stays open: once it served a prefill
  it keeps answering as one (a stale registration), so decode legs pointed at it hang until
  their deadline, as they do on real servers.
- earlier design ``POST /convert_pd_role``: decode->prefill opens a new bootstrap listener on the
  first free port from ``--convert-bootstrap-base`` and reports it; prefill->decode closes it.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from aiohttp import web

from . import outputs
from .bootstrap import first_free_port
from .httputil import is_response, json_response, read_json

if TYPE_CHECKING:
    from .worker import Worker

SIM_FAULT = "simulated conversion failure"


def add_routes(router: web.UrlDispatcher, worker: "Worker") -> None:
    switcher = RoleSwitcher(worker)
    if worker.config.api == "convert":
        router.add_post("/convert_pd_role", switcher.convert_pd_role)
    elif worker.config.at_least("0.5.23"):
        router.add_post("/pd_role_switch", switcher.pd_role_switch)


class RoleSwitcher:
    def __init__(self, worker: "Worker") -> None:
        self.worker = worker
        self.engine = worker.engine

    # ------------------------------------------------------------ 0.5.23

    def _answer(self, success: bool, message: str, old: str, new: str, safe: bool) -> web.Response:
        return json_response({"rid": None, "http_worker_ipc": None, "success": success, "message": message,
                              "old_role": old, "new_role": new, "safe_to_restore": safe},
                             200 if success else 400)

    async def pd_role_switch(self, request: web.Request) -> web.Response:
        body = await read_json(request, handler="pd_role_switch")
        if is_response(body):
            return body
        if not isinstance(body, dict):
            body = {}
        new = body.get("new_role", "")
        if new not in ("prefill", "decode", ""):
            return json_response(outputs.validation_error(request.path, "pd_role_switch", [
                {"type": "is_instance_of", "loc": ("body", "is-instance[PdRoleSwitchReqInput]"),
                 "msg": "Input should be an instance of PdRoleSwitchReqInput", "input": body,
                 "ctx": {"class": "PdRoleSwitchReqInput"}},
                {"type": "literal_error", "loc": ("body", "function-after[build_struct(), PdRoleSwitchReqInput]",
                                                  "new_role"),
                 "msg": "Input should be 'prefill', 'decode' or ''", "input": new,
                 "ctx": {"expected": "'prefill', 'decode' or ''"}}]), 400)
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
        idle = engine.is_fully_idle() and not engine.requests
        if body.get("check_idle"):
            return self._convert_answer(idle, "The server is idle." if idle else "The server is not idle.",
                                        None)
        if engine.unhealthy:
            return self._convert_answer(False, "The server is unhealthy after a failed conversion.", None)
        if engine.role == "null":
            return self._convert_answer(False, "The server is not running in PD disaggregation mode.", None)
        if not idle:
            return self._convert_answer(False, "The server is not idle, please drain it before converting.", None)
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

    def _convert_answer(self, success: bool, message: str, port: Any) -> web.Response:
        return json_response({"success": success, "message": message, "bootstrap_port": port},
                             200 if success else 400)
