"""Structured logs: the request id on every line of a request, access lines, JSON and text formats."""

from __future__ import annotations

import io
import logging

import orjson
import pytest

from router.server.cli import config_from_args
from router.core.config import HealthConfig, RetryConfig
from router.obs.logs import REQUEST_ID, make_handler

NO_PROBES = HealthConfig(enabled=False)


@pytest.fixture
def captured():
    """Every record logged during the test, formatted by the router's own JSON handler."""
    stream = io.StringIO()
    handler = make_handler(json_lines=True, stream=stream)
    root = logging.getLogger()
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)

    def lines() -> list[dict]:
        return [orjson.loads(line) for line in stream.getvalue().splitlines() if line.strip()]

    yield lines
    root.removeHandler(handler)
    root.setLevel(old_level)


async def test_client_request_id_is_on_every_line_of_the_request(sim_workers, make_router, captured):
    p, d1, d2 = await sim_workers(1, 2)
    client = await make_router([p], [d1, d2], health=NO_PROBES, retry=RetryConfig(initial_backoff_ms=1))
    d1.set_faults(error_rate=1.0, error_status=503)
    d2.set_faults(error_rate=1.0, error_status=503)
    resp = await client.post("/generate", json={"text": "x"}, headers={"X-Request-Id": "client-42"})
    assert resp.status == 503
    mine = [line for line in captured() if line["request_id"] == "client-42"]
    retry_lines = [line for line in mine if "retrying on another pair" in line["message"]]
    access = [line for line in mine if line["logger"] == "router.access"]
    assert retry_lines, "the proxy's retry warning carries the request id"
    assert len(access) == 1
    entry = access[0]
    assert entry["level"] == "WARNING" and entry["status"] == 503 and entry["outcome"] == "error"
    assert entry["route"] == "/generate" and entry["decode"] in (d1.url, d2.url) and entry["attempts"] == 4
    assert "503" in entry["error"]


async def test_router_made_request_ids_are_distinct(sim_workers, make_router, captured):
    p, d = await sim_workers(1, 1)
    client = await make_router([p], [d], health=NO_PROBES)
    for _ in range(3):
        assert (await client.post("/generate", json={"text": "x"})).status == 200
    access = [line for line in captured() if line["logger"] == "router.access"]
    assert len(access) == 3 and all(line["level"] == "DEBUG" and line["status"] == 200 for line in access)
    ids = {line["request_id"] for line in access}
    assert len(ids) == 3 and "-" not in ids


async def test_hostile_request_id_is_cleaned(sim_workers, make_router, captured):
    p, d = await sim_workers(1, 1)
    client = await make_router([p], [d], health=NO_PROBES)
    d.set_faults(error_rate=1.0, error_status=400)
    await client.post("/generate", json={"text": "x"}, headers={"X-Request-Id": "a" * 500})
    (entry,) = [line for line in captured() if line["logger"] == "router.access"]
    assert entry["request_id"] == "a" * 128


def test_text_format_carries_the_request_id():
    stream = io.StringIO()
    handler = make_handler(json_lines=False, stream=stream)
    logger = logging.getLogger("router.test_text_format")
    logger.addHandler(handler)
    logger.propagate = False
    token = REQUEST_ID.set("rid-7")
    try:
        logger.warning("hello %s", "there")
    finally:
        REQUEST_ID.reset(token)
        logger.removeHandler(handler)
    line = stream.getvalue().strip()
    assert line.endswith("WARNING router.test_text_format [rid-7] hello there")


def test_log_json_flag():
    assert config_from_args(["--log-json"], env={}).log_json is True
    assert config_from_args([], env={}).log_json is False


def test_the_process_is_named_on_every_line_when_several_share_one_stream():
    """`--replicas N`: the supervisor and its children write to one stream; each line says whose it is."""
    for json_lines in (False, True):
        stream = io.StringIO()
        handler = make_handler(json_lines=json_lines, stream=stream, process="replica 1")
        logger = logging.getLogger("router.test_process_tag")
        logger.addHandler(handler)
        logger.propagate = False
        try:
            logger.warning("hello")
        finally:
            logger.removeHandler(handler)
        line = stream.getvalue().strip()
        if json_lines:
            assert orjson.loads(line)["process"] == "replica 1"
        else:
            assert line.endswith("WARNING router.test_process_tag (replica 1) [-] hello")
