"""The ceiling fleet: nginx answers what SGLang servers answer, per role, and stops cleanly."""

import os
import shutil
import urllib.request
from pathlib import Path

import orjson
import pytest

from bench import procs
from bench.ceiling import GENERATE_BODY, CeilingFleet

pytestmark = pytest.mark.skipif(shutil.which("nginx") is None and not Path("/usr/sbin/nginx").exists(),
                                reason="nginx not installed (python -m bench.setup)")


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as response:
        assert response.status == 200
        return orjson.loads(response.read())


def test_instant_servers_answer_like_sglang(tmp_path):
    ceiling = CeilingFleet(tmp_path)
    with ceiling as fleet:
        assert len(fleet.prefill) == 2 and len(fleet.decode) == 2
        for url, bootstrap_port in fleet.prefill:
            for path in ("/server_info", "/get_server_info"):
                info = get_json(url + path)
                assert info["disaggregation_mode"] == "prefill"
                assert info["disaggregation_bootstrap_port"] == bootstrap_port
        assert get_json(fleet.decode[0] + "/model_info")["disaggregation_mode"] == "decode"
        request = urllib.request.Request(fleet.decode[1] + "/generate", data=b'{"text": "hi"}',
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=5) as response:
            assert response.headers["Content-Type"] == "application/json"
            assert orjson.loads(response.read()) == GENERATE_BODY
        assert procs.http_status(fleet.decode[0] + "/health") == 200
        assert procs.http_status(fleet.decode[0] + "/no_such_thing") == 404
        pid = ceiling.child.pid
    assert not ceiling.child.alive()
    assert procs.http_status(fleet.decode[0] + "/health") is None
    with pytest.raises(ProcessLookupError):  # nothing left in nginx's process group (master and workers)
        os.killpg(pid, 0)


async def test_client_cost_measures_each_client_against_the_backend(tmp_path):
    from bench.client_cost import compare

    with CeilingFleet(tmp_path) as fleet:
        costs = await compare(fleet.decode[0], requests=200, concurrency=4)  # each raises on a non-200
    assert set(costs) == {"aiohttp pooled", "aiohttp new connection", "minimal protocol"}
    assert all(micros > 0 for micros in costs.values())


def test_parser_cost_compares_the_legs_parsing_with_a_revision():
    """bench.parser_cost: every wire shape is read alike by this checkout's parsing and a revision's (HEAD here,
    as any clone has it), and each measurement gives a time per response."""
    import asyncio

    from bench import parser_cost
    from router.dataplane.upstream_http.response import UpstreamResponse

    if shutil.which("git") is None or not (parser_cost.REPO_ROOT / ".git").exists():
        pytest.skip("no git checkout to read a revision from")
    base = parser_cost.baseline_class("HEAD")
    loop = asyncio.new_event_loop()
    try:
        pool = parser_cost._Pool(loop)
        for make in parser_cost.WIRES.values():
            reads = make()
            parser_cost.check(reads, pool, (base, UpstreamResponse))
            assert parser_cost._run(UpstreamResponse, reads, pool, 10) > 0
        assert pool.idle > 0  # whole answers hand their connection back
    finally:
        loop.close()
