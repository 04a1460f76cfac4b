"""`--replicas N`: a supervisor and N router processes serving one port (SO_REUSEPORT), as real processes in
front of a simulated fleet: connections spread over the children, a killed child is restarted, SIGTERM stops
them all gracefully, and the supervisor's death takes its children with it. (Their cluster, through the
supervisor's private etcd or a given one: tests/cluster/test_replicas_on_one_host.py.)"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import time

import aiohttp
import pytest

from harness.processes import below_ephemeral
from simulator.fleet import Fleet

from .helpers import wait_for
from .router_process import REPO, RouterProcess, generate
from .test_shutdown import SIM, running_on_decode

REPLICAS = 2
GRACE_S = 4.0
EXIT_SLACK_S = 2.0  # the interpreters' own exits after the routers have closed everything
START_S = 60.0  # children import the router on a loaded 2-core machine


def replica_flags(tmp_path) -> list[str]:
    """The private etcd's data under the test's directory: a test that ends by SIGKILLing the supervisor
    (which leaves a temporary data directory behind) leaves nothing in /tmp."""
    return ["--replicas", str(REPLICAS), "--etcd-data-dir", str(tmp_path / "etcd")]


def free_ports_in_a_row(count: int) -> int:
    """The first of `count` consecutive free ports, below Linux's ephemeral range (where any client connection
    may hold one of them)."""
    ports = below_ephemeral() or range(20000, 32000)
    rng = random.Random()
    while True:
        first = rng.randrange(ports.start, ports.stop - count)
        try:
            for port in range(first, first + count):
                with socket.socket() as probe:
                    probe.bind(("127.0.0.1", port))
        except OSError:
            continue
        return first


def fresh_connections() -> aiohttp.ClientSession:
    """A session that opens a new connection for every request: each one may reach another child."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True),
                                 timeout=aiohttp.ClientTimeout(total=30))


async def replica_states(session: aiohttp.ClientSession, url: str, tries: int) -> dict[int, dict]:
    """GET /admin/replica `tries` times over new connections: what each child that answered said, by index."""
    seen: dict[int, dict] = {}
    for _ in range(tries):
        try:
            async with session.get(url + "/admin/replica") as resp:
                state = await resp.json()
        except aiohttp.ClientError:  # a child restarting: its socket left the port's group
            continue
        assert resp.status == 200, (resp.status, state)
        seen[state["index"]] = state
    return seen


async def all_children(session: aiohttp.ClientSession, url: str, count: int = REPLICAS) -> dict[int, dict]:
    """Every child's state, once each of them serves (asked until all have answered)."""
    seen: dict[int, dict] = {}

    async def every_child_answered() -> bool:
        seen.update(await replica_states(session, url, 8))
        return len(seen) == count

    await wait_for(every_child_answered, timeout=START_S, interval=0.1, message="every replica serving")
    return seen


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead too (its parent, the supervisor, may not have reaped it yet)
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


async def test_children_share_the_port_each_a_replica_in_its_own_process_group_and_connections_spread(tmp_path):
    async with Fleet(1, 1, **SIM) as fleet, \
            RouterProcess(fleet, *replica_flags(tmp_path), log_path=tmp_path / "router.log") as router, \
            fresh_connections() as session:
        children = await all_children(session, router.url)
        supervisor = router.proc.pid
        assert {state["supervisor_pid"] for state in children.values()} == {supervisor}
        assert len({state["id"] for state in children.values()}) == REPLICAS
        assert all(state["replicas_on_host"] == REPLICAS for state in children.values())
        for state in children.values():  # a terminal's Ctrl-C reaches the supervisor only, which forwards it
            assert os.getpgid(state["pid"]) == state["pid"] != supervisor

        answers = await asyncio.gather(*(generate(session, router.url, f"r{i}", 8, stream=bool(i % 2))
                                         for i in range(40)))
        assert all(answer.get("finish") == "length" for answer in answers), answers
        accepted = await all_children(session, router.url)
        # 40 generation connections and the polls were spread by the kernel: every child took a share
        assert all(state["accepted_connections"] >= 5 for state in accepted.values()), accepted
        assert sum(state["accepted_connections"] for state in accepted.values()) >= 40 + REPLICAS
        log = router.log()
        assert "(supervisor)" in log and "(replica 0)" in log and "(replica 1)" in log, log


async def test_a_killed_child_is_restarted_and_serves_again(tmp_path):
    metrics_port = free_ports_in_a_row(REPLICAS)
    async with Fleet(1, 1, **SIM) as fleet, \
            RouterProcess(fleet, *replica_flags(tmp_path), "--prometheus-port", str(metrics_port),
                          log_path=tmp_path / "router.log") as router, \
            fresh_connections() as session:
        before = await all_children(session, router.url)
        for index in range(REPLICAS):  # each replica's own metrics port: a scrape names one replica
            async with session.get(f"http://127.0.0.1:{metrics_port + index}/metrics") as resp:
                assert resp.status == 200 and "pd_router_requests" in await resp.text()
        victim = before[1]
        os.kill(victim["pid"], signal.SIGKILL)
        killed_at = time.monotonic()

        async def replaced() -> bool:
            state = (await replica_states(session, router.url, 8)).get(1)
            return state is not None and state["pid"] != victim["pid"]

        await wait_for(replaced, timeout=START_S, interval=0.1, message="replica 1 restarted")
        after = await all_children(session, router.url)
        assert after[1]["id"] != victim["id"] and after[0]["pid"] == before[0]["pid"]
        assert not alive(victim["pid"])
        log = router.log()
        assert f"replica 1 (pid {victim['pid']}) ended on its own" in log and "killed by SIGKILL" in log, log
        assert "restarting it in 0.5 s" in log, log
        answers = await asyncio.gather(*(generate(session, router.url, f"r{i}", 4, stream=False) for i in range(10)))
        assert all(answer.get("finish") == "length" for answer in answers), answers
        assert time.monotonic() - killed_at < START_S


async def test_sigterm_stops_every_child_gracefully_and_the_supervisor_exits_0_within_the_grace(tmp_path):
    async with Fleet(1, 2, **SIM) as fleet, \
            RouterProcess(fleet, *replica_flags(tmp_path), "--shutdown-grace-secs", str(GRACE_S),
                          log_path=tmp_path / "router.log") as router, \
            fresh_connections() as session:
        children = await all_children(session, router.url)
        # requests on both children, each ~0.3 s of decoding: they finish within the grace
        requests = [asyncio.ensure_future(generate(session, router.url, f"r{i}", 30, stream=bool(i % 2)))
                    for i in range(8)]
        await wait_for(lambda: running_on_decode(fleet, {f"r{i}" for i in range(8)}), timeout=10)
        sent = router.send(signal.SIGTERM)
        rc = await router.exited(GRACE_S + 15)
        took = time.monotonic() - sent
        answers = await asyncio.gather(*requests)
        log = router.log()
        assert rc == 0, log
        assert took < GRACE_S + EXIT_SLACK_S, f"exited after {took:.2f} s\n{log}"
        for answer in answers:
            assert answer.get("finish") == "length" and answer["tokens"] == 30, answer
        for state in children.values():
            assert not alive(state["pid"])
            assert f"replica {state['index']} (pid {state['pid']}) exited 0" in log, log
        assert log.count("stopped accepting connections") == REPLICAS, log
        assert "every replica stopped" in log and "ended on its own" not in log, log


async def test_a_killed_supervisor_takes_its_children_with_it(tmp_path):
    async with Fleet(1, 1, **SIM) as fleet, \
            RouterProcess(fleet, *replica_flags(tmp_path), log_path=tmp_path / "router.log") as router, \
            fresh_connections() as session:
        children = await all_children(session, router.url)
        router.send(signal.SIGKILL)
        await router.exited(10)
        await wait_for(lambda: not any(alive(state["pid"]) for state in children.values()), timeout=20,
                       message="the children to end with their supervisor")
        assert router.log().count("stopped accepting connections") == REPLICAS  # they shut down gracefully


async def test_a_port_already_taken_is_refused_once_by_the_supervisor(tmp_path):
    async with Fleet(1, 1, **SIM) as fleet:
        router = RouterProcess(fleet, *replica_flags(tmp_path), log_path=tmp_path / "router.log")
        with socket.socket() as squatter, open(router.log_path, "wb") as log:
            squatter.bind(("127.0.0.1", router.port))
            squatter.listen(1)
            proc = await asyncio.create_subprocess_exec(*router.argv, stdout=log, stderr=asyncio.subprocess.STDOUT,
                                                        env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO)
            assert await asyncio.wait_for(proc.wait(), START_S) == 1
        log = router.log()
        assert f"cannot serve on 127.0.0.1:{router.port}" in log and "Address already in use" in log, log
        assert "started (pid" not in log
