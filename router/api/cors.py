"""`--cors-allowed-origins` (sgl-router's, SMG's): browsers on these origins may call the router.

A request whose `Origin` is allowed (or any, with `*`) gets `Access-Control-Allow-Origin` (its origin, or `*`)
and `Vary: Origin` on its answer, a stream's included (set as its head is prepared). A preflight (`OPTIONS` with
`Access-Control-Request-Method`) from an allowed origin is answered 204 at once, before the route and the key
check (a browser sends no credentials on a preflight): the methods GET, POST, PUT, DELETE, the headers the
browser asked for, cached 10 minutes. Other origins get no CORS headers (the browser refuses the answer) and a
preflight from them goes on to the route (405). Without the flag nothing is added.
"""

from __future__ import annotations

from aiohttp import web

ALLOWED_METHODS = "GET, POST, PUT, DELETE, OPTIONS"
PREFLIGHT_MAX_AGE = "600"


class Cors:
    def __init__(self, origins: tuple[str, ...]) -> None:
        self.any = "*" in origins
        self.origins = frozenset(o.rstrip("/") for o in origins if o != "*")

    def allowed(self, origin: str | None) -> str | None:
        """The Access-Control-Allow-Origin value for this origin; None: not allowed."""
        if not origin:
            return None
        if self.any:
            return "*"
        return origin if origin.rstrip("/") in self.origins else None

    def middleware(self):
        @web.middleware
        async def cors_middleware(request: web.Request, handler):
            if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
                allow = self.allowed(request.headers.get("Origin"))
                if allow is not None:
                    headers = {"Access-Control-Allow-Origin": allow, "Vary": "Origin",
                               "Access-Control-Allow-Methods": ALLOWED_METHODS,
                               "Access-Control-Max-Age": PREFLIGHT_MAX_AGE}
                    if asked := request.headers.get("Access-Control-Request-Headers"):
                        headers["Access-Control-Allow-Headers"] = asked
                    return web.Response(status=204, headers=headers)
            return await handler(request)

        return cors_middleware

    async def on_prepare(self, request: web.Request, response: web.StreamResponse) -> None:
        allow = self.allowed(request.headers.get("Origin"))
        if allow is not None:
            response.headers["Access-Control-Allow-Origin"] = allow
            response.headers["Vary"] = "Origin"
            response.headers.setdefault("Access-Control-Expose-Headers", "X-Request-Id")
