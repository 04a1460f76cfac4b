"""Test-only routes under ``/_sim/`` (not part of SGLang): state to assert on, faults to inject.

- ``GET /_sim/state``: role, pause, weight versions, live rids by phase, rooms, counters
  (requests by route, aborts received and matched, KV pulls, disconnects, ...).
- ``GET /_sim/faults``; ``POST /_sim/faults`` merges fields (``{"reset": true}`` first clears);
  ``DELETE /_sim/faults`` clears.
- ``POST /_sim/reset_counters``.
- ``GET /_sim/traces``: the W3C trace context (``traceparent``, ``tracestate``) of the newest generation calls
  that carried one, with their rids and bootstrap rooms (what a tracing SGLang would parent its spans on).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from aiohttp import web

from .requests import DECODE, FORWARD, QUEUED, RETRACTED, WAITING, Counters
from .httputil import json_response, read_json, is_response

if TYPE_CHECKING:
    from .engine import Engine
    from .server import Server


def add_routes(router: web.UrlDispatcher, worker: "Server") -> None:
    api = SimApi(worker)
    router.add_get("/_sim/state", api.state)
    router.add_get("/_sim/faults", api.get_faults)
    router.add_post("/_sim/faults", api.set_faults)
    router.add_delete("/_sim/faults", api.clear_faults)
    router.add_post("/_sim/reset_counters", api.reset_counters)
    router.add_get("/_sim/traces", api.traces)


class SimApi:
    def __init__(self, worker: "Server") -> None:
        self.worker = worker

    async def state(self, request: web.Request) -> web.Response:
        worker = self.worker
        snap = engine_snapshot(worker.engine)
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

    async def traces(self, request: web.Request) -> web.Response:
        return json_response({"calls": list(self.worker.trace_headers)})

    async def get_faults(self, request: web.Request) -> web.Response:
        return json_response(self.worker.faults.faults.as_dict())

    async def set_faults(self, request: web.Request) -> web.Response:
        body = await read_json(request, handler="sim_faults")
        if is_response(body):
            return body
        if not isinstance(body, dict):
            return json_response({"error": {"message": "body must be a JSON object"}}, 400)
        try:
            faults = self.worker.set_faults(body)
        except (TypeError, ValueError) as exc:
            return json_response({"error": {"message": str(exc)}}, 400)
        return json_response(faults.as_dict())

    async def clear_faults(self, request: web.Request) -> web.Response:
        return json_response(self.worker.set_faults({"reset": True}).as_dict())

    async def reset_counters(self, request: web.Request) -> web.Response:
        self.worker.engine.counters = Counters()
        return json_response({"success": True})


def engine_snapshot(engine: "Engine") -> dict[str, Any]:
    """Everything a router test may want to assert on (``GET /_sim/state``)."""
    by_phase: dict[str, list[str]] = {}
    undispatched = []
    for req in engine.requests.values():
        if req.dispatched:
            by_phase.setdefault(req.phase, []).append(req.rid)
        else:
            undispatched.append(req.rid)
    return {
        "role": engine.role,
        "paused": engine.is_pause,
        "pause_mode": engine.pause_mode,
        "weight_version": engine.weight_version,
        "model_version": engine.model_version,
        "unhealthy": engine.unhealthy,
        "inflight_calls": engine.inflight_calls,
        "running_rids": by_phase.get(DECODE, []) + by_phase.get(FORWARD, []),
        "waiting_rids": by_phase.get(WAITING, []) + by_phase.get(QUEUED, []) + by_phase.get(RETRACTED, []),
        "rids_by_phase": by_phase,
        "undispatched_rids": undispatched,  # parked behind a pause or a weight update
        "weight_lock": {"readers": engine.lock.readers, "writer": engine.lock.writer,
                        "waiting_writers": engine.lock.waiting_writers},
        "weight_session_open": engine.weight_session_open,
        "released_memory": sorted(engine.released_memory),
        "rooms": engine.rooms.snapshot(),
        "kv_reserved_tokens": engine.used_tokens,  # admission: input + max_new_tokens of each running item
        "deferred_release_s": max(0.0, round(engine.deferred_release_until - time.monotonic(), 3)),
        "counters": engine.counters.__dict__.copy(),
        "capacity": [{"forwards": f.forwards, "waiting_for_forward": len(f.queue), "forwarding": f.running,
                      "decode_batch": b.size, "queued_for_batch": len(b.queued), "decode_steps": int(b.moments[0])}
                     for f, b in zip(engine.forwards, engine.batches)],
    }
