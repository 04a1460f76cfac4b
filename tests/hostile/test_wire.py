"""What a client gets from `python -m router` itself (the runner serving.py builds) for bytes it got wrong.

Every probe is answered with a JSON error, at once, and leaves no traceback in the router's log.
"""

from __future__ import annotations

import gzip

import pytest

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
