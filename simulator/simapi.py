"""Test-only routes under ``/_sim/`` (not part of SGLang): state to assert on, faults to inject.

- ``GET /_sim/state``: role, pause, weight versions, live rids by phase, rooms, counters
  (requests by route, aborts received and matched, KV pulls, disconnects, ...).
- ``GET /_sim/faults``; ``POST /_sim/faults`` merges fields (``{"reset": true}`` first clears);
  ``DELETE /_sim/faults`` clears.
- ``POST /_sim/reset_counters``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

from .engine import Counters
from .httputil import json_response, read_json, is_response

if TYPE_CHECKING:
    from .worker import Worker


def add_routes(router: web.UrlDispatcher, worker: "Worker") -> None:
    api = SimApi(worker)
    router.add_get("/_sim/state", api.state)
    router.add_get("/_sim/faults", api.get_faults)
    router.add_post("/_sim/faults", api.set_faults)
    router.add_delete("/_sim/faults", api.clear_faults)
    router.add_post("/_sim/reset_counters", api.reset_counters)


class SimApi:
    def __init__(self, worker: "Worker") -> None:
        self.worker = worker

    async def state(self, request: web.Request) -> web.Response:
        worker = self.worker
        snap = worker.engine.snapshot()
        snap.update({
            "url": worker.url,
            "port": worker.port,
            "bootstrap_port": worker.bootstrap_port,
            "launch_bootstrap_port": worker.launch_bootstrap_port,
            "listener_registered": bool(worker.listener and worker.listener.registered),
            "api": worker.config.api,
            "sglang_version": worker.config.sglang_version,
            "faults": worker.faults.faults.as_dict(),
            "convert_waiting_for_idle": bool(worker.role_switcher and worker.role_switcher.waiting_for_idle),
            "switching": worker.engine.switch_in_progress,
            "switch_calls_arriving": worker.role_switcher.arriving if worker.role_switcher else 0,
        })
        return json_response(snap)

    async def get_faults(self, request: web.Request) -> web.Response:
        return json_response(self.worker.faults.faults.as_dict())

    async def set_faults(self, request: web.Request) -> web.Response:
        body = await read_json(request, handler="sim_faults")
        if is_response(body):
            return body
        if not isinstance(body, dict):
            return json_response({"error": {"message": "body must be a JSON object"}}, 400)
        try:
            faults = self.worker.faults.update(body)
        except (TypeError, ValueError) as exc:
            return json_response({"error": {"message": str(exc)}}, 400)
        self.worker.engine.wake_all()  # a cleared hang lets parked requests go on
        return json_response(faults.as_dict())

    async def clear_faults(self, request: web.Request) -> web.Response:
        faults = self.worker.faults.update({"reset": True})
        self.worker.engine.wake_all()
        return json_response(faults.as_dict())

    async def reset_counters(self, request: web.Request) -> web.Response:
        self.worker.engine.counters = Counters()
        return json_response({"success": True})
