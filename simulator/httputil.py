"""Small HTTP helpers shared by the route modules: JSON in and out, SGLang's error shapes."""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from . import outputs

_NO_BODY = object()


def json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json")


def empty_response(status: int = 200) -> web.Response:
    """What FastAPI's ``Response(status_code=...)`` sends: no body, no content type."""
    return web.Response(body=b"", status=status)


def text_response(text: str, status: int = 200) -> web.Response:
    """FastAPI ``Response(content=str)``: a body without a content type."""
    return web.Response(body=text.encode(), status=status)


async def read_json(request: web.Request, *, handler: str, required: bool = True) -> Any:
    """The JSON body, or a ready 400 ``web.Response`` shaped like SGLang's validation errors.

    ``required=False`` returns ``None`` for an empty body (older servers took no body).
    """
    raw = await request.read()
    if not raw:
        if not required:
            return None
        return json_response(outputs.missing_body(request.path, handler), 400)
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return json_response(outputs.json_invalid(request.path, handler), 400)


def is_response(value: Any) -> bool:
    return isinstance(value, web.StreamResponse)


def value_error(message: str) -> web.Response:
    return json_response(outputs.value_error(message), 400)


def http_error(status: int, message: str, err_type: str | None = None) -> web.Response:
    return json_response(outputs.http_error(status, message, err_type), status)


def not_found() -> web.Response:
    return json_response({"detail": "Not Found"}, 404)


def method_not_allowed() -> web.Response:
    return json_response({"detail": "Method Not Allowed"}, 405)


def require_fields(request: web.Request, body: Any, handler: str, struct: str, *names: str) -> web.Response | None:
    """A 400 like pydantic's when ``body`` is not an object or lacks one of ``names``."""
    if not isinstance(body, dict):
        return json_response(outputs.validation_error(request.path, handler, [outputs.not_an_instance(struct, body)]),
                             400)
    for name in names:
        if name not in body:
            return json_response(outputs.missing_field(request.path, handler, name, body, struct), 400)
    return None
