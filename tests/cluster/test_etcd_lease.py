"""Leases against a real etcd: expiry deletes their keys, the keeper keeps them, and says when it lost one."""

from __future__ import annotations

import asyncio
import time

import pytest

from router.cluster.etcd_types import EtcdLeaseNotFound

from ..helpers import wait_for
from .conftest import persist_writes


async def test_grant_info_revoke(etcd_client):
    lease = await etcd_client.grant_lease(30)
    await etcd_client.put("/l/a", b"1", lease=lease)
    await etcd_client.put("/l/b", b"2", lease=lease)
    info = await etcd_client.lease_info(lease, keys=True)
    assert info.granted_ttl == 30 and 28 <= info.ttl <= 30 and sorted(info.keys) == ["/l/a", "/l/b"]
    assert lease in await etcd_client.leases()
    assert (await etcd_client.get("/l/a")).lease == lease
    await etcd_client.revoke_lease(lease)
    assert (await etcd_client.get_prefix("/l/")).kvs == []
    assert (await etcd_client.lease_info(lease)).ttl == -1
    with pytest.raises(EtcdLeaseNotFound):
        await etcd_client.revoke_lease(lease)
    with pytest.raises(EtcdLeaseNotFound):
        await etcd_client.keep_alive_once(lease)


async def test_an_expired_lease_deletes_its_keys(etcd_client):
    lease = await etcd_client.grant_lease(2)
    await etcd_client.put("/member/r1", b"up", lease=lease)
    began = time.monotonic()
    await wait_for(lambda: _absent(etcd_client, "/member/r1"), timeout=6.0, interval=0.05)
    assert time.monotonic() - began > 1.0  # it lived about its TTL, not less
    with pytest.raises(EtcdLeaseNotFound):
        await etcd_client.keep_alive_once(lease)


async def _absent(client, key):
    return await client.get(key) is None


async def test_the_keeper_keeps_keys_past_their_ttl_and_close_lets_them_expire(etcd_client):
    keeper = await etcd_client.lease(ttl=2)
    await etcd_client.put("/member/r1", b"up", lease=keeper.id)
    await wait_for(lambda: keeper.renewals >= 5, timeout=10.0, message="five renewals (about 3 s, past the TTL)")
    assert await etcd_client.get("/member/r1") is not None and keeper.alive
    await keeper.close()
    assert keeper.lost_reason == "closed"
    await wait_for(lambda: _absent(etcd_client, "/member/r1"), timeout=6.0, interval=0.05)


async def test_revoking_through_the_keeper_deletes_its_keys_at_once(etcd_client):
    async with await etcd_client.lease(ttl=30) as keeper:
        await etcd_client.put("/member/r1", b"up", lease=keeper.id)
    assert keeper.lost_reason == "revoked" and not keeper.alive
    assert await etcd_client.get("/member/r1") is None


async def test_the_keeper_reports_a_lease_that_etcd_ended(etcd_client):
    keeper = await etcd_client.lease(ttl=30, interval=0.1)
    await etcd_client.revoke_lease(keeper.id)  # as another replica taking over would after an expiry
    assert await asyncio.wait_for(keeper.wait_lost(), 5.0) == "expired"


async def test_the_keeper_survives_an_etcd_restart_shorter_than_its_ttl(etcd, etcd_client):
    keeper = await etcd_client.lease(ttl=5, interval=0.3)
    await etcd_client.put("/member/r1", b"up", lease=keeper.id)
    await persist_writes(etcd_client)
    await etcd.kill()
    await etcd.start()
    renewals = keeper.renewals
    await wait_for(lambda: keeper.renewals > renewals + 1, timeout=5.0, message="renewals after the restart")
    assert keeper.alive and (await etcd_client.get("/member/r1")).lease == keeper.id


async def test_the_keeper_gives_the_lease_up_when_etcd_is_away_past_its_ttl(etcd, etcd_client):
    keeper = await etcd_client.lease(ttl=2, interval=0.3)
    await etcd.kill()
    began = time.monotonic()
    reason = await asyncio.wait_for(keeper.wait_lost(), 6.0)
    assert "deadline" in reason and time.monotonic() - began < 2.5
