"""A router and its simulated fleet served from a thread of their own, for synchronous clients (hypothesis,
schemathesis): the app runs as `python -m router` runs it (RouterRunner: malformed HTTP in JSON; bodies
decoded by the app), on a free loopback port."""

from __future__ import annotations

import asyncio
import http.client
import logging
import threading
import time

import orjson
from aiohttp import web

from router.core.config import DISCOVER, RouterConfig, WorkerSpec
from router.core.keys import REGISTRY
from router.dataplane.admission import ADMISSION
from router.server.app import create_app
from router.server.http_errors import RouterRunner
from simulator.fleet import Fleet

from ..sim_support import FAST

SETTLE_S = 15.0


class Tracebacks(logging.Handler):
    """Every record the router logs from its thread with a traceback (its log must hold none for what a client
    sent)."""

    def __init__(self, thread: threading.Thread) -> None:
        super().__init__(logging.DEBUG)
        self.thread = thread
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.thread != self.thread.ident or not record.name.startswith(("router", "aiohttp")):
            return  # (asyncio's "never retrieved" comes from whichever thread collects another test's task)
        if record.exc_info or record.exc_text or "Traceback" in record.getMessage():
            self.records.append(record)


class LiveRouter:
    def __init__(self, prefill: int = 2, decode: int = 2, **overrides) -> None:
        self.counts = (prefill, decode)
        self.overrides = overrides
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="live-router", daemon=True)
        self.app: web.Application | None = None
        self.port = 0

    def __enter__(self) -> "LiveRouter":
        self.tracebacks = Tracebacks(self._thread)
        logging.getLogger().addHandler(self.tracebacks)
        self._thread.start()
        self.call(self._start())
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.call(self._stop())
        finally:
            logging.getLogger().removeHandler(self.tracebacks)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
            self.loop.close()

    def call(self, coro, timeout: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start(self) -> None:
        self.fleet = Fleet(*self.counts, **FAST)
        await self.fleet.__aenter__()
        config = RouterConfig(
            prefill=tuple(WorkerSpec(h.url, DISCOVER) for h in self.fleet.prefill),
            decode=tuple(WorkerSpec(h.url) for h in self.fleet.decode), host="127.0.0.1", **self.overrides,
        ).validated()
        self.app = create_app(config)
        self.runner = RouterRunner(self.app, handler_cancellation=True, access_log=None, auto_decompress=False)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        self.urls = {w.url for w in self.app[REGISTRY].workers()}

    async def _stop(self) -> None:
        await self.runner.cleanup()
        await self.fleet.__aexit__(None, None, None)

    # ---- the client's side -------------------------------------------------------------------------------
    def request(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
                timeout: float = 30.0) -> tuple[int, str, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request(method, path, body=body, headers=headers or {})
            resp = conn.getresponse()
            return resp.status, resp.getheader("Content-Type", ""), resp.read()
        finally:
            conn.close()

    # ---- what must hold after anything a client sent -------------------------------------------------------
    def state(self) -> dict:
        async def read():
            registry = self.app[REGISTRY]
            return {"workers": [(w.url, w.role.value, w.state.value, w.routable, w.inflight, w.breaker)
                                for w in registry.workers()],
                    "admission": self.app[ADMISSION].active, "queued": self.app[ADMISSION].waiting}
        return self.call(read())

    def assert_settled(self) -> None:
        """No request left counted, and every worker of the fleet back in a pool and routable."""
        deadline = time.monotonic() + SETTLE_S
        while True:
            state = self.state()
            ours = [w for w in state["workers"] if w[0] in self.urls]
            ok = (state["admission"] == 0 and state["queued"] == 0 and len(ours) == len(self.urls)
                  and all(inflight == 0 and routable and status == "active" and breaker == "closed"
                          for _, _, status, routable, inflight, breaker in ours))
            if ok:
                logged = [f"{r.name}: {r.getMessage()}" for r in self.tracebacks.records]
                assert not logged, f"tracebacks in the router's log: {logged[:5]}"
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"the router did not settle: {state}")
            time.sleep(0.05)


def json_error_of(status: int, content_type: str, raw: bytes) -> dict:
    """The error object of an error answer; fails when the answer is not one in the router's shape."""
    assert content_type.startswith("application/json"), (status, content_type, raw[:300])
    error = orjson.loads(raw)["error"]
    assert isinstance(error, dict) and isinstance(error.get("message"), str) and error["message"], raw[:300]
    return error


def assert_not_the_routers_fault(status: int, content_type: str, raw: bytes) -> None:
    """No client input produces a 5xx from the router itself: a 5xx may only be a server's answer relayed or
    the fleet's state (no worker, held), never the router failing (500 internal_error, or text)."""
    if status >= 400:
        error = json_error_of(status, content_type, raw)
        assert not (status == 500 and error.get("type") in ("internal_error", "http_error")), raw[:300]
