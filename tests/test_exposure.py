"""Exposure: a warning when admin routes are open to the network, admin callers restricted by source address
(--admin-allow-cidrs), and the workers that may be registered restricted by host or network (--worker-allow).
Both restrictions are off by default (drop-in compatibility)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time

import pytest

from router.core.allowlists import CallerAllowList, WorkerAllowList
from router.core.config import RouterConfig, is_loopback

from .helpers import free_port

OPEN = "admin routes need no key"


# ---- the warning -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("settings,warned", [
    ({}, True),  # the default --host 0.0.0.0, no key: mini_lb's exposure
    ({"host": "10.1.2.3"}, True), ({"host": "::"}, True), ({"host": "router.example"}, True),
    ({"admin_allow_cidrs": ("10.0.0.0/8",)}, True),  # narrower, but still no key
    ({"host": "127.0.0.1"}, False), ({"host": "::1"}, False), ({"host": "localhost"}, False),
    ({"api_key": "k"}, False), ({"admin_api_key": "k"}, False),
])
def test_the_warning_says_when_admin_routes_are_open_to_the_network(settings, warned):
    warnings = RouterConfig(**settings).warnings()
    assert bool(warnings) is warned
    if warned:
        assert OPEN in warnings[0] and "--admin-api-key" in warnings[0]
        assert ("10.0.0.0/8" in warnings[0]) == ("admin_allow_cidrs" in settings)


def test_loopback_hosts():
    assert [h for h in ("127.0.0.1", "127.9.9.9", "::1", "[::1]", "localhost", "0.0.0.0", "", "::", "10.0.0.1",
                        "example.org") if is_loopback(h)] == ["127.0.0.1", "127.9.9.9", "::1", "[::1]", "localhost"]


async def test_admin_health_shows_the_warning(sim_workers, make_router):
    p, d = await sim_workers(1, 1)
    exposed = await make_router([p], [d])
    body = await (await exposed.get("/admin/health")).json()
    assert len(body["warnings"]) == 1 and OPEN in body["warnings"][0] and "workers" in body
    keyed = await make_router([p], [d], admin_api_key="k")
    body = await (await keyed.get("/admin/health", headers={"Authorization": "Bearer k"})).json()
    assert body["warnings"] == []


async def _stderr_until(proc, wanted: str, timeout: float = 30.0) -> str:
    seen = ""
    deadline = time.monotonic() + timeout
    while wanted not in seen:
        line = await asyncio.wait_for(proc.stderr.readline(), max(deadline - time.monotonic(), 0.1))
        assert line, f"the router exited before logging {wanted!r}: {seen}"
        seen += line.decode()
    return seen


@pytest.mark.parametrize("host,warned", [("0.0.0.0", True), ("127.0.0.1", False)])
async def test_the_router_logs_the_warning_at_start_up(host, warned):
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "router", "--host", host, "--port", str(free_port()), "--disable-health-check",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PD_ROUTER_API_KEY": "", "PD_ROUTER_ADMIN_API_KEY": ""})
    try:
        logged = await _stderr_until(proc, "serving on")
    finally:
        proc.send_signal(signal.SIGTERM)
        await proc.wait()
    assert (OPEN in logged) is warned, logged


# ---- admin callers by source address -----------------------------------------------------------------------
@pytest.mark.parametrize("cidrs,allowed", [
    ((), True), (("127.0.0.0/8",), True), (("::1", "127.0.0.1"), True), (("10.0.0.0/8",), False),
])
async def test_admin_callers_by_source_address(sim_workers, make_router, cidrs, allowed):
    p, d = await sim_workers(1, 1)
    client = await make_router([p], [d], admin_allow_cidrs=cidrs)
    for method, path in (("GET", "/workers"), ("POST", "/flush_cache"), ("GET", "/admin/health")):
        resp = await client.request(method, path)
        if allowed:
            assert resp.status == 200, (path, await resp.text())
        else:
            error = (await resp.json())["error"]
            assert resp.status == 403 and error["type"] == "permission_error", error
            assert "127.0.0.1" in error["message"] and "--admin-allow-cidrs" in error["message"]
    # Public and generation routes are not admin routes: open as before.
    assert (await client.get("/health")).status == 200
    assert (await client.post("/generate", json={"text": "hi"})).status == 200


async def test_a_refused_address_is_refused_before_its_key_is_looked_at(sim_workers, make_router):
    p, d = await sim_workers(1, 1)
    client = await make_router([p], [d], admin_api_key="k", admin_allow_cidrs=("10.0.0.0/8",))
    assert (await client.get("/workers", headers={"Authorization": "Bearer k"})).status == 403
    assert (await client.get("/workers")).status == 403


def test_caller_allow_list():
    allowed = CallerAllowList.parse(["10.0.0.0/8", "192.168.1.7", "fd00::/8"])
    assert [a for a in ("10.2.3.4", "::ffff:10.2.3.4", "192.168.1.7", "192.168.1.8", "fd00::1", "::1", None, "")
            if allowed.allows(a)] == ["10.2.3.4", "::ffff:10.2.3.4", "192.168.1.7", "fd00::1"]
    assert CallerAllowList.parse([]).allows(None)
    assert RouterConfig(admin_allow_cidrs=("10.0.0.0/33", "example.org")).problems() == [
        "--admin-allow-cidrs: '10.0.0.0/33' is not a network (CIDR) or an address",
        "--admin-allow-cidrs: 'example.org' is not a network (CIDR) or an address"]


# ---- which workers may be registered -----------------------------------------------------------------------
async def fixed_resolver(table: dict[str, list[str]]):
    async def resolve(host: str, port: int) -> list[str]:
        if host not in table:
            raise OSError(f"[Errno -2] Name or service not known: {host}")
        return table[host]
    return resolve


@pytest.mark.parametrize("entries,host,refused", [
    (["10.0.0.0/8"], "10.1.1.1", None),
    (["10.0.0.0/8"], "192.168.0.1", "192.168.0.1 is in no network"),
    (["10.0.0.0/8"], "gpu-1.lab", None),  # resolves into the network
    (["10.0.0.0/8"], "mixed.lab", "resolves to 203.0.113.9"),  # every address must be in it
    (["10.0.0.0/8"], "nowhere.lab", "could not be resolved"),
    (["gpu-1.lab"], "GPU-1.lab", None), (["gpu-1.lab"], "gpu-2.lab", "no host or domain"),
    ([".lab"], "gpu-2.lab", None), (["*.lab"], "gpu-2.lab", None), ([".lab"], "lab.evil", "no host or domain"),
    ([".lab"], "10.1.1.1", "in no network"),
    (["::1"], "[::1]", None),
])
async def test_worker_allow_list(entries, host, refused):
    resolve = await fixed_resolver({"gpu-1.lab": ["10.0.0.5"], "gpu-2.lab": ["10.0.0.6"],
                                    "mixed.lab": ["10.0.0.7", "203.0.113.9"]})
    refusal = await WorkerAllowList.parse(entries).refusal(host, 8000, resolve)
    assert (refusal is None) == (refused is None), refusal
    if refused:
        assert refused in refusal


def test_worker_allow_problems():
    assert RouterConfig(worker_allow=("10.0.0.0/8", "gpu-1.lab", ".lab", "*.lab", "::1")).problems() == []
    assert RouterConfig(worker_allow=("bad host", "http://x:1")).problems() == [
        "--worker-allow: 'bad host' is neither a network (CIDR), an address, a host name nor a .domain",
        "--worker-allow: 'http://x:1' is neither a network (CIDR), an address, a host name nor a .domain"]


@pytest.mark.parametrize("allow,url_host,allowed", [
    ((), "127.0.0.1", True),
    (("127.0.0.0/8",), "127.0.0.1", True),
    (("10.0.0.0/8",), "127.0.0.1", False),
    (("localhost",), "localhost", True),
    (("127.0.0.0/8", "::1"), "localhost", True),  # a name resolved by the router's own resolver
    ((".example.org",), "localhost", False),
])
async def test_registering_a_worker_outside_the_allow_list_is_403(sim_workers, make_router, allow, url_host,
                                                                   allowed):
    p, d, extra = await sim_workers(1, 2)
    client = await make_router([p], [d], worker_allow=allow)
    url = extra.url.replace("127.0.0.1", url_host)
    calls = [("POST", "/workers", {"json": {"url": url, "worker_type": "decode"}}),
             ("POST", "/add_worker", {"params": {"url": url, "worker_type": "decode"}}),
             ("POST", "/register", {"json": {"mode": "decode", "registry_url": url}})]
    for method, path, kwargs in calls:
        resp = await client.request(method, path, **kwargs)
        if allowed:
            assert resp.status == 200, (path, await resp.text())
            assert client.registry.find(url) is not None
            assert (await client.delete(f"/workers/{client.registry.find(url).id}")).status == 200
        else:
            error = (await resp.json())["error"]
            assert resp.status == 403 and error["param"] == "url" and "--worker-allow" in error["message"], error
            assert client.registry.find(url) is None
    assert len(client.registry.workers()) == 2
