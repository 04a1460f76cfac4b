"""A pd-router is never a worker, and a fan-out cannot recurse: real router processes registered into each
other and into themselves, every way a worker gets in; a router that has itself among its workers anyway
answers each fan-out in one hop, with memory and call counts bounded."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from types import SimpleNamespace

import aiohttp
import orjson
import pytest
from aiohttp.test_utils import TestServer

from harness.processes import rss_kib
from router.core.config import RouterConfig, WorkerSpec
from router.core.keys import REGISTRY
from router.core.registry import Role
from router.core.router_identity import HOP_HEADER, INSTANCE, MARKER_FIELD, is_local_address, is_own_address
from router.server.app import create_app

from ..conftest import RUNNER_KWARGS
from ..helpers import free_port, wait_for
from ..router_process import REPO, RouterProcess

TIMEOUT = aiohttp.ClientTimeout(total=20)


async def post(session, url, body=None, **kw):
    async with session.post(url, json=body, **kw) as resp:
        raw = await resp.read()
        return resp.status, orjson.loads(raw) if raw else None


@pytest.fixture
async def two_routers(sim_workers, tmp_path):
    """Routers A and B (real processes) in front of the same 1P+1D; A also reads a discovery file."""
    p, d = await sim_workers(1, 1)
    fleet = SimpleNamespace(prefill=[p], decode=[d])
    listing = tmp_path / "workers.json"
    listing.write_bytes(orjson.dumps({"workers": []}))
    a = RouterProcess(fleet, "--discovery-file", str(listing), "--discovery-file-interval-secs", "0.1",
                      log_path=tmp_path / "a.log")
    b = RouterProcess(fleet, log_path=tmp_path / "b.log")
    started = await asyncio.gather(a.start(), b.start(), return_exceptions=True)  # both at once
    try:
        for outcome in started:
            if isinstance(outcome, BaseException):
                raise outcome
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            yield SimpleNamespace(a=a, b=b, p=p, d=d, listing=listing, session=session)
    finally:
        for router, outcome in zip((a, b), started):
            if not isinstance(outcome, BaseException):
                await router.__aexit__(None, None, None)
    assert "Traceback" not in a.log() and "Traceback" not in b.log()


async def test_a_router_refuses_itself_and_any_pd_router_as_a_worker(two_routers):
    t = two_routers
    own = [t.a.url, f"http://localhost:{t.a.port}", f"http://0.0.0.0:{t.a.port}", f" HTTP://127.0.0.1:{t.a.port}/"]
    for url in own + [t.b.url]:
        for path, kw in (("/workers", {"json": {"url": url, "worker_type": "decode"}}),
                         ("/workers", {"json": {"url": url}}),
                         ("/add_worker", {"params": {"url": url, "worker_type": "prefill"}}),
                         ("/register", {"json": {"mode": "decode", "registry_url": url, "bootstrap_port": None}})):
            async with t.session.post(t.a.url + path, **kw) as resp:
                body = await resp.json()
                assert resp.status == 400, (url, path, body)
                assert body["error"]["param"] in ("url", "registry_url")
                who = "this router itself" if url in own else "another pd-router"
                assert who in body["error"]["message"], (url, body)
    async with t.session.get(t.a.url + "/workers") as resp:
        assert (await resp.json())["total"] == 2


async def test_a_discovery_file_naming_a_router_leaves_it_failed_and_out_of_every_fan_out(two_routers):
    t = two_routers
    t.listing.write_bytes(orjson.dumps({"workers": [{"url": t.b.url, "worker_type": "decode"},
                                                    {"url": t.a.url, "worker_type": "decode"}]}))

    async def listed():
        async with t.session.get(t.a.url + "/admin/discovery") as resp:
            return (await resp.json())["sources"][0]

    async def b_failed():
        async with t.session.get(t.a.url + "/workers") as resp:
            workers = {w["url"]: w for w in (await resp.json())["workers"]}
        return workers.get(t.b.url, {}).get("state") == "failed" and workers

    workers = await wait_for(b_failed, timeout=15, message="B read and left failed") or await b_failed()
    assert "another pd-router" in workers[t.b.url]["state_reason"] and not workers[t.b.url]["routable"]
    assert t.a.url not in workers  # itself: refused by its address, never added
    source = await listed()
    assert any("this router itself" in (e.get("problem") or "") for e in source["workers"]), source
    b_calls = await _requests_seen(t.session, t.b.url)
    for _ in range(20):  # fan-outs of A: B is out of every one
        assert (await post(t.session, t.a.url + "/abort_request", {"rid": "nobody"}))[0] == 200
        async with t.session.post(t.a.url + "/flush_cache") as resp:
            assert resp.status == 200
    assert await _requests_seen(t.session, t.b.url) == b_calls


async def _requests_seen(session, url) -> float:
    """Requests a router answered, other than its /metrics (pd_router_requests_total)."""
    async with session.get(url + "/metrics") as resp:
        text = await resp.text()
    total = 0.0
    for line in text.splitlines():
        if line.startswith("pd_router_requests_total{") and 'route="/metrics"' not in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


async def test_a_call_from_another_routers_fan_out_is_not_fanned_out_again(two_routers):
    """Memory and the calls B makes stay flat however many such calls come."""
    t = two_routers
    aborts_before = len(t.p.aborts) + len(t.d.aborts)
    for path in ("/abort_request", "/flush_cache", "/pause_generation", "/server_info", "/generate"):
        async with t.session.request("GET" if path == "/server_info" else "POST", t.b.url + path,
                                     json={"rid": "x"}, headers={HOP_HEADER: "another-router"}) as resp:
            body = await resp.json()
            assert resp.status == 400 and body["error"]["type"] == "pd_router_loop", (path, body)
            assert isinstance(body[MARKER_FIELD]["instance"], str)
    before = rss_kib(t.b.proc.pid)
    calls = [post(t.session, t.b.url + "/abort_request", {"abort_all": True}, headers={HOP_HEADER: "x"})
             for _ in range(300)]
    assert {status for status, _ in await asyncio.gather(*calls)} == {400}
    assert len(t.p.aborts) + len(t.d.aborts) == aborts_before  # nothing reached B's servers
    assert rss_kib(t.b.proc.pid) - before < 20 * 1024, "B's memory grew"


def test_the_command_line_refuses_the_routers_own_address(tmp_path):
    port = free_port()
    proc = subprocess.run([sys.executable, "-m", "router", "--host", "127.0.0.1", "--port", str(port),
                           "--prefill", f"http://127.0.0.1:{port}", "--decode", f"http://localhost:{port}"],
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.count("is this router itself") == 2, proc.stderr


async def test_a_router_with_itself_among_its_workers_answers_a_fan_out_in_one_hop(sim_workers):
    """However it got in, a router that is its own worker cannot recurse: an abort reaches it twice (the
    client's call, and its own fan-out's, refused), not thousands of times."""
    p, d = await sim_workers(1, 1)
    port = free_port()
    config = RouterConfig(prefill=(WorkerSpec(p.url, p.bootstrap_port),), decode=(WorkerSpec(d.url),),
                          port=port).validated()
    app = create_app(config)
    seen: list[str] = []
    nesting = {"now": 0, "most": 0}  # requests being answered at once: a call that recursed would nest

    @aiohttp.web.middleware
    async def count(request, handler):
        seen.append(request.path)
        nesting["now"] += 1
        nesting["most"] = max(nesting["most"], nesting["now"])
        try:
            return await handler(request)
        finally:
            nesting["now"] -= 1

    app.middlewares.insert(0, count)
    server = TestServer(app, port=port)
    await server.start_server(**RUNNER_KWARGS)
    try:
        own = app[REGISTRY].add(f"http://127.0.0.1:{port}", Role.DECODE, None, reason="test: slipped in")
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
            status, body = await post(session, f"http://127.0.0.1:{port}/abort_request", {"rid": "nobody"})
            assert status == 502, body  # one of its "servers" (itself) refused the call
            assert any(o["url"] == own.url and o["status"] == 400 for o in body["workers"]), body
            assert seen.count("/abort_request") == 2
            async with session.get(f"http://127.0.0.1:{port}/server_info") as resp:
                assert resp.status == 200 and (await resp.json())[MARKER_FIELD] == {"instance": INSTANCE}
            # the rest is its own upkeep of that "worker" (a probe, a reading: it is found to be a pd-router),
            # one call at a time per loop, none waiting on another of its own
            assert nesting["most"] <= 4, (nesting, seen)
    finally:
        await server.close()


def test_own_addresses():
    assert is_own_address(["127.0.0.1"], 8000, "0.0.0.0", 8000)
    assert is_own_address(["::1"], 8000, "", 8000)
    assert is_own_address(["0.0.0.0"], 8000, "127.0.0.1", 8000)
    assert not is_own_address(["127.0.0.1"], 8001, "0.0.0.0", 8000)
    assert not is_own_address(["127.0.0.2"], 8000, "127.0.0.1", 8000)
    assert not is_own_address(["192.0.2.77"], 8000, "0.0.0.0", 8000)  # TEST-NET: not this machine's
    local = [a for a in subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split()
             if is_local_address(a)]
    for address in local:  # this machine's interfaces, when it listens on every one
        assert is_own_address([address], 8000, "0.0.0.0", 8000)
        assert not is_own_address([address], 8000, "127.0.0.1", 8000)
