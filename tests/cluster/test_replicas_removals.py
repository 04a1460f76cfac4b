"""The command line seeds a cluster, it does not override it: three router processes on a real etcd, started
with the same worker flags, and restarted with them (SIGKILL, SIGTERM, and while etcd is down) after workers
were converted and removed:

- a worker the cluster removed stays removed (a converted one does not come back in its flag's role; a dead
  one replaced through the worker API leaves no pending copy at a restarted replica; its URL answering again
  does not bring it back), and the restarted replica says so, with how to bring it back;
- a converted worker keeps the cluster's role and bootstrap port, not its flag's;
- every replica ends with the cluster's workers, roles and ports (as etcd records them);
- POST /workers brings a removed worker back on purpose, and it then survives restarts;
- a worker source (a discovery file) is a seed too: what it removed stays out of command lines, and an entry
  of its first listing the cluster removed stays out until the entry changes (in process).
"""

from __future__ import annotations

import asyncio
import os
from urllib.parse import quote

import orjson

from router.core.config import WorkerSourcesConfig
from simulator.fleet import Fleet

from ..helpers import wait_for
from .processes import fleet_view, get
from .replicas import SIM, cluster_config, start_replica
from .servers import Servers, cluster_workers


async def call(router, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    async with router.session.request(method, router.url + path, json=body) as resp:
        return resp.status, await resp.json(content_type=None)


def path_of(url: str) -> str:
    return quote(url, safe="")


async def views(routers) -> list[list[tuple]]:
    return await asyncio.gather(*(fleet_view(r) for r in routers))


async def agree_with_the_cluster(cluster, routers) -> bool:
    """Every replica lists exactly the cluster's workers, each in its recorded role and port, routable."""
    records = await cluster_workers(cluster.etcd.endpoints, "e2e")
    records.pop(None)
    expected = sorted((url, role, port) for url, (role, port, _) in records.items())
    for view in await views(routers):
        if sorted((url, role, port) for url, role, port, _, _ in view) != expected:
            return False
        if any(state != "active" for _, _, _, state, _ in view):
            return False
    return True


async def joined(routers) -> bool:
    views = await asyncio.gather(*(get(r, "/admin/cluster") for r in routers))
    return all(v["lease"]["id"] and v["etcd"]["reachable"] for v in views)


async def test_restarted_replicas_keep_removed_workers_out_and_converted_ones_in_the_cluster_s_role(cluster):
    r1, r2, r3 = routers = await cluster.start(3)
    fleet = cluster.fleet
    servers = Servers(fleet)
    p0, p1 = fleet.prefill[:2]
    d0, d1 = fleet.decode[:2]
    spare = fleet.decode[2]
    try:
        # the fleet changes: a spare added, P1 converted to decode then removed, D1 converted to prefill, D0's
        # server dies and a replacement is registered in its place
        status, answer = await call(r3, "POST", "/workers", {"url": spare.url, "worker_type": "decode"})
        assert status == 200, answer
        status, record = await r1.call(f"/admin/workers/{path_of(p1.url)}/convert", {})
        assert status == 200 and record["outcome"] == "converted", record
        await wait_for(lambda: agree_with_the_cluster(cluster, routers), timeout=5, interval=0.05)
        status, answer = await call(r2, "DELETE", f"/workers/{path_of(p1.url)}")
        assert status == 200, answer
        status, record = await r1.call(f"/admin/workers/{path_of(d1.url)}/convert", {})
        assert status == 200 and record["outcome"] == "converted", record
        converted_port = record["bootstrap_port"]
        await servers.kill(d0)
        status, answer = await call(r3, "DELETE", f"/workers/{path_of(d0.url)}")
        assert status == 200, answer
        replacement = await servers.start("decode")
        status, answer = await call(r2, "POST", "/workers", {"url": replacement.url, "worker_type": "decode"})
        assert status == 200, answer
        await wait_for(lambda: agree_with_the_cluster(cluster, routers), timeout=5, interval=0.05,
                       message="every replica on the cluster's records")
        before = await fleet_view(r1)
        records = await cluster_workers(cluster.etcd.endpoints, "e2e")
        assert records[None] == sorted([p1.url, d0.url])
        assert records[d1.url][:2] == ("prefill", converted_port)

        # r2 SIGKILLed and r3 SIGTERMed, both started again with their original flags
        await r2.kill()
        await r2.start()
        r3.send()
        assert await r3.exited(30) == 0
        await r3.start()
        for restarted in (r2, r3):
            assert await fleet_view(restarted) == before  # at once: nothing of its flags came back
            log = restarted.log()
            assert f"{p1.url} was removed from the cluster" in log and "not added from --prefill" in log
            assert f"{d0.url} was removed from the cluster" in log and "not added from --decode" in log
            assert "POST /workers" in log
        await wait_for(lambda: agree_with_the_cluster(cluster, routers), timeout=5, interval=0.05)

        # D0's address answers again (a new server there): no replica takes it back by itself, even one that
        # restarts now with D0 on its command line
        revived = await servers.start("decode", port=d0.port)
        assert revived.url == d0.url
        await r1.kill()
        await r1.start()
        assert await fleet_view(r1) == before

        # a replica restarted while etcd is down serves its command line alone, then drops what the cluster
        # removed as soon as it joins
        await cluster.etcd.stop()
        await r2.kill()
        await r2.start()
        alone = {url for url, *_ in await fleet_view(r2)}
        assert {p1.url, d0.url} <= alone, alone  # its flags, the cluster unknown yet
        await cluster.etcd.start()
        await wait_for(lambda: agree_with_the_cluster(cluster, routers), timeout=15, interval=0.1,
                       message="the replica that started alone converges to the cluster")
        assert all(view == before for view in await views(routers))
        assert (await cluster_workers(cluster.etcd.endpoints, "e2e"))[None] == sorted([p1.url, d0.url])
        await wait_for(lambda: joined(routers), timeout=10, interval=0.1, message="every replica joined again")

        # brought back on purpose: POST /workers clears the removal; restarts keep it (in its live role)
        status, answer = await call(r3, "POST", "/workers", {"url": p1.url})
        assert status == 200 and answer["worker"]["role"] == "decode", answer
        await wait_for(lambda: agree_with_the_cluster(cluster, routers), timeout=5, interval=0.05)
        assert (await cluster_workers(cluster.etcd.endpoints, "e2e"))[None] == [d0.url]
        await r1.kill()
        await r1.start()
        await wait_for(lambda: agree_with_the_cluster(cluster, routers), timeout=5, interval=0.05)
        assert p1.url in {url for url, *_ in await fleet_view(r1)}

        # bad input changes nothing: an unknown worker is 404 JSON, and removing it again is too
        status, answer = await call(r1, "DELETE", f"/workers/{path_of(d0.url)}")
        assert status == 404 and "unknown worker" in answer["error"]["message"], answer
        view = await get(r2, "/admin/cluster")
        assert not view["operations"]
        assert [(r["url"], r["role"], r["how"]) for r in view["removed"]] == [(d0.url, "decode", "DELETE /workers")]
    finally:
        await servers.close()


# ---- a worker source's removals (in process: one app per replica, a real etcd) -------------------------------
def listing(*workers, typed: bool = False) -> str:
    return orjson.dumps({"workers": [{"url": w.url, **({"worker_type": "decode"} if typed else {})}
                                     for w in workers]}).decode()


def write_atomically(path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


async def test_a_worker_source_s_removal_stays_and_only_a_new_entry_brings_it_back(etcd, tmp_path):
    fleet = await Fleet(2, 3, **SIM).start()
    spare = fleet.decode[2]
    path = tmp_path / "workers.json"
    write_atomically(path, listing(spare))
    sourced = dict(worker_sources=WorkerSourcesConfig(file=str(path), file_interval_secs=0.05))
    replicas = []

    async def start(**config):
        replica = await start_replica(cluster_config(fleet, etcd.endpoints, **config))
        replicas.append(replica)
        return replica

    def has(*replicas_, present: bool = True) -> bool:
        return all((r.worker(spare) is not None) is present for r in replicas_)

    try:
        a = await start(workers=2, **sourced)  # the spare from its file
        b = await start(workers=3)  # the spare on its command line
        assert has(a, b)
        write_atomically(path, listing())  # the file drops it: removed from the cluster
        await wait_for(lambda: has(a, b, present=False), timeout=5, message="removed everywhere")
        await b.close()
        b = await start(workers=3)  # restarted with its original flags: the spare stays out
        assert has(b, present=False)
        write_atomically(path, listing(spare))  # listed again: a registration on purpose
        await wait_for(lambda: has(a, b), timeout=5, message="back everywhere")

        status, answer = await b.call("DELETE", f"/workers/{path_of(spare.url)}")  # an operator removes it
        assert status == 200, answer
        await wait_for(lambda: has(a, b, present=False), timeout=5)
        await a.close()
        a = await start(workers=2, **sourced)  # its file, unchanged, seeds nothing the cluster removed
        assert has(a, b, present=False)
        status, sources = await a.call("GET", "/admin/discovery")
        [entry] = sources["sources"][0]["workers"]
        assert entry["status"] == "removed from the cluster", entry
        write_atomically(path, listing(spare, typed=True))  # its entry changes: registered on purpose
        await wait_for(lambda: has(a, b), timeout=5, message="registered again from the changed entry")
    finally:
        for replica in replicas:
            await replica.close()
        await fleet.stop()
