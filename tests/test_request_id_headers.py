"""`--request-id-headers` (sgl-router's, SMG's): the request id is the first listed header the client sent, and
comes back as X-Request-Id, on a plain answer, a stream and an error alike."""

from __future__ import annotations

import pytest

from router.core.config import ConfigError
from router.server.cli import config_from_args

HEADERS = ("x-correlation-id", "x-trace-id")


async def test_the_first_listed_header_present_is_the_id_and_is_echoed(sim_workers, make_router):
    p, d = await sim_workers()
    router = await make_router([p], [d], request_id_headers=HEADERS)
    resp = await router.post("/generate", json={"text": "hi"}, headers={"X-Trace-Id": "t-1"})
    assert resp.status == 200 and resp.headers["X-Request-Id"] == "t-1"
    resp = await router.post("/generate", json={"text": "hi", "stream": True},
                             headers={"X-Trace-Id": "t-2", "X-Correlation-Id": "c-2"})
    await resp.read()
    assert resp.headers["X-Request-Id"] == "c-2"  # the first listed wins
    resp = await router.post("/generate", data=b"{not json", headers={"X-Correlation-Id": "c-3"})
    assert resp.status == 400 and resp.headers["X-Request-Id"] == "c-3"
    resp = await router.get("/health")
    made = resp.headers["X-Request-Id"]  # none sent: one the router made, unique
    assert made and made != (await router.get("/health")).headers["X-Request-Id"]


async def test_without_the_flag_nothing_is_echoed(sim_workers, make_router):
    p, d = await sim_workers()
    router = await make_router([p], [d])
    resp = await router.post("/generate", json={"text": "hi"}, headers={"X-Trace-Id": "t-1"})
    assert resp.status == 200 and "X-Request-Id" not in resp.headers


def test_a_bad_header_name_is_refused():
    with pytest.raises(ConfigError, match="not an HTTP header name"):
        config_from_args(["--request-id-headers", "x trace"], env={})
    assert config_from_args(["--request-id-headers", *HEADERS], env={}).request_id_headers == HEADERS
