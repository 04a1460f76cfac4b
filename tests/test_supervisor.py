"""router/server/supervisor.py's parts: a child's place from its environment, the restart back-off, the port
reservation, and `--replicas` on the command line. (The processes themselves: tests/test_replicas.py.)"""

from __future__ import annotations

import socket

import pytest

from router.core.config import ConfigError
from router.server.cli import config_from_args
from router.server.supervisor import (REPLICA_ENV, RESTART_BACKOFF_S, STABLE_AFTER_S, Child, ReplicaPlace,
                                      replica_place, reserve_port)


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
