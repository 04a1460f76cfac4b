"""GET /metrics on the router's own port, and the middleware that counts every request by route and status:
the registry itself is `obs/metrics.py`'s (`--prometheus-port` serves it on a port of its own too)."""

from __future__ import annotations

import asyncio

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from router.obs.metrics import METRICS, UNMATCHED


@web.middleware
async def metrics_middleware(request: web.Request, handler):
    """Count every request by route pattern and final status (outermost: sees rendered errors)."""
    resource = request.match_info.route.resource
    status = 500
    try:
        response = await handler(request)
        status = response.status
        return response
    except web.HTTPException as exc:
        status = exc.status
        raise
    except asyncio.CancelledError:
        status = 499  # the client went away
        raise
    finally:
        metrics = request.app.get(METRICS)  # absent until the composition root has built it
        if metrics is not None:
            metrics.count_request(resource.canonical if resource is not None else UNMATCHED, status)


async def metrics_endpoint(request: web.Request) -> web.Response:
    return web.Response(body=request.app[METRICS].render(), headers={"Content-Type": CONTENT_TYPE_LATEST})


def setup(app: web.Application) -> None:
    app.router.add_get("/metrics", metrics_endpoint)
