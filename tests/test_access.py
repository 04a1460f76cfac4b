"""Route classification, API keys and malformed input, checked on every route the app registers.

The routes are read from `app.router`, so endpoints added later (conversion, weight updates, ...) are
covered without touching this file: a new control endpoint is admin-only and must answer bad input with a
4xx JSON error, or this test fails.
"""

from __future__ import annotations

import contextlib
import re

import aiohttp
import pytest

from router.api.access import PUBLIC_ROUTES, Access, bearer_token, classify, key_matches, routes_by_access
from router.dataplane.admission import ADMISSION

from .helpers import wait_for

GEN_KEY = "gen-secret"
ADMIN_KEY = "admin-secret"
UNKNOWN = "no-such-worker"
TIMEOUT = aiohttp.ClientTimeout(total=15)

# Control endpoints that, like mini_lb's, take no input at all (so a body with wrong types is ignored).
TAKES_NO_INPUT = {("POST", "/flush_cache"), ("GET", "/flush_cache")}

MALFORMED_BODIES = [
    pytest.param(b"{not json", id="not-json"),
    pytest.param(b"[1, 2]", id="array"),
    pytest.param(b'"text"', id="string"),
    pytest.param(b"5", id="number"),
    pytest.param(b"null", id="null"),
    pytest.param(b'{"url": ', id="truncated"),
]
WRONG_TYPES = {
    "url": 5, "registry_url": {"a": 1}, "worker_type": 7, "role": ["x"], "mode": [], "bootstrap_port": "port",
    "new_role": 3, "worker_id": 1.5, "timeout": "soon", "timeout_secs": "soon", "drain": "maybe",
    "model_path": 0, "abort_all_requests": "yes", "weight_version": {}, "flush_cache": "no",
    "unexpected_field": True,
}
GARBAGE_QUERY = {"url": "::not a url", "bootstrap_port": "abc", "worker_type": "7", "timeout": "x", "role": "?"}


def concrete(path: str) -> str:
    """A callable path for a canonical one: every `{param}` becomes an id that names no worker."""
    return re.sub(r"\{[^}]+\}", UNKNOWN, path)


def method_routes(client, access: Access) -> list[tuple[str, str]]:
    return sorted(set(routes_by_access(client.app)[access]))


async def assert_json_error(resp, statuses) -> dict:
    assert resp.status in statuses, (resp.method, resp.url.path, resp.status, await resp.text())
    assert resp.content_type == "application/json", (resp.url.path, await resp.text())
    body = await resp.json()
    assert isinstance(body["error"]["message"], str) and body["error"]["message"], body
    return body


@contextlib.asynccontextmanager
async def router_with_both_keys(start_workers, make_router):
    p, d = await start_workers(1, 1)
    client = await make_router([p], [d], api_key=GEN_KEY, admin_api_key=ADMIN_KEY)
    yield client
    await wait_for(lambda: all(w.inflight == 0 for w in client.registry.workers()), message="in-flight back to 0")
    assert client.app[ADMISSION].active == 0


@pytest.fixture
async def guarded(sim_workers, make_router):
    """A router with both keys, in front of one prefill and one decode."""
    async with router_with_both_keys(sim_workers, make_router) as client:
        yield client


@pytest.fixture
async def open_router(sim_workers, make_router):
    p, d = await sim_workers(1, 1)
    client = await make_router([p], [d])
    yield client
    await wait_for(lambda: all(w.inflight == 0 for w in client.registry.workers()), message="in-flight back to 0")
    assert client.app[ADMISSION].active == 0


# ---- classification ---------------------------------------------------------------------------------------
def test_classification_defaults_to_admin():
    assert classify("/generate") is Access.GENERATION
    assert classify("/v1/chat/completions") is Access.GENERATION
    assert classify("/health") is Access.PUBLIC and classify("/metrics") is Access.PUBLIC
    for path in ("/workers", "/register", "/flush_cache", "/admin/anything/new", "/update_weights_from_disk",
                 "/pause_generation", "/abort_request", "/some_future_endpoint"):
        assert classify(path) is Access.ADMIN, path


async def test_every_registered_route_is_classified(open_router):
    by_access = routes_by_access(open_router.app)
    everything = {r for routes in by_access.values() for r in routes}
    assert ("POST", "/generate") in by_access[Access.GENERATION]
    admin_paths = {path for _, path in by_access[Access.ADMIN]}
    assert {"/workers", "/workers/{worker_id}", "/register", "/add_worker", "/flush_cache"} <= admin_paths
    assert all(path in PUBLIC_ROUTES for _, path in by_access[Access.PUBLIC])
    assert not any(path.startswith("/admin") for _, path in by_access[Access.PUBLIC] + by_access[Access.GENERATION])
    assert len(everything) == sum(len(set(v)) for v in by_access.values())


@pytest.mark.parametrize("header,token", [
    (None, None), ("", None), ("Bearer", None), ("Bearer   ", None), ("Basic abc", None),
    ("Bearer abc", b"abc"), ("bearer  abc ", b"abc"),
])
def test_bearer_token_parsing(header, token):
    assert bearer_token(header) == token


def test_key_matching():
    assert key_matches(b"k1", (b"k0", b"k1"))
    assert not key_matches(b"k", (b"k0", b"k1"))
    assert not key_matches(None, (b"k0",))


# ---- keys ----------------------------------------------------------------------------------------------------
BAD_AUTH = [
    pytest.param({}, id="no-header"),
    pytest.param({"Authorization": "Bearer wrong-key"}, id="wrong-key"),
    pytest.param({"Authorization": f"Basic {ADMIN_KEY}"}, id="wrong-scheme"),
    pytest.param({"Authorization": ADMIN_KEY}, id="no-scheme"),
    pytest.param({"Authorization": f"Bearer {ADMIN_KEY}x"}, id="key-prefix"),
]


@pytest.mark.parametrize("headers", BAD_AUTH)
async def test_admin_and_generation_routes_refuse_calls_without_the_key(guarded, headers):
    for access in (Access.ADMIN, Access.GENERATION):
        for method, path in method_routes(guarded, access):
            resp = await guarded.request(method, concrete(path), headers=headers, json={}, timeout=TIMEOUT)
            body = await assert_json_error(resp, {401})
            assert resp.headers["WWW-Authenticate"] == "Bearer"
            assert body["error"]["type"] == "authentication_error"


async def test_generation_key_does_not_open_admin_routes(guarded):
    for method, path in method_routes(guarded, Access.ADMIN):
        resp = await guarded.request(method, concrete(path), json={},
                                     headers={"Authorization": f"Bearer {GEN_KEY}"}, timeout=TIMEOUT)
        await assert_json_error(resp, {401})


async def test_admin_key_opens_every_admin_route(guarded):
    for method, path in method_routes(guarded, Access.ADMIN):
        resp = await guarded.request(method, concrete(path), headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                                     timeout=TIMEOUT)
        assert resp.status != 401 and resp.status < 500, (method, path, resp.status, await resp.text())


async def test_only_the_api_key_opens_generation(guarded):
    """As in SGLang's own server: generation needs --api-key; the admin key does not open it."""
    resp = await guarded.post("/generate", json={"text": "hi"}, headers={"Authorization": f"Bearer {GEN_KEY}"})
    assert resp.status == 200, await resp.text()
    resp = await guarded.post("/generate", json={"text": "hi"}, headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    await assert_json_error(resp, {401})


async def test_public_routes_need_no_key(guarded):
    for method, path in method_routes(guarded, Access.PUBLIC):
        resp = await guarded.request(method, concrete(path), timeout=TIMEOUT)
        assert resp.status != 401, (method, path)


async def test_api_key_alone_guards_admin_routes_too(sim_workers, make_router):
    """sgl-router's rule: with --api-key only, that key opens the control routes as well."""
    p, d = await sim_workers(1, 1)
    client = await make_router([p], [d], api_key=GEN_KEY)
    assert (await client.get("/workers")).status == 401
    assert (await client.get("/workers", headers={"Authorization": f"Bearer {GEN_KEY}"})).status == 200
    assert (await client.post("/generate", json={"text": "x"})).status == 401
    assert (await client.get("/health")).status == 200


async def test_admin_key_alone_leaves_generation_open(sim_workers, make_router):
    p, d = await sim_workers(1, 1)
    client = await make_router([p], [d], admin_api_key=ADMIN_KEY)
    assert (await client.post("/generate", json={"text": "x"})).status == 200
    assert (await client.get("/workers")).status == 401
    assert (await client.get("/workers", headers={"Authorization": f"Bearer {ADMIN_KEY}"})).status == 200


async def test_no_key_leaves_everything_open(open_router):
    for method, path in method_routes(open_router, Access.ADMIN):
        resp = await open_router.request(method, concrete(path), timeout=TIMEOUT)
        assert resp.status != 401, (method, path)


# ---- malformed input to every admin endpoint ---------------------------------------------------------------
@pytest.mark.parametrize("data", MALFORMED_BODIES)
async def test_malformed_json_to_every_admin_endpoint_is_400(guarded, data):
    auth = {"Authorization": f"Bearer {ADMIN_KEY}", "Content-Type": "application/json"}
    for method, path in method_routes(guarded, Access.ADMIN):
        resp = await guarded.request(method, concrete(path), data=data, headers=auth, timeout=TIMEOUT)
        await assert_json_error(resp, {400})


async def test_wrong_types_to_every_admin_endpoint_are_4xx(guarded):
    auth = {"Authorization": f"Bearer {ADMIN_KEY}"}
    for method, path in method_routes(guarded, Access.ADMIN):
        resp = await guarded.request(method, concrete(path), json=WRONG_TYPES, headers=auth, timeout=TIMEOUT)
        if method == "GET" or (method, path) in TAKES_NO_INPUT:
            assert resp.status < 500, (method, path, resp.status, await resp.text())
            if resp.status >= 400:
                await assert_json_error(resp, range(400, 500))
        else:
            await assert_json_error(resp, range(400, 500))


async def test_garbage_query_to_every_admin_endpoint_is_never_5xx(guarded):
    auth = {"Authorization": f"Bearer {ADMIN_KEY}"}
    for method, path in method_routes(guarded, Access.ADMIN):
        resp = await guarded.request(method, concrete(path), params=GARBAGE_QUERY, headers=auth, timeout=TIMEOUT)
        assert resp.status < 500, (method, path, resp.status, await resp.text())
        if resp.status >= 400:
            await assert_json_error(resp, range(400, 500))


async def test_unknown_worker_in_every_path_is_404(guarded):
    auth = {"Authorization": f"Bearer {ADMIN_KEY}"}
    routes = [(m, p) for m, p in method_routes(guarded, Access.ADMIN) if "{" in p]
    assert routes, "the app has worker routes with path parameters"
    for method, path in routes:
        resp = await guarded.request(method, concrete(path), json={}, headers=auth, timeout=TIMEOUT)
        body = await assert_json_error(resp, {404})
        assert UNKNOWN in body["error"]["message"]
