"""One simulated SGLang worker: its HTTP server, its bootstrap listener and its engine.

    worker = Worker(WorkerConfig(role="prefill", port=0, bootstrap_port=0))
    await worker.start()          # worker.url, worker.bootstrap_port
    ...
    await worker.stop()

Routes are grouped by job in ``control.py`` (abort, pause, cache, weights), ``roles.py``
(role switching), ``openai.py`` and ``simapi.py`` (test-only ``/_sim/*``); this module holds
the worker's lifecycle, ``/generate`` and the info routes.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import time
from typing import Awaitable, Callable

import aiohttp
import orjson
from aiohttp import web

from . import control, info, loads, metrics, openai, outputs, roles, simapi
from .bootstrap import BootstrapListener, KvClient, RoomStore
from .config import WorkerConfig
from .engine import ABORTED, Engine, Req, RequestFailed
from .faults import FaultInjector, Faults
from .formats import SSE_DONE, Format, NativeFormat
from .httputil import http_error, json_response, method_not_allowed, not_found, read_json, value_error
from . import dp_ranks
from .inputs import BodyError, GenerateCall, ItemSpec, parse_generate
from .journal import Journal
from .tokens import Generator

log = logging.getLogger(__name__)

WORKER_KEY = web.AppKey("worker", object)
TRACE_HEADERS_KEPT = 1000


class Worker:
    def __init__(self, config: WorkerConfig, faults: Faults | None = None, *, standalone: bool = False,
                 journal: Journal | None = None) -> None:
        self.config = config
        self.journal = journal  # what it received, for tests (simulator/journal.py); None: nothing kept
        self.faults = FaultInjector(faults, seed=config.seed)
        self.probes_let_go = asyncio.Event()  # clear while the health_hang fault holds the probes
        self._hold_probes(self.faults.faults.health_hang)
        self.rooms = RoomStore()
        self.engine = Engine(config, self.faults, self.rooms)
        self.engine.publish_row = lambda rank: loads.publish(self.engine, rank)
        self.standalone = standalone  # its own process: a crash fault may exit it
        self.port: int | None = config.port or None  # a fixed port is known before start, an ephemeral one after
        self.listener: BootstrapListener | None = None
        self.launch_bootstrap_port: int | None = config.bootstrap_port
        self.session: aiohttp.ClientSession | None = None
        self.stopping = False
        self._runner: web.AppRunner | None = None
        self._started = 0.0
        self.role_switcher: roles.RoleSwitcher | None = None  # set by roles.add_routes
        # W3C trace context each generation call came with (SGLang 0.5.23 reads traceparent/tracestate and
        # parents its request span on it): the newest calls, for GET /_sim/traces
        self.trace_headers: collections.deque[dict] = collections.deque(maxlen=TRACE_HEADERS_KEPT)
        self.app = self._build_app()

    # ------------------------------------------------------------ lifecycle

    @property
    def url(self) -> str:
        host = f"[{self.config.host}]" if ":" in self.config.host else self.config.host
        return f"http://{host}:{self.port}"

    @property
    def bootstrap_port(self) -> int | None:
        return self.listener.port if self.listener is not None else None

    @property
    def role(self) -> str:
        return self.engine.role

    async def start(self) -> "Worker":
        cfg = self.config
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300),
            json_serialize=lambda o: orjson.dumps(o).decode(),
        )
        self.engine.kv_client = KvClient(self.session)
        # no handler_cancellation: it costs a task per request; waiting calls poll their client instead
        self._runner = web.AppRunner(self.app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, cfg.host, cfg.port, reuse_address=True, backlog=1024)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        # 0.5.23 with role switching: every server runs a bootstrap listener; the convert API opens one
        # only when a decode becomes a prefill
        runs_listener = cfg.role == "prefill" or (
            cfg.role == "decode" and cfg.enable_pd_role_switch and cfg.api in ("0.5.23", "patched"))
        if runs_listener and cfg.bootstrap_port is not None:
            await self.open_listener(cfg.bootstrap_port, registered=cfg.role == "prefill")
            self.launch_bootstrap_port = self.listener.port  # type: ignore[union-attr]
        self._started = time.monotonic()
        log.info("simulated %s worker on %s (bootstrap %s)", cfg.role, self.url, self.bootstrap_port)
        return self

    async def stop(self) -> None:
        self.stopping = True
        self.probes_let_go.set()
        for req in list(self.engine.requests.values()):
            req.abort(dict(ABORTED))
        await self.close_listener()
        await self.engine.close()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self.session is not None:
            await self.session.close()
            self.session = None

    async def open_listener(self, port: int, *, registered: bool) -> int:
        await self.close_listener()
        listener = BootstrapListener(self, self.config.host, port)
        await listener.start()
        listener.registered = registered
        self.listener = listener
        return listener.port  # type: ignore[return-value]

    async def close_listener(self) -> None:
        if self.listener is not None:
            listener, self.listener = self.listener, None
            await listener.stop()

    def set_faults(self, changes: dict) -> Faults:
        """Merge fault fields (faults.py); a cleared hang_after_tokens lets its parked requests go on, while calls
        `hang` caught stay hung until aborted or abandoned (tests hold a server with one while others queue)."""
        faults = self.faults.update(changes)
        self.engine.wake_all()
        self._hold_probes(faults.health_hang)
        return faults

    def _hold_probes(self, hold: bool) -> None:
        if hold:
            self.probes_let_go.clear()
        else:
            self.probes_let_go.set()

    def up_for(self) -> float:
        return time.monotonic() - self._started

    # ------------------------------------------------------------ app

    def _build_app(self) -> web.Application:
        middlewares = [self.journal.middleware] if self.journal is not None else []  # first: it sees all
        if self.config.api_key:
            middlewares.append(_api_key_middleware(self.config.api_key))
        app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=middlewares)
        app[WORKER_KEY] = self
        v = self.config
        r = app.router
        r.add_post("/generate", self.handle_generate)
        r.add_put("/generate", self.handle_generate)
        r.add_get("/health", self.handle_health)
        r.add_get("/health_generate", self.handle_health)
        if v.at_least("0.5.23"):
            r.add_get("/ready", self.handle_ready)
        r.add_get("/get_model_info", self.handle_model_info)
        r.add_get("/get_server_info", self.handle_server_info)
        if v.at_least("0.5.6"):
            r.add_get("/model_info", self.handle_model_info)
            r.add_get("/server_info", self.handle_server_info)
        if v.at_least("0.5.23"):
            r.add_get("/v1/loads", self.handle_v1_loads)
        else:
            r.add_get("/get_load", self.handle_get_load)
        if v.sglang_version == "0.5.6":
            r.add_get("/weight_version", self.handle_weight_version)
            r.add_get("/get_weight_version", self.handle_weight_version)
        control.add_routes(r, self)
        roles.add_routes(r, self)
        openai.add_routes(r, self)
        metrics.add_routes(r, self)
        simapi.add_routes(r, self)
        r.add_route("*", "/{tail:.*}", self.handle_unknown)
        return app

    async def handle_unknown(self, request: web.Request) -> web.Response:
        for resource in request.app.router.resources():
            info_ = resource.get_info()
            if info_.get("path") == request.path:
                return method_not_allowed()
        return not_found()

    # ------------------------------------------------------------ info

    async def handle_health(self, request: web.Request) -> web.Response:
        script = self.faults.faults.health_script
        status = script.pop(0) if script else await self.health_status(request.path)
        await self.probes_let_go.wait()  # the health_hang fault holds the answer decided on arrival
        return web.Response(body=b"", status=status)

    async def health_status(self, path: str) -> int:
        """SGLang's probe: 503 while starting or broken, else a 1-token request must make progress."""
        cfg = self.config
        engine = self.engine
        if self.stopping or engine.unhealthy or self.faults.faults.unhealthy or self.up_for() < cfg.startup_s:
            return 503
        if path == "/health" and not cfg.at_least("0.5.6"):
            return 200  # 0.4.9: /health only says the HTTP server is up
        tic = time.monotonic()
        interval = cfg.health_check_s
        deadline = tic + cfg.health_timeout_s
        while True:
            await asyncio.sleep(interval if interval else 0)
            if engine.last_receive > tic or self._probe_can_run():
                if engine.role != "prefill":  # the probe's one token is a decode step of its own (0.5.23)
                    engine.batches[0].account(1, 0.0, 1)
                return 200
            if time.monotonic() >= deadline:
                return 503
            interval = cfg.health_check_s or 0.05

    def _probe_can_run(self) -> bool:
        e = self.engine
        return not (e.is_pause or e.pause_mode or e.lock.writer or e.lock.waiting_writers
                    or self.faults.faults.hang)

    async def handle_ready(self, request: web.Request) -> web.Response:
        ok = not self.stopping and not self.engine.is_pause and not self.engine.unhealthy \
            and self.up_for() >= self.config.startup_s
        return web.Response(body=b"", status=200 if ok else 503)

    async def handle_model_info(self, request: web.Request) -> web.Response:
        return json_response(info.model_info(self))

    async def handle_server_info(self, request: web.Request) -> web.Response:
        self.engine.last_receive = time.monotonic()  # its internal states are the scheduler's reply
        return json_response(info.server_info(self))

    async def handle_v1_loads(self, request: web.Request) -> web.Response:
        return await loads.handle_v1_loads(request, self)

    async def handle_get_load(self, request: web.Request) -> web.Response:
        return json_response(loads.get_load(self))

    async def handle_weight_version(self, request: web.Request) -> web.Response:
        return json_response({"weight_version": self.engine.model_version})

    # ------------------------------------------------------------ /generate

    def count(self, route: str) -> None:
        by_route = self.engine.counters.requests_by_route
        by_route[route] = by_route.get(route, 0) + 1

    async def handle_generate(self, request: web.Request) -> web.StreamResponse:
        self.count("generate")
        body = await read_json(request, handler="generate_request")
        if isinstance(body, web.StreamResponse):
            return body
        try:
            call = parse_generate(body, default_max_new_tokens=self.config.default_max_new_tokens,
                                  context_length=self.config.context_length,
                                  default_bootstrap_port=self.launch_bootstrap_port)
        except BodyError as exc:
            return json_response(outputs.validation_error(request.path, "generate_request", exc.errors), 400)
        except ValueError as exc:
            if isinstance(body, dict) and body.get("stream"):
                return await NativeFormat().rejected_stream(request, str(exc))
            return value_error(str(exc))
        return await self.serve(request, call, "generate", NativeFormat())

    def make_reqs(self, call: GenerateCall, route: str) -> list[Req]:
        """Items of one call, registered under their rids (a live rid is a 400, as in SGLang)."""
        dp_ranks.check_routed(call.routed_dp_rank, self.config.dp_size)
        for spec in call.items:
            if spec.rid in self.engine.requests:
                raise ValueError(f"Duplicate request ID detected: {spec.rid}")
        reqs = [self._make_req(spec, call, route) for spec in call.items]
        for req in reqs:
            self.engine.register(req)
        return reqs

    def _make_req(self, spec: ItemSpec, call: GenerateCall, route: str) -> Req:
        addr = None
        if spec.bootstrap_host is not None:
            addr = f"{spec.bootstrap_host}:{spec.bootstrap_port}"
        return Req(
            rid=spec.rid, input_ids=spec.input_ids,
            gen=Generator(spec.input_ids, spec.max_new_tokens, spec.stop, spec.stop_token_ids),
            route=route, stream=call.stream, return_logprob=spec.return_logprob,
            top_logprobs_num=spec.top_logprobs_num, logprob_start_len=spec.logprob_start_len,
            bootstrap_addr=addr, room=spec.bootstrap_room,
            parallel_sample=call.parallel_sample_num > 1,
            routed_dp_rank=call.routed_dp_rank, disagg_prefill_dp_rank=call.disagg_prefill_dp_rank,
        )

    async def serve(self, request: web.Request, call: GenerateCall, route: str, fmt: "Format") -> web.StreamResponse:
        """Run every item of one call and answer in ``fmt`` (native or OpenAI), streaming or not."""
        engine = self.engine
        if self.faults.should_fail():
            engine.counters.faults_injected += 1
            status = self.faults.faults.error_status
            return http_error(status, f"Simulated fault: {route} failed on {self.url}")
        if "traceparent" in request.headers or "tracestate" in request.headers:
            self.trace_headers.append({
                "route": route, "rids": [spec.rid for spec in call.items],
                "rooms": [spec.bootstrap_room for spec in call.items],
                "traceparent": request.headers.get("traceparent"), "tracestate": request.headers.get("tracestate")})
        try:
            reqs = self.make_reqs(call, route)
        except ValueError as exc:
            if call.stream:
                return await fmt.rejected_stream(request, str(exc))
            return fmt.failure_response(RequestFailed(str(exc), 400))
        entered = False
        watch = DisconnectWatch(request, self.config.disconnect_check_s, lambda: engine.abort_on_disconnect(reqs))
        try:
            await engine.enter_call()
            entered = True
            engine.dispatch(reqs)
            if call.stream:
                return await self._serve_stream(request, reqs, fmt, call)
            return await self._serve_whole(request, reqs, fmt, call)
        except asyncio.CancelledError:
            engine.abort_on_disconnect(reqs)  # shutting down (or cancelled): nothing of it may linger
            raise
        finally:
            watch.cancel()
            if entered:
                engine.leave_call()
            for req in reqs:
                engine.unregister(req)

    def _progress_hook(self, request: web.Request) -> Callable[[Req], Awaitable[None]] | None:
        faults = self.faults.faults
        if faults.crash_after_tokens is None and faults.exit_after_tokens is None:
            return None

        async def check(req: Req) -> None:
            self.maybe_crash(request, req)

        return check

    def maybe_crash(self, request: web.Request, req: Req) -> None:
        faults = self.faults.faults
        n = len(req.output_ids)
        if faults.exit_after_tokens is not None and n >= faults.exit_after_tokens:
            if self.standalone:
                log.error("fault: exiting after %d tokens", n)
                os._exit(17)
            faults.crash_after_tokens = faults.exit_after_tokens
        if faults.crash_after_tokens is not None and n >= faults.crash_after_tokens:
            req.abort({"type": "abort", "message": "Simulated crash", "status_code": None, "err_type": None})
            if request.transport is not None:
                request.transport.abort()  # the connection drops mid-answer

    async def _run_item(self, req: Req, on_progress: Callable[[Req], Awaitable[None]] | None) -> None:
        if self.engine.role != "null" and req.room is None:
            raise RequestFailed("Invalid request: Disaggregated request received without bootstrap room id. "
                                f"req.rid={req.rid!r}", 400)
        await self.engine.run(req, on_progress)

    async def _serve_whole(self, request: web.Request, reqs: list[Req], fmt: "Format",
                           call: GenerateCall) -> web.StreamResponse:
        hook = self._progress_hook(request)
        if len(reqs) == 1:
            try:
                await self._run_item(reqs[0], hook)
            except RequestFailed as exc:
                return fmt.failure_response(exc)
        else:
            tasks = [asyncio.ensure_future(self._run_item(req, hook)) for req in reqs]
            try:
                await asyncio.gather(*tasks)
            except RequestFailed as exc:
                for req in reqs:
                    req.abort(dict(ABORTED))
                await asyncio.gather(*tasks, return_exceptions=True)
                return fmt.failure_response(exc)
            finally:
                for task in tasks:
                    task.cancel()
        return fmt.whole(self, reqs, call)

    async def _serve_stream(self, request: web.Request, reqs: list[Req], fmt: "Format",
                            call: GenerateCall) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        state = fmt.stream_state(self, reqs, call)
        batch = len(reqs) > 1
        crash = self._progress_hook(request)

        async def emit(req: Req) -> None:
            for chunk in fmt.chunks(self, req, state, batch=batch):
                await resp.write(chunk)
            if crash is not None:
                await crash(req)

        async def run_one(req: Req) -> None:
            try:
                await self._run_item(req, emit)
            except RequestFailed as exc:
                for chunk in fmt.failed_chunks(self, req, state, exc, batch=batch):
                    await resp.write(chunk)
                return
            if not state.final_sent(req):
                await emit(req)

        try:
            if len(reqs) == 1:
                await run_one(reqs[0])
            else:
                await asyncio.gather(*(run_one(req) for req in reqs))
            for chunk in fmt.tail(self, reqs, state):
                await resp.write(chunk)
            await resp.write(SSE_DONE)
            await resp.write_eof()
        except (ConnectionResetError, aiohttp.ClientConnectionResetError):
            self.engine.abort_on_disconnect(reqs)
        return resp


class DisconnectWatch:
    """Calls ``on_gone`` once if the client's connection closes while the call is in progress."""

    __slots__ = ("_request", "_interval", "_on_gone", "_handle")

    def __init__(self, request: web.Request, interval: float, on_gone: Callable[[], None]) -> None:
        self._request = request
        self._interval = interval
        self._on_gone = on_gone
        self._handle = asyncio.get_running_loop().call_later(interval, self._check)

    def _check(self) -> None:
        transport = self._request.transport
        if transport is None or transport.is_closing():
            self._handle = None
            self._on_gone()
        else:
            self._handle = asyncio.get_running_loop().call_later(self._interval, self._check)

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


# Open even with --api-key (SGLang 0.5.23, srt/utils/auth.py); /_sim/ is the simulator's own test surface.
_OPEN_PREFIXES = ("/health", "/ready", "/metrics", "/_sim/")


def _api_key_middleware(api_key: str):
    """SGLang's api-key rule: a bearer token on every route but probes and metrics; 401 otherwise."""
    import secrets

    @web.middleware
    async def check(request: web.Request, handler):
        if request.method != "OPTIONS" and not request.path.startswith(_OPEN_PREFIXES):
            scheme, _, token = (request.headers.get("Authorization") or "").partition(" ")
            if scheme.lower() != "bearer" or not secrets.compare_digest(token, api_key):
                return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    return check
