"""A programmable stand-in for one SGLang server, for the few router tests the simulator cannot serve.

Router tests run against simulated workers (`sim_workers` in tests/conftest.py: the simulator, with its faults
and its Journal of what it received). This fake is for what no faithful server does, so no fault of the
simulator's should do it either:
- answers it makes up: fixed token ids, logprob shapes and chunk counts, error bodies and texts a test names,
  launch arguments and message suffixes planted in its info (what redaction must hide);
- PD legs that do not depend on each other: a decode that answers while its prefill failed or hangs, a prefill
  leg held open after its decode answered, any bootstrap port or room accepted, `n > 1` served (0.5.23's decode
  never finishes one);
- a programmable role switch: not-idle refusals, a switch that changes nothing, never answers or answers late,
  no switch API at all, the convert API's moved bootstrap port;
- a server that reports what it was not started with (a bootstrap port, a role), or holds its info routes behind
  a gate.
Which test modules may use it: tests/test_layout.py (FAKE_WORKER_USERS). It does not implement the PD transfer.
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass

import orjson
from aiohttp import web


@dataclass
class Behaviour:
    status: int = 200  # status of /generate-like answers
    error_body: dict | None = None
    hang: bool = False  # never answer (until released), aborts ignored
    stream_chunks: int = 3
    cut_after: int | None = None  # streaming: close the connection after this many chunks
    stall_after: int | None = None  # streaming: stop sending after this many chunks (until release)
    delay_s: float = 0.0
    health_status: int = 200  # status of GET /health
    # A request carrying this body field gets 500 (with its rid and room in the message, as a server quotes
    # them), as a stand-in that fails on an input it cannot handle: every server fails on it the same way.
    fail_on_field: str | None = None
    close_on_field: str | None = None  # ... closes the connection without answering, as a server it crashes
    error_text: str | None = None  # with `status`: a text/plain error body instead of JSON


INFO_PATHS = frozenset({"/server_info", "/get_server_info", "/model_info", "/get_model_info", "/v1/models",
                        "/health_generate"})


class FakeWorker:
    def __init__(self, role: str, *, bootstrap_port: int | None = 8998, weight_version: str = "default",
                 api: str = "0.5.23"):
        self.role = role
        self.launch_role = role  # /server_info's top level keeps the launch role, as 0.5.23 does
        # Role switching: "0.5.23" serves /pd_role_switch, "convert" the earlier design's /convert_pd_role,
        # "patched" both (0.5.23 with server_patches: /convert_pd_role reports the port that never moves).
        self.api = api
        self.switch_calls: list[dict] = []
        self.switch_paths: list[str] = []
        # "safe" | "unsafe" | "noop" (success without changing role) | "hang" (no answer) | "late" (switches,
        # then never answers)
        self.switch_fault: str | None = None
        self.not_idle_refusals = 0  # refuse this many switches as "not idle" (like 0.5.23's deferred KV release)
        self.convert_bootstrap_port = 9500  # the port a decode converted by /convert_pd_role reports
        self.bootstrap_port = bootstrap_port
        self.weight_version = weight_version
        self.behaviour = Behaviour()
        # Launch arguments added to /server_info (top level and internal state, as SGLang reports them), e.g.
        # the keys a real server shows there, and to /model_info and /v1/models (which a later server could
        # grow), so a test sees every relay of them; text added to the messages of control answers.
        self.server_args: dict = {}
        self.message_suffix = ""
        self.calls: collections.Counter[str] = collections.Counter()  # requests received, by path
        self.queries: list[tuple[str, dict]] = []  # (path, query) of every request that had a query
        # When set: the info routes and /health_generate wait for it to open before answering.
        self.info_gate: asyncio.Event | None = None
        self.requests: list[tuple[str, dict | None]] = []
        self.aborts: list[dict] = []
        self.release = asyncio.Event()  # opens hanging requests
        self.health_calls = 0
        self.in_handler = 0
        self.url = ""
        self._runner: web.AppRunner | None = None

    # ---- lifecycle -------------------------------------------------------------------------------
    async def start(self, port: int = 0) -> "FakeWorker":
        app = web.Application(middlewares=[self._count])
        for path in ("/generate", "/v1/completions", "/v1/chat/completions"):
            app.router.add_post(path, self._generate)
        app.router.add_post("/abort_request", self._abort)
        app.router.add_get("/health", self._health)
        app.router.add_get("/health_generate", self._ok)
        app.router.add_get("/ready", self._ready)
        app.router.add_post("/flush_cache", self._flush)
        app.router.add_get("/server_info", self._server_info)
        app.router.add_get("/get_server_info", self._server_info)
        app.router.add_get("/model_info", self._model_info)
        app.router.add_get("/get_model_info", self._model_info)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/v1/loads", self._loads)
        if self.api in ("0.5.23", "patched"):
            app.router.add_post("/pd_role_switch", self._switch)
        if self.api in ("convert", "patched"):
            app.router.add_post("/convert_pd_role", self._switch)
        self._runner = web.AppRunner(app, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        self.release.set()
        if self._runner is not None:
            await self._runner.cleanup()

    @web.middleware
    async def _count(self, request: web.Request, handler):
        self.calls[request.path] += 1
        if request.query_string:
            self.queries.append((request.path, dict(request.query)))
        if self.info_gate is not None and request.path in INFO_PATHS:
            await self.info_gate.wait()
        return await handler(request)

    # ---- helpers ---------------------------------------------------------------------------------
    def bodies(self, path: str = "/generate") -> list[dict]:
        return [b for p, b in self.requests if p == path]

    def _answer(self, body: dict, index: int | None = None, n_tokens: int = 3) -> dict:
        rid = body.get("rid")
        if isinstance(rid, list):
            rid = rid[index or 0]
        tokens = list(range(n_tokens))
        finish = {"type": "length", "length": n_tokens}
        meta = {"id": rid, "finish_reason": finish, "prompt_tokens": 4, "completion_tokens": len(tokens),
                "weight_version": self.weight_version, "role": self.role}
        if body.get("return_logprob"):
            meta["input_token_logprobs"] = [[-1.0, 1, None]] if self.role == "prefill" else []
            meta["output_token_logprobs"] = [[-0.5, t, None] for t in tokens]
        answer = {"text": "".join(f" t{t}" for t in tokens), "output_ids": tokens, "meta_info": meta}
        if index is not None:
            answer["index"] = index
        return answer

    # ---- handlers --------------------------------------------------------------------------------
    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        self.requests.append((request.path, body))
        self.in_handler += 1
        try:
            b = self.behaviour
            if b.delay_s:
                await asyncio.sleep(b.delay_s)
            if b.hang:
                await self.release.wait()
            if b.fail_on_field is not None and b.fail_on_field in body:
                return web.json_response({"object": "error", "type": "InternalServerError", "code": 500,
                                          "message": f"cannot handle {b.fail_on_field} (rid {body.get('rid')}, "
                                                     f"room {body.get('bootstrap_room')})"}, status=500)
            if b.close_on_field is not None and b.close_on_field in body:
                request.transport.close()
                return web.Response(status=500)  # never delivered: the connection is gone
            if b.status != 200 and b.error_text is not None:
                return web.Response(text=b.error_text, status=b.status)
            if b.status != 200:
                return web.json_response(b.error_body or {"error": {"message": f"fake {self.role} failure"}},
                                         status=b.status)
            batch = isinstance(body.get("text"), list) or (
                isinstance(body.get("input_ids"), list) and body["input_ids"] and isinstance(body["input_ids"][0], list))
            n_tokens = 1 if self.role == "prefill" else 3
            if not body.get("stream"):
                if batch:
                    size = len(body.get("text") or body.get("input_ids"))
                    return web.json_response([self._answer(body, i, n_tokens) for i in range(size)],
                                             dumps=lambda o: orjson.dumps(o).decode())
                return web.json_response(self._answer(body, None, n_tokens), dumps=lambda o: orjson.dumps(o).decode())
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            chunks = 1 if self.role == "prefill" else b.stream_chunks
            for i in range(chunks):
                if b.cut_after is not None and i >= b.cut_after:
                    request.transport.close()
                    return response
                if b.stall_after is not None and i >= b.stall_after:
                    await self.release.wait()
                await response.write(b"data: " + orjson.dumps(self._answer(body, None, i + 1)) + b"\n\n")
                await asyncio.sleep(0)
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        finally:
            self.in_handler -= 1

    async def _abort(self, request: web.Request) -> web.Response:
        self.aborts.append(orjson.loads(await request.read() or b"{}"))
        return web.Response(status=200)

    async def _health(self, request: web.Request) -> web.Response:
        self.health_calls += 1
        return web.Response(status=self.behaviour.health_status)

    async def _ok(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _ready(self, request: web.Request) -> web.Response:
        return web.Response(status=200)  # 0.5.23's /ready (503 while paused: the simulator's pause does that)

    async def _flush(self, request: web.Request) -> web.Response:
        if self.in_handler:
            return web.Response(status=400, text="Flush cache failed." + self.message_suffix)
        return web.Response(status=200, text="Cache flushed." + self.message_suffix)

    async def _loads(self, request: web.Request) -> web.Response:
        return web.json_response({"loads": [{"num_running_reqs": self.in_handler, "num_waiting_reqs": 0}]})

    async def _switch(self, request: web.Request) -> web.Response:
        """0.5.23's /pd_role_switch (or /convert_pd_role: the opposite role, a new bootstrap port)."""
        body = orjson.loads(await request.read() or b"{}")
        self.switch_calls.append(body)
        self.switch_paths.append(request.path)
        api = "convert" if request.path == "/convert_pd_role" else "0.5.23"
        old = self.role
        new = body.get("new_role") if api == "0.5.23" else ("prefill" if old == "decode" else "decode")

        def answer(status: int, success: bool, message: str, safe: bool = False) -> web.Response:
            message += self.message_suffix
            if api == "convert":  # the earlier design says nothing about safety
                return web.json_response({"success": success, "message": message, "bootstrap_port": None},
                                         status=status)
            return web.json_response({"success": success, "message": message, "old_role": old, "new_role": new,
                                      "safe_to_restore": safe}, status=status)

        if self.in_handler or self.not_idle_refusals:
            self.not_idle_refusals = max(self.not_idle_refusals - 1, 0)
            return answer(400, False, "instance is not idle; drain all requests before switching", True)
        if api == "0.5.23" and new == "decode" and body.get("decode_cuda_graph_memory_gb") is None:
            return answer(400, False, "decode_cuda_graph_memory_gb is required before capturing decode graphs",
                          True)
        if self.switch_fault in ("hang", "late"):
            if self.switch_fault == "late":
                self.role = new
            await self.release.wait()
        if self.switch_fault == "safe":
            return answer(400, False, "injected refusal", True)
        if self.switch_fault == "unsafe":
            self.role = "broken"
            return answer(400, False, "role switch failed; instance unhealthy, restart required", False)
        if self.switch_fault != "noop":
            self.role = new
        if api == "convert":
            moved = self.convert_bootstrap_port if self.api == "convert" else self.bootstrap_port
            port = moved if new == "prefill" else None
            return web.json_response({"success": True, "message": "ok", "bootstrap_port": port})
        return answer(200, True, "ok")

    async def _server_info(self, request: web.Request) -> web.Response:
        return web.json_response({
            **self.server_args,
            "disaggregation_mode": self.launch_role,
            "enable_pd_role_switch": self.api in ("0.5.23", "patched"),
            "enable_pd_convert": self.api == "convert",
            "disaggregation_bootstrap_port": self.bootstrap_port,
            "internal_states": [{**self.server_args, "weight_version": self.weight_version,
                                 "disaggregation_mode": self.role, "last_gen_throughput": 1.0}],
            "version": "0.5.23",
        })

    async def _model_info(self, request: web.Request) -> web.Response:
        return web.json_response({**self.server_args, "model_path": "fake-model",
                                  "weight_version": self.weight_version, "disaggregation_mode": self.role})

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{**self.server_args, "id": "fake-model",
                                                              "object": "model"}]})
