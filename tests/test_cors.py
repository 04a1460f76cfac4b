"""`--cors-allowed-origins` (sgl-router's, SMG's): allowed origins get CORS headers and preflights; others none."""

from __future__ import annotations

import pytest

from router.core.config import ConfigError
from router.server.cli import config_from_args

ORIGIN = "https://ui.example.com"
PREFLIGHT = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}


async def test_an_allowed_origin_is_answered_and_preflights_pass_before_the_key(sim_workers, make_router):
    p, d = await sim_workers()
    router = await make_router([p], [d], cors_allowed_origins=(ORIGIN,), api_key="k")
    resp = await router.options("/generate", headers=PREFLIGHT)
    assert resp.status == 204
    assert resp.headers["Access-Control-Allow-Origin"] == ORIGIN
    assert "POST" in resp.headers["Access-Control-Allow-Methods"]
    assert resp.headers["Access-Control-Allow-Headers"] == "authorization, content-type"
    auth = {"Authorization": "Bearer k", "Origin": ORIGIN}
    for stream in (False, True):
        resp = await router.post("/generate", json={"text": "hi", "stream": stream}, headers=auth)
        await resp.read()
        assert resp.status == 200 and resp.headers["Access-Control-Allow-Origin"] == ORIGIN, stream
        assert resp.headers["Vary"] == "Origin"
    resp = await router.post("/generate", json={"text": "hi"}, headers={"Origin": ORIGIN})
    assert resp.status == 401 and resp.headers["Access-Control-Allow-Origin"] == ORIGIN  # the browser sees why


async def test_another_origin_gets_no_cors_headers(sim_workers, make_router):
    p, d = await sim_workers()
    router = await make_router([p], [d], cors_allowed_origins=(ORIGIN,))
    resp = await router.options("/generate", headers={**PREFLIGHT, "Origin": "https://evil.example"})
    assert resp.status == 405 and "Access-Control-Allow-Origin" not in resp.headers
    resp = await router.post("/generate", json={"text": "hi"}, headers={"Origin": "https://evil.example"})
    assert resp.status == 200 and "Access-Control-Allow-Origin" not in resp.headers


async def test_any_origin_and_none_without_the_flag(sim_workers, make_router):
    p, d = await sim_workers()
    router = await make_router([p], [d], cors_allowed_origins=("*",))
    resp = await router.get("/health", headers={"Origin": "https://anywhere.example"})
    assert resp.headers["Access-Control-Allow-Origin"] == "*"
    plain = await make_router([p], [d])
    resp = await plain.get("/health", headers={"Origin": ORIGIN})
    assert "Access-Control-Allow-Origin" not in resp.headers
    assert (await plain.options("/generate", headers=PREFLIGHT)).status == 405


def test_a_bad_origin_is_refused():
    with pytest.raises(ConfigError, match="is not an origin"):
        config_from_args(["--cors-allowed-origins", "ui.example.com"], env={})
    config = config_from_args(["--cors-allowed-origins", ORIGIN, "*"], env={})
    assert config.cors_allowed_origins == (ORIGIN, "*")
