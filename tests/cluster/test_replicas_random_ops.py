"""Random control calls at random replicas of three router processes, under load: after each call every
replica must route every server as the server itself reports (role, bootstrap port), a removed worker must be
gone everywhere, and no request may fail.

The calls: a conversion (now and then the same one at two replicas at once: one runs, the other answers 409),
a spare decode server added or removed, pause at one replica and continue at another, a weight update, a
replica restarted (SIGTERM, then a new process that joins from etcd), a replica SIGKILLed a random moment
into a conversion it runs (another completes or rolls it back), and etcd restarted (stopped or killed). Seeded: a failure names its seed and
step, and `PDR_RANDOM_OPS_SEED` / `PDR_RANDOM_OPS_STEPS` replay or lengthen a run.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from urllib.parse import quote

from simulator.fleet import WorkerHandle

from ..helpers import wait_for
from .processes import Cluster, worker_view

STEPS = int(os.environ.get("PDR_RANDOM_OPS_STEPS", "24"))
SEED = int(os.environ.get("PDR_RANDOM_OPS_SEED", "14"))
AGREE_TIMEOUT_S = 10.0
KINDS = ("convert", "convert", "convert_at_two", "spare", "pause", "update", "restart", "kill", "etcd_restart")
TAKEOVER_TIMEOUT_S = 15.0  # issue 14: the others agree on a killed replica's server within 15 s


async def call(router, method: str, path: str, body: dict | None = None) -> tuple[int, dict | None]:
    async with router.session.request(method, router.url + path, json=body) as resp:
        return resp.status, await resp.json(content_type=None)


async def disagreements(cluster: Cluster, routers, members: list[WorkerHandle], removed: list[WorkerHandle]):
    found = []
    for handle in members:
        live = await cluster.fleet.state(handle)
        for index, router in enumerate(routers):
            view = await worker_view(router, handle.url)
            if view is None:
                found.append((index, handle.url, "absent"))
            elif (view["role"], view["routable"]) != (live["role"], True) or (
                    live["role"] == "prefill" and view["bootstrap_port"] != live["bootstrap_port"]):
                found.append((index, handle.url, view["role"], view["state"], view["bootstrap_port"],
                              "live:", live["role"], live["bootstrap_port"]))
    for handle in removed:
        for index, router in enumerate(routers):
            if await worker_view(router, handle.url) is not None:
                found.append((index, handle.url, "still there"))
    for index, router in enumerate(routers):  # and no operation still ending (a taker-over releases its lock last)
        status, view = await call(router, "GET", "/admin/cluster")
        if status != 200 or view["operations"]:
            found.append((index, "operations running", status, view.get("operations")))
    return found


async def until_agreed(cluster, routers, members, removed, what: str, timeout: float = AGREE_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while found := await disagreements(cluster, routers, members, removed):
        assert time.monotonic() < deadline, f"{what}: replicas disagree with the servers: {found}"
        await asyncio.sleep(0.05)  # the poll interval of a wait with a deadline


async def test_random_control_calls_at_random_replicas_keep_every_replica_on_the_servers_live_state(cluster):
    rng = random.Random(SEED)
    routers = await cluster.start(3)
    fleet = cluster.fleet
    members = [*fleet.prefill[:2], *fleet.decode[:2]]
    spare, spare_in = fleet.decode[2], False
    async with routers[0].session.get(fleet.prefill[0].url + "/model_info") as resp:
        model_path = (await resp.json())["model_path"]
    load = cluster.load(routers, per_replica=1)
    steps: list[tuple[float, str]] = []  # when each began: a failed request is shown beside them

    async def move_load_off(at: int) -> None:
        """Its client's request under way ends and the next goes elsewhere, as a balancer would do."""
        load.urls[at] = routers[(at + 1) % 3].url
        moved = time.monotonic()
        await wait_for(lambda: any(a.replica == at and a.sent > moved for a in load.answers), timeout=10,
                       message="the load moved off the replica")

    for step in range(STEPS):
        kind, at = rng.choice(KINDS), rng.randrange(3)
        what = f"seed {SEED} step {step}: {kind} at replica {at}"
        steps.append((time.monotonic(), what))
        router = routers[at]
        agree_within = AGREE_TIMEOUT_S
        if kind == "kill":
            roles = {h.url: (await fleet.state(h))["role"] for h in members}
            handle = rng.choice(members)
            if list(roles.values()).count(roles[handle.url]) < 2:
                continue
            await move_load_off(at)
            status, answer = await call(router, "POST", f"/admin/workers/{quote(handle.url, safe='')}/convert",
                                        {"mode": "drain", "wait": False})
            assert status == 202, (what, answer)
            await asyncio.sleep(rng.uniform(0, 0.08))  # the kill's moment, chosen at random (not a wait)
            await router.kill()
            routers[at] = (await cluster.start(1))[0]
            load.urls[at] = routers[at].url
            agree_within = TAKEOVER_TIMEOUT_S
        elif kind == "etcd_restart":
            await cluster.etcd.restart(kill=rng.random() < 0.5)
        elif kind in ("convert", "convert_at_two"):
            roles = {h.url: (await fleet.state(h))["role"] for h in members}
            handle = rng.choice(members)
            if list(roles.values()).count(roles[handle.url]) < 2:
                continue  # the last server of its role stays
            path = f"/admin/workers/{quote(handle.url, safe='')}/convert"
            if kind == "convert":
                status, answer = await call(router, "POST", path, {"mode": "drain"})
                assert status == 200 and answer["outcome"] == "converted", (what, answer)
            else:
                other = routers[(at + rng.randrange(1, 3)) % 3]
                answers = await asyncio.gather(call(router, "POST", path, {"mode": "drain"}),
                                               call(other, "POST", path, {"mode": "drain"}))
                statuses = sorted(status for status, _ in answers)
                assert statuses[0] == 200 and statuses[1] in (200, 409), (what, answers)
        elif kind == "spare":
            if spare_in:
                status, answer = await call(router, "DELETE", f"/workers/{quote(spare.url, safe='')}")
            else:
                status, answer = await call(router, "POST", "/workers", {"url": spare.url, "worker_type": "decode"})
            assert status == 200, (what, answer)
            spare_in = not spare_in
            if spare_in and (await fleet.state(spare))["weight_version"] != (await fleet.state(members[0]))[
                    "weight_version"]:
                # left out at the version it serves (not the fleet's): an update takes every server to one
                status, answer = await call(router, "POST", "/update_weights_from_disk",
                                            {"model_path": model_path, "weight_version": f"v{step}"})
                assert status == 200 and answer["success"], (what, answer)
        elif kind == "pause":
            status, answer = await call(router, "POST", "/pause_generation", {"mode": "in_place"})
            assert status == 200, (what, answer)
            status, answer = await call(routers[rng.randrange(3)], "POST", "/continue_generation", {})
            assert status == 200, (what, answer)
        elif kind == "update":
            status, answer = await call(router, "POST", "/update_weights_from_disk",
                                        {"model_path": model_path, "weight_version": f"v{step}",
                                         "abort_all_requests": rng.random() < 0.5, "retry_aborted": True})
            assert status == 200 and answer["success"], (what, answer)
        else:  # restart: the load moves to the others first, so no request meets a stopping replica
            await move_load_off(at)
            router.send()  # SIGTERM: what it serves ends first
            assert await router.exited(30) == 0, what
            await router.__aexit__(None, None, None)
            routers[at] = (await cluster.start(1))[0]
            load.urls[at] = routers[at].url
        await until_agreed(cluster, routers, members + ([spare] if spare_in else []),
                           [] if spare_in else [spare], what, agree_within)
    answers = await load.finish()
    failed = [(a, [w for t, w in steps if t <= a.ended][-2:]) for a in load.failed()]
    assert answers and not failed, failed[:5]
