"""router/server/supervisor.py's parts: a child's place from its environment, the restart back-off, the port
reservation, `--replicas` on the command line, and the supervisor with stand-in children (shell scripts in
place of `python -m router`). (Routers as its children: tests/test_replicas.py.)"""

from __future__ import annotations

import asyncio
import signal
import socket

import pytest

from router.core.config import ConfigError
from router.server.cli import config_from_args
from router.server.supervisor import (REPLICA_ENV, RESTART_BACKOFF_S, STABLE_AFTER_S, Child, ReplicaPlace,
                                      Supervisor, replica_place, reserve_port)

from .helpers import wait_for


def test_a_child_reads_its_place_and_a_router_started_directly_has_none():
    place = ReplicaPlace(1, 3, 4242)
    assert replica_place({REPLICA_ENV: place.env_value()}) == place
    assert replica_place({}) is None
    with pytest.raises(ValueError, match=REPLICA_ENV):
        replica_place({REPLICA_ENV: "1-of-3"})


def test_restarts_back_off_doubling_to_a_ceiling_and_a_child_that_ran_long_starts_over():
    child = Child(0)
    waits = [child.next_backoff(ran_s=0.1) for _ in range(10)]
    assert waits[:3] == [RESTART_BACKOFF_S[0], 2 * RESTART_BACKOFF_S[0], 4 * RESTART_BACKOFF_S[0]]
    assert waits == sorted(waits) and waits[-1] == RESTART_BACKOFF_S[1]
    assert child.next_backoff(ran_s=STABLE_AFTER_S) == RESTART_BACKOFF_S[0]


def test_the_port_is_reserved_for_the_children_only_and_a_port_taken_is_refused():
    reserved = reserve_port("127.0.0.1", 0)
    port = reserved[0].getsockname()[1]
    try:
        with socket.socket() as child:  # a child binds beside the reservation, as EagerAcceptSite does
            child.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            child.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            child.bind(("127.0.0.1", port))
            child.listen(8)
            with socket.create_connection(("127.0.0.1", port)):  # connections reach the child's queue
                child.accept()[0].close()
        for reuse_addr in (False, True):  # nothing else can take the port meanwhile
            with socket.socket() as other:
                if reuse_addr:
                    other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                with pytest.raises(OSError, match="in use"):
                    other.bind(("127.0.0.1", port))
        with pytest.raises(ConnectionRefusedError):  # the reservation itself queues no connection
            socket.create_connection(("127.0.0.1", port)).close()
    finally:
        for sock in reserved:
            sock.close()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        with pytest.raises(OSError, match="in use"):
            reserve_port("127.0.0.1", taken.getsockname()[1])


def test_replicas_flag():
    assert config_from_args([], env={}).replicas == 1
    assert config_from_args(["--replicas", "4"], env={}).replicas == 4
    with pytest.raises(ConfigError, match="--replicas must be at least 1"):
        config_from_args(["--replicas", "0"], env={})


def test_a_port_held_only_by_a_closed_connection_in_time_wait_is_reserved():
    """A router restarted on its port: its last connections wait in TIME_WAIT, which only SO_REUSEADDR passes."""
    with socket.socket() as earlier:
        earlier.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        earlier.bind(("127.0.0.1", 0))
        earlier.listen(1)
        port = earlier.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as client:
            served, _ = earlier.accept()
            served.close()  # the server's side closes first: its end of the connection stays in TIME_WAIT
            assert client.recv(1) == b""
    reserved = reserve_port("127.0.0.1", port)
    for sock in reserved:
        sock.close()


def test_with_replicas_each_serves_metrics_on_its_own_port_so_the_ports_must_fit():
    config = config_from_args(["--replicas", "3", "--port", "8000", "--prometheus-port", "9000"], env={})
    assert config.prometheus_port == 9000
    with pytest.raises(ConfigError, match="include --port 9001"):
        config_from_args(["--replicas", "3", "--port", "9001", "--prometheus-port", "9000"], env={})
    with pytest.raises(ConfigError, match="would reach 65536"):
        config_from_args(["--replicas", "2", "--prometheus-port", "65535"], env={})
    config_from_args(["--port", "9001", "--prometheus-port", "9000"], env={})  # alone: one metrics port


async def test_a_child_refusing_its_command_line_stops_them_all_rather_than_restarting_it(tmp_path):
    """Exit status 2 is a refused command line: the same one would be refused again, forever."""
    refusing = tmp_path / "python"
    refusing.write_text("#!/bin/sh\necho 'pd-router: error: no' >&2\nexit 2\n")
    refusing.chmod(0o755)
    supervisor = Supervisor(["--port", "1"], 2, python=str(refusing))
    assert await asyncio.wait_for(supervisor.run(), 30) == 2
    assert [child.starts for child in supervisor.children] == [1, 1]
    assert supervisor.refused in (0, 1)


async def test_a_child_ending_on_its_own_is_started_again(tmp_path):
    """The second start of this stand-in serves until it is signalled (SIGTERM ends it with status 0)."""
    marker = tmp_path / "started-once"
    flaky = tmp_path / "python"
    flaky.write_text(f"#!/bin/sh\nif [ -e {marker} ]; then exec sleep 60; fi\ntouch {marker}\nexit 1\n")
    flaky.chmod(0o755)
    supervisor = Supervisor([], 1, python=str(flaky))
    running = asyncio.ensure_future(supervisor.run())
    child = supervisor.children[0]
    await wait_for(lambda: child.starts == 2, timeout=10)
    supervisor._on_signal(signal.SIGTERM)
    # sleep died of the SIGTERM, as a router still starting (no handlers yet, nothing in flight): a clean stop
    assert await asyncio.wait_for(running, 10) == 0
    assert child.exit_code == -signal.SIGTERM


async def test_a_child_that_fails_its_shutdown_makes_the_supervisor_exit_1(tmp_path):
    failing = tmp_path / "python"
    failing.write_text(f"#!/bin/sh\ntrap 'kill $!; exit 3' TERM\ntouch {tmp_path}/trapped.$$\nsleep 60 &\nwait\n")
    failing.chmod(0o755)
    supervisor = Supervisor([], 2, python=str(failing))
    running = asyncio.ensure_future(supervisor.run())
    await wait_for(lambda: len(list(tmp_path.glob("trapped.*"))) == 2, timeout=10)  # both trap SIGTERM now
    supervisor._on_signal(signal.SIGTERM)
    assert await asyncio.wait_for(running, 10) == 1
    assert [child.exit_code for child in supervisor.children] == [3, 3]


def test_an_etcd_data_dir_is_for_the_private_etcd_of_several_replicas():
    assert config_from_args(["--replicas", "2", "--etcd-data-dir", "/x"], env={}).etcd_data_dir == "/x"
    with pytest.raises(ConfigError, match="--etcd-data-dir is for the private etcd of --replicas N"):
        config_from_args(["--etcd-data-dir", "/x"], env={})
