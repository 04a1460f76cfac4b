"""Three pd-router processes (`python -m router ... --etcd-endpoints`) in front of one simulated 2P+2D fleet,
coordinated through a real etcd, with load spread over all three while the fleet changes:

- a conversion at replica 1 is seen (new role, new bootstrap port) by the other two within 2 s; a weight
  update with abort_all_requests at replica 2 succeeds, and after it returns no replica answers on the old
  version; a worker added at replica 3 is routed by the others within 2 s; no request fails;
- replica 1 SIGKILLed while its conversion drains: within 15 s the others agree on the server's live role
  and route it; replica 1 restarted agrees with them within 3 s; replica 1 SIGKILLed while its weight update
  is updating the servers: the others take it over, serve the version the servers report, and release the
  hold, with no failed request;
- etcd stopped (for longer than the leases' TTL) and started again under load: no request fails.
"""

from __future__ import annotations

import asyncio
import time

from ..helpers import wait_for
from ..router_process import RouterProcess
from .processes import BODY, TTL, all_agree, fleet_view, get, worker_view


async def test_conversion_update_and_new_worker_reach_every_replica_under_load(cluster):
    r1, r2, r3 = await cluster.start(3)
    fleet = cluster.fleet
    load = cluster.load([r1, r2, r3])
    await wait_for(lambda: {a.replica for a in load.answers} == {0, 1, 2}, timeout=20, message="load everywhere")

    # a conversion at replica 1: the others see the new role and bootstrap port within 2 s
    handle = fleet.decode[1]
    status, record = await r1.call("/admin/workers/" + handle.url + "/convert", {})
    converted = time.monotonic()
    assert status == 200 and record["outcome"] == "converted", record
    port = record["bootstrap_port"]
    assert port is not None
    await wait_for(lambda: all_agree([r2, r3], handle.url, lambda w: w["role"] == "prefill"
                                     and w["bootstrap_port"] == port and w["routable"]), timeout=2,
                   interval=0.05, message="the new role and port on the other replicas")
    assert time.monotonic() - converted < 2
    print(f"the other replicas route the converted server {time.monotonic() - converted:.3f} s after the answer")

    # a weight update with abort_all_requests at replica 2: after it returns, nobody answers on the old weights
    status, answer = await r2.call("/update_weights_from_disk", {
        "model_path": "sim/tiny-llama-v2", "weight_version": "v2", "abort_all_requests": True,
        "retry_aborted": True})
    returned = time.monotonic()
    assert status == 200 and answer["weight_version"] == "v2", answer
    assert [w["success"] for w in answer["workers"]] == [True] * 4
    await wait_for(lambda: {a.replica for a in load.answers if a.sent > returned} == {0, 1, 2}, timeout=20)

    # a worker added at replica 3 (on the fleet's weights: one on others is not routed): routed by the others
    # within 2 s
    extra = fleet.decode[2]
    async with r3.session.post(extra.url + "/update_weights_from_disk",
                               json={"model_path": "sim/tiny-llama-v2", "weight_version": "v2"}) as resp:
        assert resp.status == 200
    status, answer = await r3.call("/workers", {"url": extra.url, "worker_type": "decode"})
    added = time.monotonic()
    assert status == 200, answer
    await wait_for(lambda: all_agree([r1, r2], extra.url, lambda w: w["routable"]), timeout=2, interval=0.05,
                   message="the added worker is routable on the other replicas")
    assert time.monotonic() - added < 2
    print(f"the other replicas route the added worker {time.monotonic() - added:.3f} s after the answer")
    await wait_for(lambda: all_agree([r1, r2], extra.url, lambda w: w["requests_total"] > 0), timeout=10,
                   interval=0.1, message="the other replicas route the added worker")

    answers = await load.finish()
    assert load.failed() == [], load.failed()[:5]
    late = [a for a in answers if a.ended > returned]
    assert late and {a.weight_version for a in late} == {"v2"}, "an answer on the old weights after the update"
    assert {a.replica for a in late} == {0, 1, 2}
    views = await asyncio.gather(*(fleet_view(r) for r in (r1, r2, r3)))
    assert views[0] == views[1] == views[2] and len(views[0]) == 5


async def test_a_killed_replicas_conversion_is_taken_over_and_a_restarted_replica_agrees(cluster):
    r1, r2, r3 = await cluster.start(3)
    fleet = cluster.fleet
    handle = fleet.decode[1]
    # a request of replica 1 held on the server (~3 s of decoding), so that its drain waits
    long = {**BODY, "sampling_params": {"max_new_tokens": 600, "temperature": 0}}
    held: list[asyncio.Task] = []
    deadline = time.monotonic() + 10
    while (await worker_view(r1, handle.url))["inflight"] == 0:
        assert time.monotonic() < deadline, "none of replica 1's requests reached the server in 10 s"
        held.append(asyncio.ensure_future(r1.session.post(r1.url + "/generate", json=long)))
        await asyncio.sleep(0.05)
    load = cluster.load([r2, r3])
    status, record = await r1.call("/admin/workers/" + handle.url + "/convert", {"wait": False})
    assert status == 202, record
    await wait_for(lambda: all_agree([r2, r3], handle.url, lambda w: w["state"] == "draining"), timeout=2,
                   interval=0.05, message="the others stopped routing to the draining server")
    await r1.kill()  # SIGKILL: its lease is left to expire
    killed = time.monotonic()
    await wait_for(lambda: all_agree([r2, r3], handle.url, lambda w: w["state"] == "active"
                                     and w["role"] == "decode" and w["routable"]), timeout=15, interval=0.1,
                   message="the others agree on the server's live role and route it")
    taken_over_in = time.monotonic() - killed
    print(f"taken over and routed by the others {taken_over_in:.2f} s after the kill")
    assert taken_over_in < 15
    routed = (await worker_view(r2, handle.url))["requests_total"] + (await worker_view(r3, handle.url))["requests_total"]
    await wait_for(lambda: _routed_more(r2, r3, handle.url, routed), timeout=10, interval=0.1,
                   message="routed again")
    views = [await get(r, "/admin/cluster") for r in (r2, r3)]
    taken = [t for view in views for t in view["taken_over"]]
    assert [(t["kind"], t["outcome"]) for t in taken] == [("conversion", "restored")], taken
    assert (await fleet.state(handle))["counters"]["role_switches"] == 0

    # replica 1 started again (same flags, same port): it agrees with the others within 3 s of serving
    launched = time.monotonic()
    await r1.start()
    serving = time.monotonic()
    await wait_for(lambda: _same_views(r1, r2), timeout=3, interval=0.05, message="the restarted replica agrees")
    assert time.monotonic() - serving < 3
    print(f"the restarted replica agreed {time.monotonic() - serving:.2f} s after serving "
          f"({time.monotonic() - launched:.2f} s after its launch)")
    await load.finish()
    assert load.failed() == [], load.failed()[:5]
    for task in held:
        task.cancel()
    await asyncio.gather(*held, return_exceptions=True)


async def test_a_replica_killed_before_its_recorded_switch_reached_the_server_is_rolled_back_at_once(cluster):
    """The owner records the `switch` step, then calls the server; killed between the two, the server never
    switches. The taker-over asks the server whether a switch runs (without changing anything) instead of
    waiting out the switch's deadline (minutes), and puts it back in its pool within the lease's TTL."""
    r1, r2, r3 = await cluster.start(3)
    fleet = cluster.fleet
    handle = fleet.decode[1]
    await fleet.set_faults(handle, switch_arrival_delay_s=60)  # r1's switch call is still on its way when it dies
    status, record = await r1.call("/admin/workers/" + handle.url + "/convert", {"wait": False})
    assert status == 202, record

    async def step_seen() -> bool:
        ops = (await get(r2, "/admin/cluster"))["operations"]
        return any(op.get("scope") == f"worker/{handle.url}" and op.get("step") == "switch" for op in ops)

    await wait_for(step_seen, timeout=5, interval=0.02, message="the conversion at its switch step")
    await wait_for(lambda: _arriving(fleet, handle), timeout=5, interval=0.02, message="r1's switch call sent")
    await r1.kill()
    killed = time.monotonic()
    await wait_for(lambda: all_agree([r2, r3], handle.url, lambda w: w["state"] == "active"
                                     and w["role"] == "decode" and w["routable"]), timeout=15, interval=0.1,
                   message="the others put the server back in its pool")
    assert time.monotonic() - killed < TTL + 5  # the lease's end and one question, not the switch's deadline
    taken = [t for r in (r2, r3) for t in (await get(r, "/admin/cluster"))["taken_over"]]
    assert [(t["kind"], t["outcome"]) for t in taken] == [("conversion", "restored")], taken
    assert "before its switch reached the server" in taken[0]["message"], taken
    state = await fleet.state(handle)
    assert state["role"] == "decode" and state["counters"]["role_switches"] == 0


async def _arriving(fleet, handle) -> bool:
    return (await fleet.state(handle))["switch_calls_arriving"] == 1


async def test_a_killed_replicas_weight_update_is_taken_over_from_the_servers_live_versions(cluster):
    r1, r2, r3 = await cluster.start(3)
    fleet = cluster.fleet
    for handle in fleet.workers[:4]:  # each server takes 2 s to load new weights
        await fleet.set_faults(handle, update_delay_s=2.0)
    load = cluster.load([r2, r3])
    await wait_for(lambda: {a.replica for a in load.answers} == {0, 1}, timeout=20)
    update = asyncio.ensure_future(r1.call("/update_weights_from_disk", {
        "model_path": "sim/tiny-llama-v2", "weight_version": "v2"}))

    async def updating() -> bool:
        operations = (await get(r2, "/admin/cluster"))["operations"]
        return [(o["kind"], o["step"]) for o in operations] == [("update_weights_from_disk", "update")]

    await wait_for(updating, timeout=10, interval=0.02, message="the update reaches its update step")

    async def loading() -> bool:
        return all([(await fleet.state(h))["weight_lock"]["writer"] for h in fleet.workers[:4]])

    await wait_for(loading, timeout=10, interval=0.02, message="every server is loading the new weights")
    await r1.kill()
    killed = time.monotonic()
    update.cancel()
    await asyncio.gather(update, return_exceptions=True)

    async def taken_over() -> bool:
        views = await asyncio.gather(get(r2, "/weight_updates"), get(r3, "/weight_updates"))
        return all(v["fleet_weight_version"] == "v2" and v["admission"]["open"] for v in views)

    await wait_for(taken_over, timeout=15, interval=0.1, message="the others serve v2, admission open again")
    print(f"update taken over {time.monotonic() - killed:.2f} s after the kill")
    after = time.monotonic()
    await wait_for(lambda: sum(a.sent > after for a in load.answers) >= 8, timeout=20)
    answers = await load.finish()
    assert load.failed() == [], load.failed()[:5]
    assert {a.weight_version for a in answers if a.sent > after} == {"v2"}
    taken = [t for r in (r2, r3) for t in (await get(r, "/admin/cluster"))["taken_over"]]
    assert [(t["kind"], t["outcome"]) for t in taken] == [("update_weights_from_disk", "succeeded")], taken
    states = [await fleet.state(h) for h in fleet.workers[:4]]
    assert [state["weight_version"] for state in states] == ["v2"] * 4


async def _routed_more(r2, r3, url: str, before: int) -> bool:
    views = await asyncio.gather(worker_view(r2, url), worker_view(r3, url))
    return sum(v["requests_total"] for v in views) > before


async def _same_views(a: RouterProcess, b: RouterProcess) -> bool:
    return await fleet_view(a) == await fleet_view(b)


async def test_etcd_stopped_and_started_again_under_load_fails_no_request(cluster):
    routers = await cluster.start(3)
    load = cluster.load(routers)
    await wait_for(lambda: {a.replica for a in load.answers} == {0, 1, 2}, timeout=20)
    await cluster.etcd.stop()
    stopped = time.monotonic()
    status, answer = await routers[0].call("/admin/workers/" + cluster.fleet.decode[0].url + "/convert", {})
    assert status == 503 and answer["error"]["type"] == "unavailable", answer
    served = len(load.answers)
    # longer than the leases' TTL: every replica loses its lease, and joins again once etcd is back
    await wait_for(lambda: time.monotonic() - stopped > TTL + 1 and len(load.answers) > served + 10, timeout=20)
    await cluster.etcd.start()

    async def rejoined() -> bool:
        views = await asyncio.gather(*(get(r, "/admin/cluster") for r in routers))
        return all(v["etcd"]["reachable"] and v["lease"]["id"] and v["watch"]["connected"]
                   and v["lease"]["joins"] == 2 for v in views)

    await wait_for(rejoined, timeout=15, interval=0.1, message="every replica joined again")
    await load.finish()
    assert load.failed() == [], load.failed()[:5]
    assert len(load.answers) > served
    status, record = await routers[1].call("/admin/workers/" + cluster.fleet.decode[0].url + "/convert", {})
    assert status == 200, record
    await wait_for(lambda: all_agree(routers, cluster.fleet.decode[0].url, lambda w: w["role"] == "prefill"),
                   timeout=2, interval=0.05)
