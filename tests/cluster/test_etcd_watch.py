"""Watches against a real etcd: events in order, from a revision, across a SIGKILL of etcd, and compaction."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from router.cluster.etcd import EtcdClient
from router.cluster.etcd_types import EtcdCompacted, EtcdOutcomeUnknown, EtcdUnavailable, Op

from ..helpers import free_port, wait_for


class Collector:
    """Iterates a watch in a task, keeping every event it delivers."""

    def __init__(self, watch):
        self.watch = watch
        self.events = []
        self.task = asyncio.create_task(self._run())

    async def _run(self):
        async for event in self.watch:
            self.events.append(event)

    async def wait_count(self, count: int, timeout: float = 10.0):
        await wait_for(lambda: len(self.events) >= count or self.task.done(), timeout=timeout,
                       message=f"{count} events (have {len(self.events)})")
        if self.task.done():
            self.task.result()  # an error in the watch fails the test here
        return self.events

    async def stop(self):
        await self.watch.close()
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


async def test_events_arrive_in_order_with_their_kind_and_revision(etcd_client):
    start = (await etcd_client.status())["revision"] + 1
    watch = Collector(etcd_client.watch_prefix("/w/", start_revision=start))
    try:
        a = await etcd_client.put("/w/a", b"1")
        await etcd_client.put("/outside", b"x")
        b = await etcd_client.put("/w/b", b"2")
        gone = await etcd_client.delete("/w/a")
        both = await etcd_client.txn([], [Op.put("/w/c", b"3"), Op.put("/w/a", b"4")])
        events = await watch.wait_count(5)
    finally:
        await watch.stop()
    assert [(e.type, e.key, e.value, e.mod_revision) for e in events] == [
        ("put", "/w/a", b"1", a.revision), ("put", "/w/b", b"2", b.revision), ("delete", "/w/a", b"", gone.revision),
        ("put", "/w/c", b"3", both.revision), ("put", "/w/a", b"4", both.revision)]
    assert events[4].version == 1 and events[4].create_revision == both.revision


async def test_a_watch_from_a_past_revision_replays_history_and_one_from_now_does_not(etcd_client):
    first = await etcd_client.put("/h/x", b"1")
    await etcd_client.put("/h/x", b"2")
    replay = Collector(etcd_client.watch("/h/x", start_revision=first.revision))
    from_now = Collector(etcd_client.watch("/h/x"))
    try:
        await wait_for(lambda: from_now.watch.connected, timeout=5.0)
        await etcd_client.put("/h/x", b"3")
        assert [e.value for e in await replay.wait_count(3)] == [b"1", b"2", b"3"]
        assert [e.value for e in await from_now.wait_count(1)] == [b"3"]
    finally:
        await replay.stop()
        await from_now.stop()


async def test_a_watch_resumes_across_an_etcd_sigkill_without_losing_or_repeating_events(etcd, etcd_client):
    """A writer keeps writing through the outage; every write etcd acknowledged reaches the watch once."""
    watch = Collector(etcd_client.watch_prefix("/load/", start_revision=1))
    acknowledged: dict[int, str] = {}  # revision -> key
    attempted: set[str] = set()
    writing = True

    async def writer():
        index = 0
        while writing:
            key = f"/load/{index:05d}"
            attempted.add(key)
            try:
                acknowledged[(await etcd_client.put(key, key, timeout=1.0)).revision] = key
            except EtcdOutcomeUnknown:
                pass  # may or may not have landed: the watch is the judge
            except EtcdUnavailable:
                await asyncio.sleep(0.02)  # etcd is down: the writer's retry cadence
                continue
            index += 1

    task = asyncio.create_task(writer())
    try:
        await wait_for(lambda: len(acknowledged) >= 50, timeout=10.0)
        await etcd.kill()
        await etcd.start()
        await wait_for(lambda: watch.watch.reconnects >= 1, timeout=10.0)
        after = len(acknowledged)
        await wait_for(lambda: len(acknowledged) >= after + 50, timeout=10.0)
        writing = False
        await task
        last = max(acknowledged)
        await wait_for(lambda: watch.events and watch.events[-1].mod_revision >= last, timeout=10.0)
    finally:
        writing = False
        await asyncio.gather(task, return_exceptions=True)
        await watch.stop()
    revisions = [event.mod_revision for event in watch.events]
    assert revisions == sorted(set(revisions))  # in order, none twice
    seen = {event.mod_revision: event.key for event in watch.events}
    assert all(seen.get(revision) == key for revision, key in acknowledged.items())  # none lost
    assert set(seen.values()) <= attempted


async def test_a_compacted_resume_point_raises_compacted_and_ends_the_watch(etcd_client):
    await etcd_client.put("/c/x", b"1")
    latest = await etcd_client.put("/c/x", b"2")
    await etcd_client.compact(latest.revision)
    watch = etcd_client.watch_prefix("/c/", start_revision=1)
    with pytest.raises(EtcdCompacted) as compacted:
        await asyncio.wait_for(anext(watch), 5.0)
    assert compacted.value.compact_revision == latest.revision
    with pytest.raises(StopAsyncIteration):
        await anext(watch)


async def test_a_watch_moves_past_a_dead_endpoint(etcd):
    async with EtcdClient([f"http://127.0.0.1:{free_port()}", etcd.client_url]) as client:
        watch = Collector(client.watch("/k"))
        try:
            await wait_for(lambda: watch.watch.connected, timeout=5.0)
            assert watch.watch.endpoint == etcd.client_url
            await client.put("/k", b"x")
            assert [e.value for e in await watch.wait_count(1)] == [b"x"]
        finally:
            await watch.stop()


async def test_a_silent_member_is_left_after_a_health_probe(etcd, etcd_client):
    """SIGSTOP: the connection stays open but nothing answers, as with a partition; the watch must notice."""
    watch = Collector(etcd_client.watch("/k", probe_interval=0.3))
    try:
        await wait_for(lambda: watch.watch.connected, timeout=5.0)
        os.kill(etcd.pid, signal.SIGSTOP)
        try:
            await wait_for(lambda: not watch.watch.connected, timeout=5.0, message="the probe left the stream")
        finally:
            os.kill(etcd.pid, signal.SIGCONT)
        await etcd_client.put("/k", b"after")
        assert [e.value for e in await watch.wait_count(1)] == [b"after"]
        assert watch.watch.reconnects >= 1
    finally:
        await watch.stop()


async def test_closing_the_client_ends_its_watches(etcd):
    client = EtcdClient(etcd.endpoints)
    watch = Collector(client.watch_prefix("/"))
    await wait_for(lambda: watch.watch.connected, timeout=5.0)
    await client.close()
    await asyncio.wait_for(watch.task, 5.0)  # the iteration stopped
    assert watch.events == [] and not watch.watch.connected


async def test_a_watch_cancelled_as_an_event_arrives_still_ends(etcd_client):
    """Cancelling the task that iterates a watch ends it even when the cancellation comes with an event's bytes
    (the replicas of one host stop at once, each seeing the others leave): a swallowed cancellation left a
    replica's shutdown waiting for ever. The cancellation is sent 0-11 loop turns after a put, three times each."""
    swallowed = []
    for turns in range(12):
        for _ in range(3):
            watch = etcd_client.watch("/race")

            async def iterate(watch=watch):
                async for _ in watch:
                    pass

            task = asyncio.create_task(iterate())
            await wait_for(lambda: watch.connected, timeout=10)
            await etcd_client.put("/race", b"x")
            for _ in range(turns):
                await asyncio.sleep(0)  # one loop turn each: where the event's bytes are, not a wait
            task.cancel()
            done, _ = await asyncio.wait({task}, timeout=1.0)
            if not done:
                swallowed.append(turns)
                await watch.close()
                task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await watch.close()
    assert not swallowed, f"cancellations swallowed after {swallowed} loop turns"
