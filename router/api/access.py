"""Who may call which route, and what a control call must send: one classification for the whole app.

Every route is PUBLIC (health and read-only info, /metrics), GENERATION (the proxied routes), or ADMIN —
and ADMIN is the default, so an endpoint added later (conversion, weight updates, anything under /admin)
is protected without anyone remembering to protect it.

Keys follow sgl-router (smg's `auth_middleware`, the code sglang-router 0.3.2 is built from): with
`--api-key`, the generation routes *and* the control routes need `Authorization: Bearer KEY`; health,
models and server info stay open. `--admin-api-key` follows SGLang 0.5.23's own server (`srt/utils/auth.py`:
its control endpoints are ADMIN_OPTIONAL, generation NORMAL): when given, the control routes need that key
and the generation key no longer opens them, while generation still needs exactly `--api-key` (the admin
key does not open it). With no key at all everything is open, as with mini_lb. Constant-time compares.
`--admin-allow-cidrs` also refuses admin calls from other source addresses (403, before any key is looked
at); `RouterConfig.warnings()` says when admin routes are open to the network.

Control calls that carry a body must send a JSON object: anything else is 400 before the handler runs
(the parsed body is kept under `JSON_BODY` so handlers do not parse it twice), and one over
`--max-admin-payload-size` (1 MiB) is 413 before it is read whole (generation keeps `--max-payload-size`).
"""

from __future__ import annotations

import enum
import hmac
import logging
from typing import Iterable

from aiohttp import web

from router.core.config import RouterConfig
from router.core.allowlists import CallerAllowList
from router.core.errors import BadRequest, Forbidden, RouterError, Unauthorized, parse_json_object
from router.core.router_identity import HOP_HEADER, hop_refusal
from router.core.request_body import check_reserializable, decode_content, read_bounded
from router.core.request_shape import GENERATE_ROUTES


class Access(str, enum.Enum):
    PUBLIC = "public"
    GENERATION = "generation"
    ADMIN = "admin"


# Canonical route paths (aiohttp's `resource.canonical`) that anyone may call.
PUBLIC_ROUTES = frozenset({
    "/health", "/health_generate", "/liveness", "/readiness",
    "/v1/models", "/get_model_info", "/model_info", "/get_server_info", "/server_info",
    "/metrics", "/openapi.json",
})
GENERATION_ROUTES = frozenset(GENERATE_ROUTES)

audit_logger = logging.getLogger("router.audit")
# Who made the call: the id of the key it sent ("api-key", "admin-api-key", a --control-plane-api-keys id),
# or "anonymous" where no key is needed.
CALLER = web.RequestKey("caller", str) if hasattr(web, "RequestKey") else "pd_router.caller"
# The control call's parsed body (a typed request key where aiohttp has them, 3.13+).
JSON_BODY = web.RequestKey("json_body", dict) if hasattr(web, "RequestKey") else "pd_router.json_body"


def classify(canonical_path: str) -> Access:
    if canonical_path in PUBLIC_ROUTES:
        return Access.PUBLIC
    if canonical_path in GENERATION_ROUTES:
        return Access.GENERATION
    return Access.ADMIN


def required_keys(access: Access, config: RouterConfig) -> tuple[bytes, ...]:
    """The keys that open a route of this class; empty: open to anyone."""
    return tuple(key for key, _ in named_keys(access, config))


def named_keys(access: Access, config: RouterConfig) -> tuple[tuple[bytes, str], ...]:
    """(key, who) for each key that opens a route of this class; who is what the audit log names. SMG's
    `--control-plane-api-keys id:name:role:key`: an admin-role key opens the admin routes; a user-role key
    (and an admin one) opens the generation routes where those need a key (`--api-key`)."""
    api = ((config.api_key.encode(), "api-key"),) if config.api_key else ()
    admin = ((config.admin_api_key.encode(), "admin-api-key"),) if config.admin_api_key else ()
    entries = config.control_plane_keys()
    if access is Access.GENERATION:
        return api + tuple((e.key.encode(), e.id) for e in entries) if api else ()
    if access is Access.ADMIN:
        return (admin or api) + tuple((e.key.encode(), e.id) for e in entries if e.role == "admin")
    return ()


def bearer_token(header: str | None) -> bytes | None:
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip().encode()


def key_matches(token: bytes | None, keys: Iterable[bytes]) -> bool:
    """Constant time in the token's content: every key is compared, whatever matched before."""
    return matched_key(token, keys) is not None


def matched_key(token: bytes | None, keys: Iterable[bytes]) -> int | None:
    """The index of the key the token is (every key compared, whatever matched before); None: none."""
    found = None
    for index, key in enumerate(keys):
        if hmac.compare_digest(token or b"", key) and found is None:
            found = index
    return found if token is not None else None


# Admin routes whose bodies are big by nature (serialized tensors): the generation bound applies to them.
LARGE_ADMIN_BODIES = frozenset({"/update_weights_from_tensor", "/v1/rl/engine/update_weights_from_tensor"})


async def checked_json_body(request: web.Request, config: RouterConfig) -> dict | None:
    """A control call's body: None when empty, a dict when a JSON object, else 400; 413 when over its bound."""
    if not request.body_exists:
        return None
    limits = config.admission
    if request.match_info.route.resource.canonical in LARGE_ADMIN_BODIES \
            or limits.max_payload_size <= limits.max_admin_payload_size:  # the app's bound is the tighter one
        limit, flag = limits.max_payload_size, "--max-payload-size"
    else:
        limit, flag = limits.max_admin_payload_size, "--max-admin-payload-size"
    raw = decode_content(request, await read_bounded(request, limit, flag), limit, flag)
    if not raw.strip():
        return None
    body = parse_json_object(raw)
    check_reserializable(body)  # admin bodies are small: a second pass over them costs nothing
    return body


def make_access_middleware(config: RouterConfig):
    named = {access: named_keys(access, config) for access in Access}
    keys = {access: tuple(key for key, _ in named[access]) for access in Access}
    audit = config.control_plane_audit_enabled
    by_resource: dict[object, Access] = {}  # classification cached per route (the hot path is one lookup)
    admin_callers = CallerAllowList.parse(config.admin_allow_cidrs)

    @web.middleware
    async def access_middleware(request: web.Request, handler):
        if HOP_HEADER in request.headers:  # another router's call to a worker: this one is no worker
            return hop_refusal(request)
        resource = request.match_info.route.resource
        access = by_resource.get(resource)
        if access is None:
            if resource is None:  # 404/405: nothing to protect
                return await handler(request)
            access = by_resource[resource] = classify(resource.canonical)
        if access is Access.PUBLIC:
            return await handler(request)
        if access is Access.ADMIN and audit:
            return await audited(request, handler, access)
        return await checked(request, handler, access)

    async def audited(request: web.Request, handler, access: Access):
        status, who = 500, "-"
        try:
            response = await checked(request, handler, access)
            status, who = response.status, request.get(CALLER, "-")
            return response
        except RouterError as error:
            status, who = error.status, request.get(CALLER, "-")
            raise
        except web.HTTPException as error:
            status, who = error.status, request.get(CALLER, "-")
            raise
        finally:
            audit_logger.info("admin call %s %s by %s from %s: %d", request.method, request.path, who,
                              request.remote, status,
                              extra={"fields": {"audit": True, "method": request.method, "path": request.path,
                                                "caller": who, "remote": request.remote, "status": status}})

    async def checked(request: web.Request, handler, access: Access):
        if "Authorization" in request.headers and len(request.headers.getall("Authorization")) > 1:
            raise BadRequest(f"{request.method} {request.path}: more than one Authorization header (which one "
                             f"would count is not for the router to guess)", param="Authorization")
        if access is Access.ADMIN and not admin_callers.allows(request.remote):
            raise Forbidden(f"{request.method} {request.path}: admin calls are not accepted from "
                            f"{request.remote} (--admin-allow-cidrs)")
        wanted = keys[access]
        if wanted:
            index = matched_key(bearer_token(request.headers.get("Authorization")), wanted)
            if index is None:
                what = "an admin API key" if access is Access.ADMIN else "an API key"
                raise Unauthorized(f"{request.method} {request.path} needs {what}: 'Authorization: Bearer KEY'",
                                   headers={"WWW-Authenticate": "Bearer"})
            if audit:  # who, for the audit line (nothing stored per request otherwise)
                request[CALLER] = named[access][index][1]
        elif audit:
            request[CALLER] = "anonymous"
        if access is Access.ADMIN:
            body = await checked_json_body(request, config)
            if body is not None:
                request[JSON_BODY] = body
        return await handler(request)

    return access_middleware


def routes_by_access(app: web.Application) -> dict[Access, list[tuple[str, str]]]:
    """(method, canonical path) of every registered route, by class: for tests and the docs."""
    out: dict[Access, list[tuple[str, str]]] = {access: [] for access in Access}
    for route in app.router.routes():
        if route.method == "HEAD" or route.resource is None:
            continue
        out[classify(route.resource.canonical)].append((route.method, route.resource.canonical))
    return out
