"""Malformed HTTP: what aiohttp's parser refuses is answered with a JSON error, and logged in one line.

aiohttp answers what its parser cannot read (a bad request line or method, a header line over 8190 bytes or
too many of them, Content-Length with Transfer-Encoding, a bad chunk) in text/plain, and logs each with a
multi-line traceback at ERROR, so anonymous clients could flood the log; an unknown `Expect` is a text/plain
417 from before the app's middlewares. `JsonErrorRequestHandler` (aiohttp's protocol, two methods changed)
answers them as the rest of the router does, `{"error": {"message", "type", "code"}}`, and writes one
warning line per bad request, rate-limited (`RateLimitedLog`: at most `LINES` per `WINDOW_S`, then one line
saying how many were not written). A 500 (the router's own fault, never a client's) keeps aiohttp's
traceback. `RouterRunner` builds the server with this protocol (router/server/serving.py).

The same protocol bounds how long a client may take to send a request head (SMG's --header-read-timeout-secs):
each connection notes when its head began (its accept, or the next head's first byte on a keep-alive one) and
clears it once the head is parsed; `HeadWatch` looks at every connection a few times per timeout and closes
those whose head is late (no timer per request). Idle keep-alive connections are aiohttp's own
`keepalive_timeout` (--idle-connection-timeout-secs).
"""

from __future__ import annotations

import asyncio
import logging
import time
from http import HTTPStatus
from typing import Callable

import orjson
from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_server import Server

logger = logging.getLogger("router.http")

LINES = 10  # bad requests logged per window
WINDOW_S = 10.0
MESSAGE_CHARS = 200


class RateLimitedLog:
    """At most `lines` warnings per `window` seconds; the next one written says how many were dropped."""

    __slots__ = ("lines", "window", "_clock", "_started", "_written", "_dropped", "dropped_total")

    def __init__(self, lines: int = LINES, window: float = WINDOW_S, clock=time.monotonic) -> None:
        self.lines, self.window, self._clock = lines, window, clock
        self._started = clock()
        self._written = 0
        self._dropped = 0
        self.dropped_total = 0

    def warning(self, message: str, *args) -> bool:
        now = self._clock()
        if now - self._started >= self.window:
            self._started, self._written = now, 0
        if self._written >= self.lines:
            self._dropped += 1
            self.dropped_total += 1
            return False
        self._written += 1
        if self._dropped:
            message += " (%d more bad requests not logged in the last %gs)"
            args = (*args, self._dropped, self.window)
            self._dropped = 0
        logger.warning(message, *args)
        return True


BAD_REQUESTS = RateLimitedLog()


def one_line(text: str) -> str:
    """aiohttp's parser messages quote the bytes over several lines: the first line is what went wrong."""
    first = (text or "").strip().splitlines()[0] if (text or "").strip() else ""
    return first.rstrip(":")[:MESSAGE_CHARS]


def json_error(status: int, message: str, kind: str = "http_error") -> web.Response:
    body = {"error": {"message": message, "type": kind, "code": status}}
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")


class JsonErrorRequestHandler(RequestHandler):
    __slots__ = ("head_since",)

    def connection_made(self, transport) -> None:
        self.head_since: float | None = time.monotonic()  # accepted: its first head is due
        super().connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self.head_since is None and self._current_request is None and not self._messages:
            self.head_since = time.monotonic()  # the first byte of a keep-alive connection's next head
        super().data_received(data)
        if self._messages or self._current_request is not None:
            self.head_since = None  # the head is in (or this was the body of the request being handled)

    def handle_error(self, request, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if status >= 500:  # the router's own failure: aiohttp's answer and traceback, as before
            return super().handle_error(request, status, exc, message)
        if request.writer.output_size > 0:
            raise ConnectionError("Response is sent already, cannot send another response with the error message")
        if not message and exc is not None:
            message = getattr(exc, "message", None) or str(exc)
        what = one_line(message or "")
        try:
            phrase = HTTPStatus(status).phrase
        except ValueError:
            phrase = "Bad Request"
        BAD_REQUESTS.warning("bad HTTP request from %s: %d %s: %s", request.remote, status, phrase, what)
        response = json_error(status, f"bad HTTP request: {what or phrase}")
        response.force_close()
        return response

    async def finish_response(self, request, resp: web.StreamResponse, start_time):
        # An HTTP error raised before the app's middlewares could shape it (an unknown `Expect`: 417).
        if isinstance(resp, web.HTTPException) and resp.status >= 400 and resp.content_type != "application/json":
            text = resp.text or resp.reason
            BAD_REQUESTS.warning("bad HTTP request from %s: %d %s", request.remote, resp.status, one_line(text))
            shaped = json_error(resp.status, one_line(text.removeprefix(f"{resp.status}: ")) or resp.reason)
            for name, value in resp.headers.items():
                if name.lower() not in ("content-type", "content-length"):
                    shaped.headers.setdefault(name, value)
            resp = shaped
        return await super().finish_response(request, resp, start_time)


class HeadWatch:
    """--header-read-timeout-secs: close the connections of `server` whose request head is late."""

    LOOKS_PER_TIMEOUT = 4

    def __init__(self, server: Server, timeout: float) -> None:
        self.server, self.timeout = server, timeout
        self.closed_total = 0
        self._every = min(timeout / self.LOOKS_PER_TIMEOUT, 5.0)
        self._timer = asyncio.get_running_loop().call_later(self._every, self._look)

    def _look(self) -> None:
        late = time.monotonic() - self.timeout
        for handler in self.server.connections:
            since = getattr(handler, "head_since", None)
            if since is not None and since < late:
                self.closed_total += 1
                handler.force_close()
        self._timer = asyncio.get_running_loop().call_later(self._every, self._look)

    def close(self) -> None:
        self._timer.cancel()


class JsonErrorServer(Server):
    on_connection_lost: Callable[[], None] | None = None  # the listening site counts its open connections

    def __call__(self) -> RequestHandler:
        return JsonErrorRequestHandler(self, loop=self._loop, **self._kwargs)

    def connection_lost(self, handler: RequestHandler, exc: BaseException | None = None) -> None:
        super().connection_lost(handler, exc)
        if self.on_connection_lost is not None:
            self.on_connection_lost()


class RouterRunner(web.AppRunner):
    """An AppRunner whose connections answer malformed HTTP in JSON (JsonErrorRequestHandler)."""

    __slots__ = ()

    async def _make_server(self) -> Server:
        server = await super()._make_server()
        server.__class__ = JsonErrorServer  # the same server; only the protocol it makes differs
        return server
