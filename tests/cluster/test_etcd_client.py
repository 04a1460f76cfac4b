"""The etcd gateway client against a real etcd: keys, ranges, transactions, fail-over and its errors."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from router.cluster.etcd import EtcdClient
from router.cluster.etcd_types import (
    Compare,
    DeleteResult,
    EtcdCompacted,
    EtcdLeaseNotFound,
    EtcdOutcomeUnknown,
    EtcdRequestError,
    EtcdTxnFailed,
    EtcdUnavailable,
    Op,
    PutResult,
    RangeResult,
    prefix_end,
)

from ..helpers import free_port
from .conftest import persist_writes


async def test_put_get_and_missing_key(etcd_client):
    put = await etcd_client.put("/k", "v1")
    got = await etcd_client.get("/k")
    assert (got.key, got.value, got.create_revision, got.mod_revision, got.version) == ("/k", b"v1", put.revision,
                                                                                          put.revision, 1)
    second = await etcd_client.put("/k", b"v2", prev_kv=True)
    assert second.revision == put.revision + 1 and second.prev.value == b"v1"
    assert (await etcd_client.get("/k")).version == 2
    assert await etcd_client.get("/absent") is None
    assert (await etcd_client.get("/k", revision=put.revision)).value == b"v1"


async def test_binary_values_and_unicode_keys_round_trip(etcd_client):
    value = bytes(range(256))
    await etcd_client.put("/ключ/✓", value)
    assert (await etcd_client.get("/ключ/✓")).value == value


async def test_get_prefix_is_bounded_ordered_and_dated(etcd_client):
    for key in ["/a/2", "/a/1", "/a0", "/a", "/b/1", "/a/sub/3"]:
        await etcd_client.put(key, key)
    result = await etcd_client.get_prefix("/a/")
    assert [kv.key for kv in result.kvs] == ["/a/1", "/a/2", "/a/sub/3"]
    assert result.count == 3 and not result.more
    assert result.revision == (await etcd_client.status())["revision"]
    limited = await etcd_client.get_prefix("/a/", limit=2, keys_only=True)
    assert [kv.key for kv in limited.kvs] == ["/a/1", "/a/2"] and limited.more and limited.kvs[0].value == b""
    assert prefix_end(b"a\xff\xff") == b"b" and prefix_end(b"") == b"\0"


async def test_delete_and_delete_prefix(etcd_client):
    for key in ["/d/1", "/d/2", "/d/3", "/e/1"]:
        await etcd_client.put(key, b"x")
    one = await etcd_client.delete("/d/1", prev_kv=True)
    assert isinstance(one, DeleteResult) and one.deleted == 1 and one.prev[0].key == "/d/1"
    assert (await etcd_client.delete("/d/1")).deleted == 0
    assert (await etcd_client.delete_prefix("/d/")).deleted == 2
    assert [kv.key for kv in (await etcd_client.get_prefix("/")).kvs] == ["/e/1"]


async def test_txn_runs_success_or_failure_branch(etcd_client):
    first = await etcd_client.put("/t", b"a")
    ok = await etcd_client.txn([Compare.mod_revision("/t", "==", first.revision), Compare.value("/t", "==", "a")],
                               success=[Op.put("/t", b"b"), Op.put("/t2", b"c"), Op.get_prefix("/t")],
                               failure=[Op.get("/t")])
    assert ok.succeeded
    put, _, read = ok.responses
    assert isinstance(put, PutResult) and put.revision == ok.revision
    assert isinstance(read, RangeResult) and [(kv.key, kv.value) for kv in read.kvs] == [("/t", b"b"), ("/t2", b"c")]
    # both puts landed in one revision
    assert {kv.mod_revision for kv in read.kvs} == {ok.revision}
    stale = await etcd_client.txn([Compare.mod_revision("/t", "==", first.revision)],
                                  success=[Op.delete("/t")], failure=[Op.get("/t"), Op.delete_prefix("/t2")])
    assert not stale.succeeded and stale.responses[0].kvs[0].value == b"b" and stale.responses[1].deleted == 1
    assert (await etcd_client.get("/t")).value == b"b" and await etcd_client.get("/t2") is None
    versions = await etcd_client.txn([Compare.version("/t", ">", 1), Compare.create_revision("/t", "<", ok.revision),
                                      Compare.value("/t", "!=", "a"), Compare.exists("/t")])
    assert versions.succeeded and versions.responses == []


async def test_create_and_compare_and_swap(etcd_client):
    revision = await etcd_client.create("/owner", b"r1")
    with pytest.raises(EtcdTxnFailed) as lost:
        await etcd_client.create("/owner", b"r2")
    assert lost.value.current.value == b"r1" and lost.value.current.mod_revision == revision
    swapped = await etcd_client.replace("/owner", b"r3", mod_revision=revision)
    with pytest.raises(EtcdTxnFailed) as stale:
        await etcd_client.replace("/owner", b"r4", mod_revision=revision)
    assert stale.value.current.value == b"r3"
    with pytest.raises(EtcdTxnFailed):
        await etcd_client.delete_if("/owner", mod_revision=revision)
    await etcd_client.delete_if("/owner", mod_revision=swapped)
    with pytest.raises(EtcdTxnFailed) as gone:
        await etcd_client.replace("/owner", b"r5", mod_revision=swapped)
    assert gone.value.current is None


async def test_exactly_one_of_many_contenders_creates_a_leased_key(etcd):
    contenders = 8
    clients = [EtcdClient(etcd.endpoints) for _ in range(contenders)]
    try:
        leases = [await client.grant_lease(30) for client in clients]
        start = asyncio.Event()

        async def contend(index: int):
            await start.wait()
            try:
                return await clients[index].create("/op/convert/w1", f"replica-{index}", lease=leases[index])
            except EtcdTxnFailed as exc:
                return exc

        tasks = [asyncio.create_task(contend(index)) for index in range(contenders)]
        start.set()
        outcomes = await asyncio.gather(*tasks)
        winners = [index for index, outcome in enumerate(outcomes) if isinstance(outcome, int)]
        assert len(winners) == 1
        winner = winners[0]
        held = await clients[0].get("/op/convert/w1")
        assert held.value == f"replica-{winner}".encode() and held.lease == leases[winner]
        for index, outcome in enumerate(outcomes):
            if index != winner:
                assert outcome.current == held  # each loser learns the holder in the same round trip
    finally:
        for client in clients:
            await client.close()


async def test_compacted_revision_read_raises_compacted(etcd_client):
    old = await etcd_client.put("/c", b"1")
    now = await etcd_client.put("/c", b"2")
    await etcd_client.compact(now.revision)
    with pytest.raises(EtcdCompacted):
        await etcd_client.get("/c", revision=old.revision)


async def test_refused_requests_raise_request_errors(etcd_client):
    with pytest.raises(EtcdRequestError) as empty_key:
        await etcd_client.put("", b"x")
    assert empty_key.value.status == 400 and "key is not provided" in str(empty_key.value)
    with pytest.raises(EtcdLeaseNotFound):
        await etcd_client.put("/k", b"x", lease=12345)


async def test_a_down_etcd_fails_calls_at_once(etcd, etcd_client):
    await etcd_client.put("/k", b"x")
    await persist_writes(etcd_client)
    await etcd.kill()
    for call in (etcd_client.get("/k"), etcd_client.put("/k", b"y"), etcd_client.txn([Compare.absent("/k")]),
                 etcd_client.grant_lease(5), etcd_client.get_prefix("/")):
        began = time.monotonic()
        with pytest.raises(EtcdUnavailable) as down:
            await call
        assert time.monotonic() - began < 1.0
        assert not isinstance(down.value, EtcdOutcomeUnknown)  # refused: surely not applied
    await etcd.start()
    assert (await etcd_client.get("/k")).value == b"x"


async def test_fail_over_to_the_next_endpoint_and_stick_to_it(etcd):
    dead = f"http://127.0.0.1:{free_port()}"
    async with EtcdClient([dead, etcd.client_url]) as client:
        await client.put("/k", b"x")
        assert client.endpoint_order()[0] == etcd.client_url
        assert (await client.get("/k")).value == b"x"


@pytest.fixture
def silent_endpoint():
    """A port that accepts connections (the kernel's backlog) and never answers: a hung or cut-off member."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"


async def test_a_silent_endpoint_costs_a_read_its_share_of_the_deadline(etcd, etcd_client, silent_endpoint):
    await etcd_client.put("/k", b"x")
    async with EtcdClient([silent_endpoint, etcd.client_url], timeout=2.0) as client:
        began = time.monotonic()
        assert (await client.get("/k")).value == b"x"
        assert 0.9 < time.monotonic() - began < 2.0  # half the deadline on the silent one, then the next
        assert client.endpoint_order()[0] == etcd.client_url


async def test_a_write_whose_answer_never_comes_is_outcome_unknown_within_its_deadline(silent_endpoint):
    async with EtcdClient([silent_endpoint], timeout=0.5) as client:
        began = time.monotonic()
        with pytest.raises(EtcdOutcomeUnknown):
            await client.put("/k", b"x")
        with pytest.raises(EtcdUnavailable) as read:
            await client.get("/k")
        assert not isinstance(read.value, EtcdOutcomeUnknown)
        assert time.monotonic() - began < 1.5
