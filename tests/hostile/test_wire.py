"""What a client gets from `python -m router` itself (the runner serving.py builds) for bytes it got wrong.

Every probe is answered with a JSON error, at once, and leaves no traceback in the router's log.
"""

from __future__ import annotations

import gzip

import logging

import pytest

from router.server.http_errors import RateLimitedLog

from .wire import WireRouter, request


@pytest.fixture(scope="module")
def wire(tmp_path_factory):
    router = WireRouter(tmp_path_factory.mktemp("wire") / "router.log", "--max-payload-size", "65536").start()
    yield router
    router.stop()
    assert "Traceback" not in router.log(), router.log()


def assert_json_error(answer, *statuses) -> dict:
    assert answer.status in statuses, answer
    assert answer.content_type == "application/json", answer
    error = answer.json()["error"]
    assert isinstance(error["message"], str) and error["message"], error
    return error


@pytest.mark.parametrize("path", ["/generate", "/v1/chat/completions", "/update_weights_from_disk"])
def test_a_declared_body_over_the_bound_is_refused_before_it_is_sent(wire, path):
    answer = wire.exchange(request("POST", path, Content_Length=str(10**12), Content_Type="application/json"),
                           timeout=5)
    assert_json_error(answer, 413)


@pytest.mark.parametrize("coding, body", [("gzip", b'{"text": "x"}'), ("br", b"\x1b\x03junk"),
                                          ("zstd", b"\x28\xb5\x2f\xfdjunk"), ("deflate", b"junk")])
@pytest.mark.parametrize("path", ["/generate", "/v1/rl/engine/update_weights_from_disk"])
def test_bodies_their_coding_does_not_describe_are_json_errors(wire, path, coding, body):
    answer = wire.exchange(request("POST", path, body, Content_Encoding=coding, Content_Type="application/json"))
    assert_json_error(answer, 400)


def test_a_gzip_body_is_decoded_by_the_router(wire):
    """Decoded, then judged: no worker here, so the valid request gets the router's 503 for an empty pool."""
    body = gzip.compress(b'{"text": "hello", "sampling_params": {"max_new_tokens": 1}}')
    answer = wire.exchange(request("POST", "/generate", body, Content_Encoding="gzip"))
    assert answer.status == 503 and "no routable" in assert_json_error(answer, 503)["message"]


def test_json_nested_too_deep_is_400(wire):
    """(The generation routes judge it once a pair is chosen: test_bodies.py, with workers.)"""
    deep = b'{"text": "x", "a": ' + b"[" * 300 + b"]" * 300 + b"}"
    for path in ("/update_weights_from_disk", "/v1/rl/engine/pause_generation", "/workers"):
        assert "nested deeper" in assert_json_error(wire.exchange(request("POST", path, deep)), 400)["message"]


def test_n_beyond_the_bound_is_400(wire):
    """Judged before a pair is chosen (this router has none: a request it could route would be 503)."""
    answer = wire.exchange(request("POST", "/generate", b'{"text": "x", "sampling_params": {"n": 1000000000}}'))
    assert "--max-n" in assert_json_error(answer, 400)["message"]


MALFORMED = [
    pytest.param(b"GARBAGE\r\n\r\n", 400, id="request-line"),
    pytest.param(b"G@T / HTTP/1.1\r\nHost: x\r\n\r\n", 400, id="method"),
    pytest.param(b"GET /health HTTP/9.9\r\nHost: x\r\n\r\n", 400, id="version"),
    pytest.param(b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 400, id="long-request-line"),
    pytest.param(b"GET /health HTTP/1.1\r\nHost: x\r\nX: " + b"a" * 9000 + b"\r\n\r\n", 400, id="long-header"),
    pytest.param(b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X: a\r\n" * 40000 + b"\r\n", 400, id="many-headers"),
    pytest.param(b"GET /health HTTP/1.1\r\nHost: x\r\nBad Header: a\r\n\r\n", 400, id="header-name"),
    pytest.param(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n"
                 b"0\r\n\r\n", 400, id="cl-and-te"),
    pytest.param(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nContent-Length: 5\r\n\r\n{}}",
                 400, id="two-lengths"),
    pytest.param(b"POST /generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked, x\r\n\r\n", 400,
                 id="bad-te"),
    pytest.param(b"POST /generate HTTP/1.1\r\nHost: x\r\nExpect: 200-nope\r\nContent-Length: 2\r\n\r\n{}", 417,
                 id="expect"),
    pytest.param(b"POST /generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
                 400, id="bad-chunk"),
    pytest.param(b"GET /workers HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer a\r\nAuthorization: Bearer b\r\n\r\n",
                 400, id="two-authorizations"),
    pytest.param(b"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer a\r\nauthorization: Bearer b\r\n"
                 b"Content-Length: 2\r\n\r\n{}", 400, id="two-authorizations-generation"),
]


@pytest.mark.parametrize("data, status", MALFORMED)
def test_malformed_http_gets_a_json_error(wire, data, status):
    assert_json_error(wire.exchange(data), status)


def test_a_flood_of_bad_requests_is_logged_in_a_few_lines(wire):
    before = wire.log().count("bad HTTP request from")
    for _ in range(60):
        assert wire.exchange(b"NOT HTTP AT ALL\r\n\r\n").status == 400
    answer = wire.exchange(request("GET", "/health"))  # and the router serves on (no workers: 503 JSON)
    assert answer.status == 503 and answer.json()["status"] == "unavailable"
    written = wire.log().count("bad HTTP request from") - before
    assert written <= 2 * 10, written  # one line each, at most 10 per 10 s (a window may turn meanwhile)
    assert "Traceback" not in wire.log()


def test_the_rate_limit_writes_one_line_per_bad_request_then_says_how_many_it_left_out(caplog):
    now = [0.0]
    log = RateLimitedLog(lines=3, window=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="router.http"):
        assert [log.warning("bad %d", i) for i in range(5)] == [True, True, True, False, False]
        now[0] = 10.0
        assert log.warning("bad %d", 5)
    assert [r.getMessage() for r in caplog.records] == [
        "bad 0", "bad 1", "bad 2", "bad 5 (2 more bad requests not logged in the last 10s)"]
