"""`GET /admin/health`: the health monitor's probes and breakers, worker by worker, and what the configuration
leaves unsafe (admin routes open to the network), as logged at start-up."""

from __future__ import annotations

from aiohttp import web

from router.control.health import HEALTH
from router.core.errors import json_response
from router.core.keys import CONFIG


async def health_state(request: web.Request) -> web.Response:
    return json_response({**request.app[HEALTH].state(), "warnings": request.app[CONFIG].warnings()})


def setup(app: web.Application) -> None:
    app.router.add_get("/admin/health", health_state)
