"""Control routes: abort, pause/continue, flush_cache, weight updates (with the weight write lock).

Semantics of SGLang 0.5.23 (older versions where ``--sglang-version`` says so):
- ``/abort_request`` answers 200 with no body at once; the rid must be live exactly, then every
  live rid starting with it is aborted (0.5.23 TokenizerManager + Scheduler).
- weight updates take the write lock unless the server is paused: they wait for every in-flight
  call, and new calls queue behind them. ``abort_all_requests`` aborts first.
- a weight update flushes the cache afterwards; if requests are still there it answers 400
  "Weights were updated, but the cache was not flushed ..." — the weights did change.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import TYPE_CHECKING, Any, Callable

from aiohttp import web

from . import outputs
from .httputil import empty_response, is_response, json_response, read_json, require_fields, text_response

if TYPE_CHECKING:
    from .server import Server

FLUSH_OK = ("Cache flushed.\nPlease check backend logs for more details. "
            "(When there are running or waiting requests, the operation will not be performed.)\n")
FLUSH_FAILED = "Flush cache failed.\n"
CACHE_NOT_FLUSHED = ("Weights were updated, but the cache was not flushed because requests are still running "
                     "or queued. Retract or finish them, then call /flush_cache.")
PAUSE_MODES = ("abort", "retract", "in_place")


def add_routes(router: web.UrlDispatcher, worker: "Server") -> None:
    c = Control(worker)
    v = worker.config
    router.add_post("/abort_request", c.abort_request)
    router.add_post("/pause_generation", c.pause_generation)
    router.add_post("/continue_generation", c.continue_generation)
    router.add_get("/flush_cache", c.flush_cache)
    router.add_post("/flush_cache", c.flush_cache)
    router.add_post("/update_weights_from_disk", c.update_weights_from_disk)
    router.add_post("/update_weights_from_distributed", c.update_weights_from_distributed)
    router.add_post("/update_weights_from_tensor", c.update_weights_from_tensor)
    router.add_post("/init_weights_update_group", c.init_weights_update_group)
    if v.at_least("0.5.6"):
        router.add_post("/destroy_weights_update_group", c.destroy_weights_update_group)
        router.add_post("/update_weight_version", c.update_weight_version)
    if v.at_least("0.5.23"):
        router.add_post("/begin_weight_update", c.begin_weight_update)
        router.add_post("/end_weight_update", c.end_weight_update)
    for method in ("GET", "POST"):  # SGLang's api_route takes both
        router.add_route(method, "/release_memory_occupation", c.release_memory_occupation)
        router.add_route(method, "/resume_memory_occupation", c.resume_memory_occupation)


MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")  # GPU_MEMORY_ALL_TYPES


class Control:
    def __init__(self, worker: "Server") -> None:
        self.worker = worker
        self.engine = worker.engine
        self.groups: set[str] = set()

    # ------------------------------------------------------------ abort

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await read_json(request, handler="abort_request")
        if is_response(body):
            return body
        if not isinstance(body, dict):
            return json_response(outputs.validation_error(request.path, "abort_request", [
                {"type": "model_type", "loc": ("body",), "msg": "Input should be an object", "input": body}]), 400)
        self.engine.abort(rid=body.get("rid") or "", abort_all=bool(body.get("abort_all", False)))
        return empty_response()

    # ------------------------------------------------------------ pause

    async def pause_generation(self, request: web.Request) -> web.Response:
        cfg = self.worker.config
        if not cfg.at_least("0.5.6"):  # 0.4.9: no body, no modes: pause new calls and abort all
            self.engine.is_pause = True
            self.engine._unpaused.clear()
            self.engine.abort(abort_all=True)
            return json_response({"message": "Generation paused successfully.", "status": "ok"})
        body = await read_json(request, handler="pause_generation")
        if is_response(body):
            return body
        mode = body.get("mode", "abort") if isinstance(body, dict) else None
        if mode not in PAUSE_MODES:
            return json_response(outputs.not_a_choice(request.path, "pause_generation", "PauseGenerationReqInput",
                                                      "mode", mode, body, PAUSE_MODES), 400)
        await self.engine.pause(mode)
        return json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        if self.worker.config.at_least("0.5.6"):
            body = await read_json(request, handler="continue_generation")
            if is_response(body):
                return body
        self.engine.resume()
        return json_response({"message": "Generation continued successfully.", "status": "ok"})

    # ------------------------------------------------------------ cache

    def _idle_for_flush(self) -> bool:
        return self.engine.is_fully_idle(ignore_waiting=self.engine.pause_mode is not None)

    def _flushed(self) -> web.Response:
        self.engine.flush_prefix_cache()
        return text_response(FLUSH_OK)

    async def flush_cache(self, request: web.Request) -> web.Response:
        cfg = self.worker.config
        if not cfg.at_least("0.5.23"):
            return self._flushed() if self._idle_for_flush() else text_response(FLUSH_OK, 400)
        try:
            timeout = float(request.query.get("timeout", "0") or 0)
        except ValueError:
            return json_response({"detail": [{"type": "float_parsing", "loc": ["query", "timeout"],
                                              "msg": "Input should be a valid number"}]}, 422)
        if self.engine.flush_pending:
            return text_response("Another flush_cache is already in progress.", 400)
        if self._idle_for_flush():
            return self._flushed()
        if timeout <= 0:
            return text_response(FLUSH_FAILED, 400)
        self.engine.flush_pending = True
        try:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                await asyncio.sleep(min(0.02, max(0.0, deadline - time.monotonic())))
                if self._idle_for_flush():
                    return self._flushed()
            return text_response("Timed out waiting for idle state.", 400)
        finally:
            self.engine.flush_pending = False

    # ------------------------------------------------------------ weights

    def _model_path_ok(self, path: str) -> bool:
        cfg = self.worker.config
        return path in (cfg.model_path, self.engine.model_path) or path.startswith("sim/") or os.path.exists(path)

    async def _locked(self, fn: Any) -> Any:
        engine = self.engine
        return await engine.write_locked(fn, paused=engine.is_pause)

    async def _delay(self) -> None:
        """`update_delay_s` from the moment the update holds the lock, read again while it waits: a test holds
        an update with a long delay and releases it by setting a short one (no race against the clock)."""
        started = time.monotonic()
        while (left := started + self.worker.faults.faults.update_delay_s - time.monotonic()) > 0:
            await asyncio.sleep(min(left, 0.05))

    def _after_update(self, body: dict, success: bool, message: str) -> tuple[bool, str]:
        """Scheduler side: record the version, flush; tokenizer side: the version /model_info shows."""
        engine = self.engine
        if success:
            engine.set_weight_version(body.get("weight_version"))
            engine.counters.weight_updates += 1
            if body.get("flush_cache", True):
                if not self.engine.is_fully_idle(ignore_waiting=engine.pause_mode is not None):
                    success, message = False, CACHE_NOT_FLUSHED
                else:
                    engine.flush_prefix_cache()
        if success and body.get("weight_version") is not None:
            engine.model_version = body["weight_version"]
            message += f" Weight version updated to {body['weight_version']}."
        return success, message

    def _session_check(self, what: str) -> str | None:
        if self.worker.config.at_least("0.5.23") and not self.engine.weight_session_open:
            return f"{what} must run between begin_weight_update() and end_weight_update()"
        return None

    async def _update_weights(self, request: web.Request, handler: str, input_type: str, fields: tuple[str, ...],
                              *, session: bool, failure: str, apply: Callable[[dict], tuple[bool, str]],
                              extra: dict | None = None) -> web.Response:
        """The three update routes alike: validate, abort first if asked, then under the write lock (the weight
        session checked where the version needs it): delay, injected failure, the route's own step."""
        body = await read_json(request, handler=handler)
        if is_response(body):
            return body
        bad = require_fields(request, body, handler, input_type, *fields)
        if bad is not None:
            return bad
        if body.get("abort_all_requests"):
            self.engine.abort(abort_all=True)

        async def update() -> tuple[bool, str]:
            problem = self._session_check(handler) if session else None
            if problem:
                return False, problem
            await self._delay()
            if self.worker.faults.faults.update_failure:
                return False, failure
            return apply(body)

        success, message = await self._locked(update)
        return json_response({"success": success, "message": message, **(extra or {})}, 200 if success else 400)

    def _load_from_disk(self, body: dict) -> tuple[bool, str]:
        if not self._model_path_ok(body["model_path"]):
            return False, "Failed to get weights iterator: [Errno -2] Name or service not known."
        self.engine.model_path = body["model_path"]
        return self._after_update(body, True, "Succeeded to update model weights.")

    def _receive_from_group(self, body: dict) -> tuple[bool, str]:
        group = body.get("group_name", "weight_update_group")
        if group not in self.groups:
            return False, f"Failed to receive weights: group {group!r} is not initialized"
        return self._after_update(body, True, "Succeeded to update parameter online.")

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        return await self._update_weights(
            request, "update_weights_from_disk", "UpdateWeightFromDiskReqInput", ("model_path",), session=False,
            failure="Failed to get weights iterator: simulated update failure.", apply=self._load_from_disk,
            extra={"num_paused_requests": 0})

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        return await self._update_weights(
            request, "update_weights_from_distributed", "UpdateWeightsFromDistributedReqInput",
            ("names", "dtypes", "shapes"), session=True,
            failure="Failed to receive weights: simulated update failure", apply=self._receive_from_group)

    async def update_weights_from_tensor(self, request: web.Request) -> web.Response:
        return await self._update_weights(
            request, "update_weights_from_tensor", "UpdateWeightsFromTensorReqInput", ("serialized_named_tensors",),
            session=True, failure="Failed to update weights: simulated update failure",
            apply=lambda body: self._after_update(body, True, "Success"))

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        body = await read_json(request, handler="init_weights_update_group")
        if is_response(body):
            return body
        bad = require_fields(request, body, "init_weights_update_group", "InitWeightsUpdateGroupReqInput",
                             "master_address", "master_port", "rank_offset", "world_size")
        if bad is not None:
            return bad
        self.groups.add(body.get("group_name", "weight_update_group"))
        return json_response({"success": True, "message": "Succeeded to initialize custom process group."})

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        body = await read_json(request, handler="destroy_weights_update_group")
        if is_response(body):
            return body
        group = body.get("group_name", "weight_update_group") if isinstance(body, dict) else None
        if group in self.groups:
            self.groups.discard(group)
            return json_response({"success": True, "message": "Succeeded to destroy custom process group."})
        return json_response({"success": False, "message": "The group to be destroyed does not exist."}, 400)

    async def _session_call(self, opening: bool) -> tuple[bool, str]:
        async def call() -> tuple[bool, str]:
            if opening and self.engine.weight_session_open:
                return False, "a weight-update session is already open; call end_weight_update() first"
            if not opening and not self.engine.weight_session_open:
                return False, "no weight-update session is open; call begin_weight_update() first"
            self.engine.weight_session_open = opening
            return True, "Success"

        return await self._locked(call)

    async def begin_weight_update(self, request: web.Request) -> web.Response:
        body = await read_json(request, handler="begin_weight_update")
        if is_response(body):
            return body
        success, message = await self._session_call(True)
        return json_response({"success": success, "message": message}, 200 if success else 400)

    async def end_weight_update(self, request: web.Request) -> web.Response:
        body = await read_json(request, handler="end_weight_update")
        if is_response(body):
            return body
        success, message = await self._session_call(False)
        return json_response({"success": success, "message": message}, 200 if success else 400)

    async def update_weight_version(self, request: web.Request) -> web.Response:
        body = await read_json(request, handler="update_weight_version")
        if is_response(body):
            return body
        bad = require_fields(request, body, "update_weight_version", "UpdateWeightVersionReqInput", "new_version")
        if bad is not None:
            return bad
        if body.get("abort_all_requests", True):
            self.engine.abort(abort_all=True)
        version = str(body["new_version"])
        self.engine.set_weight_version(version)
        self.engine.model_version = version
        return json_response({"success": True, "message": f"Weight version updated to {version}",
                              "new_version": version})

    # ------------------------------------------------------------ memory (RL colocation)

    async def _memory_tags(self, request: web.Request, handler: str) -> Any:
        body = await read_json(request, handler=handler) if request.body_exists else {}
        if is_response(body):
            return body
        tags = body.get("tags") if isinstance(body, dict) else None
        if tags is not None and (not isinstance(tags, list) or not all(isinstance(t, str) for t in tags)):
            return json_response({"error": {"message": "tags must be a list of strings or null"}}, 400)
        return set(tags or MEMORY_TAGS)

    async def release_memory_occupation(self, request: web.Request) -> web.Response:
        """0.5.23: the scheduler asserts it is idle (a paused server's queue does not count); success answers
        200 with a null body (the handler returns nothing), a failure 400 ``{"error": {"message"}}``."""
        tags = await self._memory_tags(request, "release_memory_occupation")
        if is_response(tags):
            return tags
        if not self.engine.is_fully_idle(ignore_waiting=self.engine.is_pause):
            return json_response({"error": {"message": "release_memory_occupation should be called only when "
                                                       "server is idle."}}, 400)
        self.engine.released_memory |= tags
        return json_response(None)

    async def resume_memory_occupation(self, request: web.Request) -> web.Response:
        tags = await self._memory_tags(request, "resume_memory_occupation")
        if is_response(tags):
            return tags
        self.engine.released_memory -= tags
        return json_response(None)
