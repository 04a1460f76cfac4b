"""Workers announced in a real etcd: a key written under a lease is a worker routed; the lease revoked or
expired is the worker removed. The router is the in-process app in front of fake servers; the announcer is a
real process (`python -m router.cluster.announce`)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import orjson
import pytest

from router.cluster.discovery_watch import discovery_key, discovery_prefix, listing_of_key
from router.control.worker_sources import ListingError
from router.core.config import ConfigError, HealthConfig, RouterConfig, WorkerSourcesConfig
from router.core.keys import REGISTRY
from router.core.registry import Role
from router.server.app import create_app
from router.server.cli import config_from_args

from ..helpers import wait_for

CLUSTER = "test"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
async def router_on_etcd(aiohttp_client, etcd):
    async def build(**overrides):
        config = RouterConfig(
            worker_sources=WorkerSourcesConfig(etcd_endpoints=tuple(etcd.endpoints), etcd_cluster_name=CLUSTER),
            health=HealthConfig(interval_secs=0.2), **overrides).validated()
        client = await aiohttp_client(create_app(config), server_kwargs={"handler_cancellation": True})
        client.registry = client.app[REGISTRY]
        return client

    return build


async def announce(etcd_client, worker, role: str, *, ttl: int = 30, **fields) -> int:
    lease = await etcd_client.grant_lease(ttl)
    value = {"url": worker.url, "worker_type": role, **fields}
    await etcd_client.put(discovery_key(CLUSTER, worker.url), orjson.dumps(value), lease=lease)
    return lease


async def source_of(client) -> dict:
    resp = await client.get("/admin/discovery")
    assert resp.status == 200
    (source,) = (await resp.json())["sources"]
    return source


def routable_urls(client) -> set[str]:
    return {w.url for w in client.registry.workers() if w.routable}


async def generate(client) -> None:
    resp = await client.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}})
    assert resp.status == 200, await resp.text()


def test_the_key_layout():
    assert discovery_prefix("prod") == "/pd-router/prod/v1/discovery/"
    key = discovery_key("prod", "http://10.0.0.1:30000/")
    assert key == "/pd-router/prod/v1/discovery/http%3A%2F%2F10.0.0.1%3A30000"
    prefix = discovery_prefix("prod")
    assert listing_of_key(key, b'{"worker_type": "decode"}', prefix).url == "http://10.0.0.1:30000"
    with pytest.raises(ListingError, match="is not the key's"):
        listing_of_key(key, b'{"url": "http://10.0.0.2:30000"}', prefix)
    with pytest.raises(ListingError, match="not valid JSON"):
        listing_of_key(key, b"{", prefix)


async def test_keys_written_before_start_up_are_read_before_the_router_serves(sim_workers, etcd_client,
                                                                             router_on_etcd):
    p1, d1 = await sim_workers(prefill=1, decode=1)
    await announce(etcd_client, p1, "prefill", bootstrap_port=p1.bootstrap_port)
    await announce(etcd_client, d1, "decode")
    client = await router_on_etcd()
    assert routable_urls(client) == {p1.url, d1.url}
    assert client.registry.find(p1.url).source == f"etcd {discovery_prefix(CLUSTER)}"
    await generate(client)
    source = await source_of(client)
    assert source["kind"] == "etcd" and source["error"] is None and source["registered"] == 2


async def test_a_key_written_is_a_worker_routed_and_its_lease_revoked_is_the_worker_removed(
        sim_workers, etcd_client, router_on_etcd):
    p1, d1, d2 = await sim_workers(prefill=1, decode=2)
    await announce(etcd_client, p1, "prefill", bootstrap_port=p1.bootstrap_port)
    d1_lease = await announce(etcd_client, d1, "decode")
    client = await router_on_etcd()
    d2_lease = await announce(etcd_client, d2, "decode")
    await wait_for(lambda: routable_urls(client) == {p1.url, d1.url, d2.url}, message="d2 routed")
    await etcd_client.revoke_lease(d1_lease)
    await wait_for(lambda: client.registry.find(d1.url) is None, message="d1 removed")
    for _ in range(3):
        await generate(client)
    assert len(d2.bodies()) == 3 and len(d1.bodies()) == 0
    # a lease that expires (its holder died: nobody keeps it alive) takes its worker with it
    short = await announce(etcd_client, d1, "decode", ttl=2)
    await wait_for(lambda: d1.url in routable_urls(client), message="d1 back")
    await wait_for(lambda: client.registry.find(d1.url) is None, timeout=10, message="d1's lease expired")
    assert (await etcd_client.lease_info(short)).ttl == -1
    await etcd_client.revoke_lease(d2_lease)
    await wait_for(lambda: client.registry.find(d2.url) is None)
    assert routable_urls(client) == {p1.url}


async def test_a_bad_value_changes_nothing_and_is_shown(sim_workers, etcd_client, router_on_etcd):
    p1, d1 = await sim_workers(prefill=1, decode=1)
    await announce(etcd_client, p1, "prefill", bootstrap_port=p1.bootstrap_port)
    lease = await announce(etcd_client, d1, "decode")
    client = await router_on_etcd()
    worker = client.registry.find(d1.url)
    key = discovery_key(CLUSTER, d1.url)
    await etcd_client.put(key, b'{"worker_type": "regular"}', lease=lease)

    async def refused() -> bool:
        return key in (await source_of(client))["bad_keys"]

    await wait_for(refused, message="the bad value refused")
    assert "must be 'prefill' or 'decode'" in (await source_of(client))["bad_keys"][key]
    assert client.registry.find(d1.url) is worker and worker.routable
    await etcd_client.put(key, b'{"worker_type": "decode"}', lease=lease)
    await wait_for(lambda: refused_gone(client, key))
    assert client.registry.find(d1.url) is worker  # the same entry as before: nothing to re-register


async def refused_gone(client, key: str) -> bool:
    return key not in (await source_of(client))["bad_keys"]


async def test_workers_stay_while_etcd_is_down_and_the_watch_resumes(sim_workers, etcd, etcd_client, router_on_etcd):
    p1, d1, d2 = await sim_workers(prefill=1, decode=2)
    await announce(etcd_client, p1, "prefill", bootstrap_port=p1.bootstrap_port, ttl=60)
    await announce(etcd_client, d1, "decode", ttl=60)
    client = await router_on_etcd()
    await etcd.stop()

    async def not_watching() -> bool:
        return not (await source_of(client))["watching"]

    await wait_for(not_watching, timeout=10, message="the watch to see etcd gone")
    assert routable_urls(client) == {p1.url, d1.url}
    await generate(client)
    await etcd.restart()
    await announce(etcd_client, d2, "decode", ttl=60)
    await wait_for(lambda: d2.url in routable_urls(client), timeout=15, message="d2 seen after the restart")
    assert routable_urls(client) == {p1.url, d1.url, d2.url}


async def test_etcd_down_at_start_up_is_shown_and_read_when_it_answers(sim_workers, etcd, etcd_client,
                                                                      router_on_etcd):
    p1, d1 = await sim_workers(prefill=1, decode=1)
    await etcd.stop()
    client = await router_on_etcd(worker_startup_timeout_secs=1.0)
    assert "cannot read" in (await source_of(client))["error"]
    await etcd.restart()
    await announce(etcd_client, p1, "prefill", bootstrap_port=p1.bootstrap_port)
    await announce(etcd_client, d1, "decode")
    await wait_for(lambda: routable_urls(client) == {p1.url, d1.url}, timeout=15)
    assert (await source_of(client))["error"] is None


# ---- the announcer, a real process -------------------------------------------------------------------------
async def start_announcer(etcd, worker, *flags: str) -> asyncio.subprocess.Process:
    argv = [sys.executable, "-m", "router.cluster.announce", "--etcd-endpoints", *etcd.endpoints,
            "--cluster-name", CLUSTER, "--url", worker.url, "--ttl-secs", "2", "--check-interval-secs", "0.1",
            *flags]
    return await asyncio.create_subprocess_exec(*argv, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)


async def test_the_announcer_registers_its_worker_until_it_stops_or_dies(sim_workers, etcd, etcd_client,
                                                                       router_on_etcd):
    p1, d1, d2 = await sim_workers(prefill=1, decode=2)
    client = await router_on_etcd()
    announcers = [await start_announcer(etcd, p1, "--role", "prefill", "--bootstrap-port", str(p1.bootstrap_port)),
                  await start_announcer(etcd, d1, "--role", "decode"),
                  await start_announcer(etcd, d2)]  # no role: the router reads the server's
    try:
        # three interpreters start at once (each imports aiohttp and pydantic): on a loaded machine, seconds each
        await wait_for(lambda: routable_urls(client) == {p1.url, d1.url, d2.url}, timeout=45,
                       message="the announced workers routed")
        assert client.registry.find(d2.url).role is Role.DECODE
        assert client.registry.find(p1.url).bootstrap_port == p1.bootstrap_port
        await generate(client)
        # SIGTERM: the lease is revoked, the key goes at once, the worker is removed; exit 0
        announcers[1].send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(announcers[1].wait(), 10) == 0
        assert await etcd_client.get(discovery_key(CLUSTER, d1.url)) is None
        await wait_for(lambda: client.registry.find(d1.url) is None, message="d1 removed")
        # SIGKILL: nobody revokes; the lease expires within its TTL and the worker goes
        announcers[2].kill()
        await announcers[2].wait()
        await wait_for(lambda: client.registry.find(d2.url) is None, timeout=10, message="d2's lease expired")
        # the server stops answering: the announcer withdraws it after its failed checks
        await p1.stop()
        await wait_for(lambda: client.registry.find(p1.url) is None, timeout=10, message="p1 withdrawn")
        assert announcers[0].returncode is None
        output = (await announcers[1].stdout.read()).decode()
        assert "announced" in output and "withdrew" in output
    finally:
        for process in announcers:
            if process.returncode is None:
                process.kill()
                await process.wait()


async def test_the_announcer_refuses_a_bad_command_line(etcd):
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "router.cluster.announce", "--etcd-endpoints", *etcd.endpoints, "--url", "ftp://x:1",
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stderr=asyncio.subprocess.PIPE)
    _, err = await process.communicate()
    assert process.returncode == 2 and b"scheme must be http" in err


def test_the_discovery_flags_are_checked():
    config = config_from_args(["--discovery-etcd-endpoints", "http://e1:2379", "http://e2:2379",
                               "--discovery-cluster-name", "prod"], env={})
    assert config.worker_sources == WorkerSourcesConfig(etcd_endpoints=("http://e1:2379", "http://e2:2379"),
                                                        etcd_cluster_name="prod")
    with pytest.raises(ConfigError) as caught:
        config_from_args(["--discovery-etcd-endpoints", "ftp://e1", "--discovery-cluster-name", "a/b",
                          "--discovery-file-interval-secs", "0"], env={})
    assert len(caught.value.problems) == 3
