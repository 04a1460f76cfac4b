"""What a client gets from `python -m router` itself (the runner serving.py builds) for bytes it got wrong.

Every probe is answered with a JSON error, at once, and leaves no traceback in the router's log.
"""

from __future__ import annotations

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
