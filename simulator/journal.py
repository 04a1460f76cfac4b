"""What one worker received, kept for tests that assert on what a router sent (off by default).

A worker started with a ``Journal`` (``Worker(config, journal=Journal())``, ``Fleet(..., record_requests=True)``)
gets one more middleware that notes every request before SGLang's handlers see it; a worker without one has no
such middleware, so the record costs nothing when off. In-process only: a test reads it off the object.
"""

from __future__ import annotations

import collections
from typing import Any

import orjson
from aiohttp import web

GENERATION_PATHS = frozenset({"/generate", "/v1/completions", "/v1/chat/completions"})
ABORT_PATH = "/abort_request"


class Journal:
    def __init__(self) -> None:
        self.calls: collections.Counter[str] = collections.Counter()  # every request, by path
        self.in_flight: collections.Counter[str] = collections.Counter()  # requests not answered yet, by path
        self.authorizations: list[tuple[str, str | None]] = []  # (path, Authorization header) of each request
        self.queries: list[tuple[str, dict]] = []  # (path, query) of each request that had a query
        self.posted: list[tuple[str, Any]] = []  # (path, body) of each POST or PUT, as it came

    @property
    def requests(self) -> list[tuple[str, Any]]:
        """(path, body) of each generation call."""
        return [(path, body) for path, body in self.posted if path in GENERATION_PATHS]

    @property
    def aborts(self) -> list[Any]:
        return self.bodies(ABORT_PATH)

    def bodies(self, path: str = "/generate") -> list[Any]:
        return [body for p, body in self.posted if p == path]

    @web.middleware
    async def middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        path = request.path
        self.calls[path] += 1
        self.authorizations.append((path, request.headers.get("Authorization")))
        if request.query_string:
            self.queries.append((path, dict(request.query)))
        if request.method in ("POST", "PUT"):
            # aiohttp keeps the bytes read here: the handler reads them again
            self.posted.append((path, _parsed(await request.read())))
        self.in_flight[path] += 1
        try:
            return await handler(request)
        finally:
            self.in_flight[path] -= 1


def _parsed(raw: bytes) -> Any:
    """The JSON body; ``None`` when there was none; the bytes themselves when they are not JSON."""
    if not raw:
        return None
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return raw
