"""An operation outlives no lease: three router processes on a real etcd, and the replica running an operation
loses its lease mid-way (etcd stopped, or frozen with SIGSTOP: it keeps its connections and answers nothing).

- a weight update in drain mode (no abort_all_requests) waiting in its quiesce for a long request answers 503
  naming why (its lease ended, or etcd did not answer one of its own calls first) within a few seconds of the
  lease's end, leaves nothing running in GET /weight_updates, and the next control call at that replica
  answers at once (503 while etcd is down, 200 once it is back); the replica that takes the update over
  releases the fleet's hold, and no request is lost;
- a drain-mode conversion waiting for a request on its server ends the same way (503, the server back in its
  pool once another replica took it over);
- control calls refused while etcd is down log one warning line each, no traceback;
- an operation is never acquired on a lease this replica already called lost (in process, real etcd).
"""

from __future__ import annotations

import asyncio
import time

from ..helpers import wait_for
from .processes import BODY, TTL, get, worker_view
from .replicas import cluster_config, start_replica

LONG = {**BODY, "sampling_params": {"max_new_tokens": 4000, "temperature": 0}}  # ~20 s of decoding
ANSWER_WITHIN_S = TTL + 3.0  # the lease's end, then a moment


async def hold_request(router, handle) -> list[asyncio.Task]:
    """Long requests sent through `router` until one is on `handle` (left running)."""
    tasks = []
    while (await worker_view(router, handle.url))["inflight"] == 0:
        tasks.append(asyncio.ensure_future(router.session.post(router.url + "/generate", json=LONG)))
        await asyncio.sleep(0.05)  # the pace of sending, not a wait for a condition
    return tasks


async def running_step(router) -> str | None:
    current = (await get(router, "/weight_updates"))["current"]
    return current["step"] if current else None


def names_why(message: str) -> bool:
    """The operation's answer names why it ended: its lease ended ("this replica lost it"), or one of its own
    etcd calls failed first ("etcd did not answer": at once when etcd is stopped, at its deadline when frozen,
    which can come before the lease's)."""
    return "this replica lost it" in message or "etcd did not answer" in message


async def settled(routers) -> bool:
    """Nothing running anywhere and admission open on every replica (the lost operation was taken over)."""
    for router in routers:
        view, updates = await get(router, "/admin/cluster"), await get(router, "/weight_updates")
        if view["operations"] or not updates["admission"]["open"] or updates["current"] or not view["lease"]["id"]:
            return False
    return True


async def test_an_operation_whose_replica_loses_its_lease_answers_at_once_and_blocks_nothing(cluster):
    r1, r2, r3 = routers = await cluster.start(3)
    fleet = cluster.fleet
    held: list[asyncio.Task] = []
    load = cluster.load([r2, r3], per_replica=1)

    for how in ("stop", "freeze"):
        # a long request on the server, so that the update waits in its quiesce (again if the last ended)
        held += await hold_request(r1, fleet.decode[0])
        update = asyncio.ensure_future(r1.call("/update_weights_from_disk", {
            "model_path": "sim/tiny-llama", "weight_version": f"lost-{how}"}))
        await wait_for(lambda: _step_is(r1, "quiesce"), timeout=10, interval=0.02, message="the update quiesces")
        if how == "stop":
            await cluster.etcd.stop()
        else:
            await cluster.etcd.freeze()
        cut = time.monotonic()
        status, answer = await asyncio.wait_for(update, ANSWER_WITHIN_S + 5)
        answered_in = time.monotonic() - cut
        print(f"etcd {how}: the update answered {status} {answered_in:.2f} s after etcd went away")
        assert status == 503 and names_why(answer["error"]["message"]), answer
        assert answered_in < ANSWER_WITHIN_S, answered_in
        updates = await get(r1, "/weight_updates")
        assert updates["current"] is None and updates["last"]["state"] == "failed", updates["last"]
        assert names_why(updates["last"]["message"])
        # the next control call at that replica is answered at once, not queued behind the lost update
        asked = time.monotonic()
        status, answer = await r1.call("/pause_generation", {"mode": "in_place"})
        assert status == 503 and time.monotonic() - asked < 3, (status, answer)
        status, answer = await r2.call("/update_weights_from_disk", {"model_path": "sim/tiny-llama"})
        assert status == 503, answer
        if how == "stop":
            await cluster.etcd.start()
        else:
            cluster.etcd.thaw()
        await wait_for(lambda: settled(routers), timeout=15, interval=0.1, message="the lost update taken over")
        # nothing was updated (the update never got past its quiesce), the fleet serves its version
        assert {(await fleet.state(h))["weight_version"] for h in fleet.workers} == {"default"}

    # a drain-mode conversion waiting for a request on its server, its replica's etcd frozen
    held += await hold_request(r1, fleet.decode[0])
    status, record = await r1.call("/admin/workers/" + fleet.decode[0].url + "/convert", {"wait": False})
    assert status == 202, record
    await wait_for(lambda: _all_see(routers, fleet.decode[0].url, "draining"), timeout=15, interval=0.02,
                   message="the server draining everywhere")
    await cluster.etcd.freeze()
    cut = time.monotonic()

    async def ended() -> dict | None:
        async with r1.session.get(f"{r1.url}/admin/conversions/{record['id']}") as resp:
            body = await resp.json()
        return body if body["outcome"] is not None else None

    await wait_for(ended, timeout=ANSWER_WITHIN_S + 5, interval=0.05, message="the conversion ends")
    assert time.monotonic() - cut < ANSWER_WITHIN_S
    body = await ended()
    assert body["status"] == 503 and names_why(body["message"]), body
    cluster.etcd.thaw()
    await wait_for(lambda: _all_see(routers, fleet.decode[0].url, "active"), timeout=15, interval=0.1,
                   message="the server back in its pool everywhere")
    # r1 joins again after the thaw on its own schedule (a back-off): control calls need its new lease
    await wait_for(lambda: settled(routers), timeout=15, interval=0.1, message="every replica joined again")
    status, answer = await r1.call("/pause_generation", {"mode": "in_place"})
    assert status == 200, answer
    status, answer = await r3.call("/continue_generation", {})
    assert status == 200, answer
    await wait_for(lambda: settled(routers), timeout=10, interval=0.1)
    assert (await fleet.state(fleet.decode[0]))["counters"]["role_switches"] == 0

    await load.finish()
    assert load.failed() == [], load.failed()[:5]
    for task in held:
        task.cancel()
    await asyncio.gather(*held, return_exceptions=True)
    for router in routers:  # an expected refusal is one warning line, never a traceback
        log = router.log()
        assert "background task failed" not in log and "Traceback" not in log, log[-3000:]
    assert "POST /update_weights_from_disk answered 503" in r2.log()


async def _step_is(router, step: str) -> bool:
    return await running_step(router) == step


async def _all_see(routers, url: str, state: str) -> bool:
    views = await asyncio.gather(*(worker_view(r, url) for r in routers))
    return all(v is not None and v["state"] == state for v in views)


async def test_an_operation_is_not_acquired_on_a_lease_called_lost_while_etcd_took_the_lock(etcd):
    """etcd frozen while the acquisition's transaction is on its way, and the replica calls its lease lost
    (its local deadline: renewals unanswered) while etcd, thawed a moment later, still has it and applies the
    transaction: the lock is given back and the call refused, never run. (The lease is called lost early here,
    by moving its local deadline: etcd's own expiry of a frozen lease races the thaw.)"""
    from simulator.fleet import Fleet

    from .replicas import SIM

    fleet = await Fleet(1, 1, **SIM).start()
    replica = await start_replica(cluster_config(fleet, etcd.endpoints))
    try:
        cluster = replica.cluster
        cluster.client.timeout = 30.0  # the transaction waits for the thaw instead of timing out
        lease = cluster.membership.lease
        renewals = lease.renewals
        await wait_for(lambda: lease.renewals > renewals, timeout=5, message="a renewal")  # a full TTL ahead
        await etcd.freeze()
        acquire = asyncio.ensure_future(cluster.coordinator.acquire("update_weights_from_disk", "fleet", {}))
        await asyncio.sleep(0.1)  # the transaction's way to the frozen etcd (not a wait for a condition)
        assert not acquire.done()
        lease.deadline = asyncio.get_running_loop().time()  # no renewal answered in time: lost at its next look
        await wait_for(lambda: not lease.alive, timeout=TTL, message="the lease called lost")
        etcd.thaw()
        try:
            await asyncio.wait_for(acquire, 10)
        except Exception as exc:  # noqa: BLE001 - the refusal is what is asserted
            refused = exc
        else:
            refused = None
        assert refused is not None and getattr(refused, "status", None) == 503, refused
        assert "lease ended while it acquired" in str(refused)
        # given back: no lock, and its record closed (by this replica, or by one that adopted it first)
        await wait_for(lambda: cluster.mirror.get(cluster.keys.lock("fleet")) is None
                       and not cluster.coordinator.running(), timeout=5, message="the lock given back")
        # once joined again, the next acquisition works and its lock is on the new lease
        await wait_for(lambda: cluster.membership.trusted() is not None, timeout=10, message="joined again")
        ticket = await cluster.coordinator.acquire("update_weights_from_disk", "fleet", {})
        await cluster.coordinator.release(ticket, "succeeded")
    finally:
        etcd.thaw()
        await replica.close()
        await fleet.stop()
