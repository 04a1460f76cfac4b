"""One error hierarchy and its JSON rendering: `{"error": {"message", "type", "code"}}`."""

from __future__ import annotations

import logging

import orjson
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

logger = logging.getLogger(__name__)


class ListenError(Exception):
    """The router cannot listen where it was told (the port taken, an address not this host's): one line for the
    operator and exit status 1, not a traceback."""

    def __init__(self, what: str, host: str, port: int, exc: OSError) -> None:
        super().__init__(f"cannot listen on {host}:{port} ({what}): {exc.strerror or exc}")


class RouterError(Exception):
    status = 500
    type = "internal_error"

    def __init__(self, message: str, *, status: int | None = None, headers: dict | None = None, **details):
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status
        self.headers = headers or {}
        self.details = details

    def body(self) -> dict:
        error = {"message": self.message, "type": self.type, "code": self.status}
        error.update(self.details)
        return {"error": error}


class BadRequest(RouterError):
    status = 400
    type = "invalid_request_error"


def parse_json_object(raw: bytes) -> dict:
    """A request body that must be a JSON object; anything else is a 400 that says why."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest(f"request body must be a JSON object, got {type(body).__name__}")
    return body


class Unauthorized(RouterError):
    status = 401
    type = "authentication_error"


class Forbidden(RouterError):
    status = 403
    type = "permission_error"


class NotFound(RouterError):
    status = 404
    type = "not_found"


class Conflict(RouterError):
    status = 409
    type = "conflict"


class WorkerRemoved(Conflict):
    """A seed (a command line, a worker source's first listing) names a server the router replicas' cluster
    removed: it is not added again but by a registration on purpose (POST /workers)."""


class RequestTimeout(RouterError):
    status = 408
    type = "request_timeout"


class PayloadTooLarge(RouterError):
    status = 413
    type = "payload_too_large"


class TooManyRequests(RouterError):
    status = 429
    type = "rate_limited"


class BadGateway(RouterError):
    status = 502
    type = "upstream_error"


class ServiceUnavailable(RouterError):
    status = 503
    type = "unavailable"


class GatewayTimeout(RouterError):
    status = 504
    type = "timeout"


def json_response(body, status: int = 200, headers: dict | None = None) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json", headers=headers)


def error_response(error: RouterError) -> web.Response:
    response = json_response(error.body(), status=error.status, headers=error.headers)
    if error.status == 413:
        response.force_close()  # the rest of an oversized body is not read (aiohttp would drain it first)
    return response


@web.middleware
async def error_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except RouterError as error:
        if error.status == 503 and error.details.get("cluster"):
            # an expected refusal (the router replicas cannot agree now: etcd), one line per call
            logger.warning("%s %s answered 503: %s", request.method, request.path, error.message)
        return error_response(error)
    except HttpProcessingError as exc:  # the body's framing broke while it was read (a bad chunk): the client's
        what = " ".join((exc.message or str(exc)).split())[:200] or type(exc).__name__
        logger.warning("bad HTTP request body on %s %s: %s", request.method, request.path, what)
        return json_response({"error": {"message": f"bad HTTP request body: {what}", "type": "http_error",
                                        "code": 400}}, status=400)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        # aiohttp's own 404/405/413: same JSON shape as every other error.
        return json_response(
            {"error": {"message": exc.reason if exc.text is None else exc.text.removeprefix(f"{exc.status}: "),
                       "type": "http_error", "code": exc.status}},
            status=exc.status,
            headers={k: v for k, v in exc.headers.items() if k.lower() not in ("content-type", "content-length")},
        )
    except Exception:
        logger.exception("unhandled error on %s %s", request.method, request.path)
        return json_response({"error": {"message": "internal router error", "type": "internal_error",
                                        "code": 500}}, status=500)
