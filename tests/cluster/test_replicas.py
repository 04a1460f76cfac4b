"""Router replicas sharing one simulated fleet through a real etcd (in this process: one app per replica).

What one replica changes, every replica applies from its watch: workers added and removed, a conversion's
states and the new role and bootstrap port, the fleet's holds; an operation runs once across them, and waits
for every replica's requests on its servers; while etcd is down they route on, and control calls answer 503.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from router.cluster.etcd_keys import decode
from router.core.keys import COORDINATOR
from router.flows.rebalancer import REBALANCER
from router.flows.fleet_control import FLEET_CONTROL
from router.core.registry import Role, WorkerState
from router.dataplane.proxy import PROXY
from simulator.fleet import Fleet

from ..helpers import wait_for
from .replicas import BODY, SIM, Load, cluster_config, start_replica

LONG = {**BODY, "sampling_params": {"max_new_tokens": 300, "temperature": 0}}  # ~1 s of decoding


@pytest.fixture
async def fleet():
    """2 prefill and 3 decode servers: the replicas' command lines name the first 2 of each."""
    fleet = await Fleet(2, 3, **SIM).start()
    yield fleet
    await fleet.stop()


@pytest.fixture
async def replicas(etcd, fleet):
    """`a, b = await replicas(2)`: replicas started one after the other, closed at the end."""
    started = []

    async def start(count: int = 2, **overrides):
        new = []
        for _ in range(count):
            new.append(await start_replica(cluster_config(fleet, etcd.endpoints, workers=2, **overrides)))
        started.extend(new)
        return new

    yield start
    for replica in reversed(started):
        await replica.close()


async def requests_on(replica, handle, body=LONG, timeout: float = 10.0) -> list[asyncio.Task]:
    """Requests sent through `replica` until one is on the server `handle`; their tasks (left running)."""
    worker = replica.worker(handle)
    tasks: list[asyncio.Task] = []
    deadline = time.monotonic() + timeout
    while worker.inflight == 0:
        assert time.monotonic() < deadline, f"no request reached {handle.url}"
        routed = worker.requests_total
        tasks.append(asyncio.ensure_future(replica.generate(body)))
        await wait_for(lambda: worker.requests_total > routed or all(t.done() for t in tasks), timeout=5)
    return tasks


# ---- joining -----------------------------------------------------------------------------------------------
async def test_replicas_join_one_fleet_and_show_it(replicas, fleet):
    a, = await replicas(1)
    await a.cluster.publisher.flush(10)  # its command line's workers in etcd (written in the background)
    b, = await replicas(1)
    assert a.view() == b.view() and len(a.view()) == 4
    assert all(routable for *_, routable in b.view())
    # the second replica took the workers from etcd, ids included, not from its command line
    assert {w.source.split(" ")[0] for w in b.registry.workers()} == {"cluster"}
    assert sorted((w.url, w.id) for w in a.registry.workers()) == sorted((w.url, w.id) for w in b.registry.workers())
    # each replica's watch brings the other's key, its lease and the leader asynchronously (a loaded machine
    # delays them): wait until both views agree, then look at them
    views: list[dict] = []

    async def both_shown() -> bool:
        views[:] = [(await r.call("GET", "/admin/cluster"))[1] for r in (a, b)]
        return all(sorted(r["id"] for r in view["replicas"]) == ids and view["watch"]["connected"]
                   and all("lease_ttl_s" in r for r in view["replicas"]) and view["leader"] in ids
                   and [e["healthy"] for e in view["etcd"]["endpoints"]] == [True] for view in views) \
            and views[0]["leader"] == views[1]["leader"]

    ids = sorted(r.cluster.identity.id for r in (a, b))
    await wait_for(both_shown, timeout=15, interval=0.05, message="both replicas shown alike by each")
    for view, replica in zip(views, (a, b)):
        assert view["replica"] == replica.cluster.identity.id
        assert view["etcd"]["reachable"] and view["applied_revision"] > 0
        assert all(r["lease_ttl_s"] == 2 for r in view["replicas"])
        assert [r["id"] for r in view["replicas"] if r["leader"]] == [view["leader"]]
    text = await (await a.client.get("/metrics")).text()
    assert "pd_router_cluster_replicas 2.0" in text and "pd_router_cluster_etcd_reachable 1.0" in text
    # one that leaves revokes its lease: the other sees it gone at once, and leads
    await a.close()
    await wait_for(lambda: len(b.cluster.mirror.under(b.cluster.keys.replicas)) == 1, timeout=10,
                   message="the replica that left is gone")
    await wait_for(lambda: b.cluster.leadership.leading, timeout=10, message="the remaining replica leads")


async def test_a_starting_replica_takes_the_fleet_from_etcd_not_its_command_line(replicas, fleet):
    a, = await replicas(1)
    status, record = await a.call("POST", f"/admin/workers/{fleet.decode[0].url}/convert", {})
    assert status == 200 and record["outcome"] == "converted", record
    c, = await replicas(1)  # its command line still says decode
    assert c.worker(fleet.decode[0]).role is Role.PREFILL
    assert c.view() == a.view()


# ---- workers -----------------------------------------------------------------------------------------------
async def test_a_worker_added_at_one_replica_is_routed_by_the_other_and_removed_from_both(replicas, fleet):
    a, b = await replicas(2)
    extra = fleet.decode[2]
    status, answer = await b.call("POST", "/workers", {"url": extra.url, "worker_type": "decode"})
    assert status == 200, answer
    await wait_for(lambda: a.worker(extra) is not None and a.worker(extra).routable, timeout=2,
                   message="the other replica routes the new worker")
    assert a.worker(extra).id == b.worker(extra).id
    while a.worker(extra).requests_total == 0:  # a routes to it
        assert (await a.generate())[0] == 200
    status, answer = await a.call("DELETE", f"/workers/{extra.url}")
    assert status == 200, answer
    await wait_for(lambda: b.worker(extra) is None, timeout=2, message="removed everywhere")
    # added again where it was first added: that replica's own old write of the record is no longer what
    # etcd holds (the other deleted it since), and the new record is created, not refused as a lost race
    status, answer = await b.call("POST", "/workers", {"url": extra.url, "worker_type": "decode"})
    assert status == 200, answer
    await wait_for(lambda: a.worker(extra) is not None and a.worker(extra).routable, timeout=2,
                   message="the other replica routes the worker added again")
    assert b.worker(extra) is not None and b.worker(extra).routable
    # removed and added again at one replica, with no pause between for its watch to bring the deletion back
    for _ in range(3):
        status, answer = await b.call("DELETE", f"/workers/{extra.url}")
        assert status == 200, answer
        status, answer = await b.call("POST", "/workers", {"url": extra.url, "worker_type": "decode"})
        assert status == 200, answer
        await wait_for(lambda: a.worker(extra) is not None and a.worker(extra).routable, timeout=2,
                       message="the other replica routes the worker removed and added again")
        assert b.worker(extra) is not None and b.worker(extra).routable
    assert b.cluster.publisher.refused == 0


async def test_a_replicas_own_earlier_write_arriving_late_from_the_watch_does_not_take_it_back(replicas, fleet):
    """A conversion writes each of its states; a watch that lags may bring one back after the next was written:
    the replica that wrote both keeps the newer (it once went back to `verifying` as decode and stayed so)."""
    a, = await replicas(1)
    handle = fleet.decode[1]
    key = a.cluster.keys.worker(handle.url)
    delivered = []
    a.cluster.mirror.listeners.append(lambda changes: delivered.extend(c for c in changes if c.key == key))
    status, record = await a.call("POST", f"/admin/workers/{handle.url}/convert", {})
    assert status == 200 and record["outcome"] == "converted", record
    await wait_for(lambda: a.cluster.publisher.pending_count == 0 and len(delivered) >= 2, timeout=2,
                   message="the conversion's writes came back")
    earlier = [c for c in delivered if c.new is not None and decode(c.new.value)["role"] == "decode"]
    assert earlier, [decode(c.new.value) for c in delivered if c.new is not None]
    a.cluster.applier.on_changes([earlier[0]])  # as a lagging watch would deliver it now
    worker = a.worker(handle)
    assert (worker.role, worker.state, worker.routable) == (Role.PREFILL, WorkerState.ACTIVE, True)


# ---- one operation, every replica's requests -----------------------------------------------------------------
async def test_a_drain_waits_for_the_other_replicas_requests_and_the_new_role_reaches_them(replicas, fleet):
    a, b = await replicas(2)
    handle = fleet.decode[1]
    running = await requests_on(b, handle)
    status, record = await a.call("POST", f"/admin/workers/{handle.url}/convert", {"wait": False})
    assert status == 202, record
    await wait_for(lambda: b.worker(handle).state is WorkerState.DRAINING, timeout=1,
                   message="the other replica stopped routing to it")
    assert not b.worker(handle).routable

    async def drain_message() -> str:
        _, conversion = await a.call("GET", f"/admin/conversions/{record['id']}")
        return conversion["steps"][0]["message"] if conversion["steps"] else ""

    await wait_for(lambda: drain_message(), timeout=5)
    assert "other router replicas" in await drain_message()
    answers = await asyncio.gather(*running)
    ended = time.monotonic()
    assert [status for status, _ in answers] == [200] * len(answers)
    assert all(answer["meta_info"]["finish_reason"]["type"] == "length" for _, answer in answers)
    await wait_for(lambda: a.worker(handle).role is Role.PREFILL, timeout=10, message="converted")
    assert time.monotonic() >= ended
    await wait_for(lambda: b.worker(handle).role is Role.PREFILL and b.worker(handle).routable, timeout=2,
                   message="the new role reaches the other replica")
    assert b.worker(handle).bootstrap_port == a.worker(handle).bootstrap_port is not None
    assert (await fleet.state(handle))["counters"]["role_switches"] == 1


async def test_one_conversion_of_a_worker_across_replicas(replicas, fleet):
    a, b = await replicas(2)
    handle = fleet.decode[1]
    answers = await asyncio.gather(a.call("POST", f"/admin/workers/{handle.url}/convert", {}),
                                   b.call("POST", f"/admin/workers/{handle.url}/convert", {}))
    assert sorted(status for status, _ in answers) == [200, 409], answers
    assert (await fleet.state(handle))["counters"]["role_switches"] == 1
    await wait_for(lambda: a.view() == b.view(), timeout=2)


async def test_a_fleet_operation_waits_for_a_conversion_running_on_another_replica(replicas, fleet):
    a, b = await replicas(2)
    handle = fleet.decode[1]
    running = await requests_on(a, handle)
    status, record = await a.call("POST", f"/admin/workers/{handle.url}/convert", {"wait": False})
    assert status == 202
    status, answer = await b.call("POST", "/update_weight_version", {"new_version": "v2"})
    assert status == 200, answer
    await asyncio.gather(*running)
    assert a.worker(handle).role is Role.PREFILL  # the update came after the conversion
    _, op = await b.call("GET", f"/weight_updates/{answer['update_id']}")
    assert "conversions elsewhere" in [s["name"] for s in op["steps"]]
    await wait_for(lambda: a.registry.fleet_version == "v2", timeout=2)


async def test_a_pause_holds_every_replica_until_continue_at_any(replicas, fleet):
    a, b = await replicas(2)
    status, answer = await a.call("POST", "/pause_generation", {"mode": "in_place"})
    assert status == 200, answer
    await wait_for(lambda: not b.admission.is_open, timeout=1, message="the other replica holds too")
    assert b.app[FLEET_CONTROL].paused == "in_place"
    held = asyncio.ensure_future(b.generate())
    await wait_for(lambda: b.admission.waiting == 1, timeout=2)
    status, answer = await b.call("POST", "/continue_generation", {})
    assert status == 200, answer
    assert (await held)[0] == 200
    await wait_for(lambda: a.admission.is_open and a.app[FLEET_CONTROL].paused is None, timeout=1)


async def test_abort_all_at_one_replica_ends_every_replicas_requests(replicas, fleet):
    a, b = await replicas(2)
    for handle in fleet.decode[:2]:
        await fleet.set_faults(handle, hang_after_tokens=3)  # every request stays until aborted
    tasks = [asyncio.ensure_future(r.generate()) for r in (a, b, a, b)]
    await wait_for(lambda: sum(w.inflight for r in (a, b) for w in r.registry.workers(Role.DECODE)) == 4,
                   timeout=5, message="two requests on each replica")
    status, answer = await a.call("POST", "/abort_request", {"abort_all": True})
    assert (status, answer) == (200, None)
    # the answer came once every replica's requests had ended there (their answers, SGLang's abort answer, are
    # the router's to write; each client reads its own after)
    assert [len(r.app[PROXY].live) for r in (a, b)] == [0, 0]
    done, pending = await asyncio.wait(tasks, timeout=10)
    assert not pending, "an aborted request's client got no answer"
    answers = [task.result() for task in tasks]
    assert [(status, body["meta_info"]["finish_reason"]["type"]) for status, body in answers] == [(200, "abort")] * 4
    assert sum(w.inflight for r in (a, b) for w in r.registry.workers()) == 0


async def test_the_singleton_loops_run_on_the_leader_only(replicas):
    a, b = await replicas(2)
    await wait_for(lambda: a.cluster.leadership.leading or b.cluster.leadership.leading, timeout=3)
    leader, follower = (a, b) if a.cluster.leadership.leading else (b, a)
    assert leader.app[REBALANCER].tick() is not None  # advisory: it observes and decides
    not_leading = follower.app[REBALANCER].counters["ticks_not_leading"]  # its loop's look as it started, too
    assert follower.app[REBALANCER].tick() is None
    assert follower.app[REBALANCER].counters["ticks_not_leading"] == not_leading + 1
    assert follower.app[COORDINATOR].leading is False and leader.app[COORDINATOR].leading is True


# ---- etcd down -------------------------------------------------------------------------------------------------
async def test_while_etcd_is_down_replicas_route_and_control_calls_answer_503(replicas, fleet, etcd):
    a, b = await replicas(2)
    load = Load([a, b], concurrency=2).start()
    await wait_for(lambda: len(load.answers) >= 6, timeout=10)
    await etcd.stop()
    status, answer = await a.call("POST", f"/admin/workers/{fleet.decode[0].url}/convert", {})
    assert status == 503 and answer["error"]["type"] == "unavailable", answer
    assert "etcd" in answer["error"]["message"]
    status, answer = await b.call("POST", "/workers", {"url": fleet.decode[2].url, "worker_type": "decode"})
    assert status == 503, answer
    served = len(load.answers)
    await wait_for(lambda: len(load.answers) >= served + 6, timeout=10, message="routing goes on without etcd")
    await etcd.start()
    await wait_for(lambda: a.cluster.membership.alive and a.cluster.mirror.watching, timeout=10)
    assert b.worker(fleet.decode[2]) is None and a.worker(fleet.decode[2]) is None  # refused: not added
    assert load.failed() == []
    await load.finish()
    assert load.failed() == []
    status, record = await a.call("POST", f"/admin/workers/{fleet.decode[0].url}/convert", {})
    assert status == 200, record
    await wait_for(lambda: b.worker(fleet.decode[0]).role is Role.PREFILL, timeout=2)



async def test_shed_mode_re_sends_the_other_replicas_requests_that_wait_on_their_prefill(etcd):
    """A decode converted in shed mode through one replica: the requests another replica has on it that still
    wait on their prefill (one prefill, a quarter of a second a prompt) are aborted on both their servers and
    re-sent by that replica; the conversion does not wait for the prefill's queue, and no request is lost."""
    slow = dict(prefill_concurrency=1, max_prefill_tokens=8, prefill_overhead_s=0.25)
    async with Fleet(1, 2, **SIM, prefill_overrides=slow) as fleet:
        # round robin: half of b's requests on the donor (random put fewer than 3 of 12 there 2% of the time)
        a, b = [await start_replica(cluster_config(fleet, etcd.endpoints, decode_policy="round_robin"))
                for _ in range(2)]
        try:
            handle = fleet.decode[1]
            waiting = [asyncio.ensure_future(b.generate(BODY)) for _ in range(12)]
            await wait_for(lambda: b.worker(handle).inflight >= 3, timeout=10, message="requests on the donor")
            status, record = await a.call("POST", f"/admin/workers/{handle.url}/convert", {"mode": "shed"})
            assert status == 200 and record["outcome"] == "converted", record
            drain = record["steps"][0]
            assert drain["step"] == "drain" and drain["details"]["resent"] >= 3, drain
            assert not all(t.done() for t in waiting)  # it did not wait for the prefill's queue
            answers = await asyncio.gather(*waiting)
            assert [status for status, _ in answers] == [200] * len(answers), answers
            assert all(answer["meta_info"]["finish_reason"]["type"] == "length" for _, answer in answers)
            await wait_for(lambda: len(b.app[PROXY].live) == 0, timeout=5, message="nothing live on the other replica")
        finally:
            await b.close()
            await a.close()
