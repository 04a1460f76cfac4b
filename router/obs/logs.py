"""Logging: one formatter (text or JSON lines), the request id on every line, one line per request.

The request id is the client's `X-Request-Id` when it sends one (so its logs and ours join up), else an id
the router makes (process prefix + counter: unique, cheap). It lives in a context variable, set by the
outermost middleware, so every line logged while serving the request carries it, including lines from the
tasks the request starts (legs, aborts): asyncio copies the context into them.
"""

from __future__ import annotations

import contextvars
import itertools
import logging
import os
import sys
import time

import orjson
from aiohttp import web

REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")
MAX_REQUEST_ID = 128
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"

_prefix = os.urandom(4).hex()
_counter = itertools.count(1)
access_logger = logging.getLogger("router.access")


def new_request_id() -> str:
    return f"{_prefix}-{next(_counter):x}"


def _clean(value: str) -> str:
    value = value.strip()[:MAX_REQUEST_ID]
    return value if value.isprintable() else value.encode("unicode_escape").decode()[:MAX_REQUEST_ID]


@web.middleware
async def request_id_middleware(request: web.Request, handler):
    given = request.headers.get("X-Request-Id")
    REQUEST_ID.set(_clean(given) if given else new_request_id())
    return await handler(request)


def make_request_id_middleware(headers: tuple[str, ...]):
    """`--request-id-headers` (sgl-router's and SMG's): the request id is the first of these headers the client
    sent (else one the router makes), on every log line, and echoed back as `X-Request-Id` on the answer (a
    stream's too: set as its head is prepared). Without the flag: `X-Request-Id` only, not echoed."""
    if not headers:
        return request_id_middleware

    @web.middleware
    async def custom_request_id_middleware(request: web.Request, handler):
        sent = request.headers
        given = next((value for name in headers if (value := sent.get(name))), None)
        REQUEST_ID.set(_clean(given) if given else new_request_id())
        return await handler(request)

    return custom_request_id_middleware


async def echo_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: the request's id on its answer (prepare runs in the handler's context)."""
    if "X-Request-Id" not in response.headers:
        response.headers["X-Request-Id"] = REQUEST_ID.get()


class RequestIdFilter(logging.Filter):
    """Puts the current request id on every record (handler-level: covers every logger)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = REQUEST_ID.get()
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, [process,] request_id, message, the record's `fields`, exc."""

    def __init__(self, process: str | None = None) -> None:
        super().__init__()
        self.process = process

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": round(record.created, 6),
            "level": record.levelname,
            "logger": record.name,
            "request_id": getattr(record, "request_id", REQUEST_ID.get()),
            "message": record.getMessage(),
        }
        if self.process is not None:
            entry["process"] = self.process
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            entry.update(fields)
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(entry, default=str).decode()


def make_handler(json_lines: bool, stream=None, process: str | None = None,
                 handler: logging.Handler | None = None) -> logging.Handler:
    """`process` names the process on every line (`replica 1`, `supervisor`): the processes of `--replicas N`
    write to one stream."""
    handler = handler or logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.addFilter(RequestIdFilter())
    if json_lines:
        handler.setFormatter(JsonFormatter(process))
    else:
        text_format = TEXT_FORMAT
        if process is not None:
            text_format = TEXT_FORMAT.replace(" [%(request_id)s]", f" ({process.replace('%', '%%')}) [%(request_id)s]")
        formatter = logging.Formatter(text_format)
        formatter.converter = time.gmtime
        handler.setFormatter(formatter)
    return handler


def log_file_name(process: str | None) -> str:
    """`--log-dir`'s file of this process: pd-router.log, or one per process of `--replicas N` (each its own
    file: no two processes append to one)."""
    return f"pd-router-{process.replace(' ', '-')}.log" if process else "pd-router.log"


def setup_logging(level: str = "info", json_lines: bool = False, stream=None,
                  process: str | None = None, log_dir: str | None = None) -> logging.Handler:
    """Replace the root handlers with one that formats every line the same way (and, with `log_dir`, a second
    writing the same lines to a file there, appended to: sgl-router's and SMG's --log-dir)."""
    to_file = None
    if log_dir is not None:  # first: a directory that cannot be written changes nothing (OSError)
        os.makedirs(log_dir, exist_ok=True)
        to_file = logging.FileHandler(os.path.join(log_dir, log_file_name(process)), encoding="utf-8")
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    handler = make_handler(json_lines, stream, process)
    root.addHandler(handler)
    if to_file is not None:
        root.addHandler(make_handler(json_lines, process=process, handler=to_file))
    root.setLevel(level.upper())
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    return handler


def log_request(record) -> None:
    """A `Proxy.request_observers` entry: one access line per generation request.

    Successes at DEBUG (a busy router serves thousands a second), client disconnects at INFO, failures at
    WARNING."""
    if record.outcome == "success":
        level = logging.DEBUG
    elif record.outcome == "client_disconnect":
        level = logging.INFO
    else:
        level = logging.WARNING
    if not access_logger.isEnabledFor(level):
        return
    fields = {
        "route": record.route, "status": record.status, "outcome": record.outcome, "stream": record.stream,
        "e2e_ms": round(record.e2e_s * 1000, 3),
        "ttft_ms": None if record.ttft_s is None else round(record.ttft_s * 1000, 3),
        "attempts": record.attempts,
        "prefill": record.prefill.url if record.prefill else None,
        "decode": record.decode.url if record.decode else None,
    }
    if record.error:
        fields["error"] = record.error[:500]
    access_logger.log(level, "%s %s %s in %.1f ms (%d attempt(s), prefill %s, decode %s)%s", record.route,
                      record.status, record.outcome, record.e2e_s * 1000, record.attempts, fields["prefill"],
                      fields["decode"], f": {fields['error']}" if record.error else "", extra={"fields": fields})
