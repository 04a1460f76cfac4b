"""The cluster's key layout and records: pure rules, no etcd."""

from __future__ import annotations

import pytest

from router.cluster.etcd_keys import ClusterKeys, decode, encode, worker_scope
from router.cluster.shared_records import hold_of, same, state_of, worker_record
from router.core.registry import Registry, Role, WorkerState
from router.core.routability import HoldKind

KEYS = ClusterKeys("prod")
URL = "http://10.0.0.1:30000"


@pytest.mark.parametrize("key, kind, name", [
    (KEYS.replica("host-1-ab"), "replica", "host-1-ab"),
    (KEYS.worker(URL), "worker", URL),
    (KEYS.fleet, "fleet", ""),
    (KEYS.leader, "leader", ""),
    (KEYS.lock("fleet"), "lock", "fleet"),
    (KEYS.lock(worker_scope(URL)), "lock", worker_scope(URL)),
    (KEYS.op("r.1"), "op", "r.1"),
    (KEYS.ack("r.1", "host-2"), "ack", "r.1/host-2"),
    ("/pd-router/other/v1/fleet", "other", "/pd-router/other/v1/fleet"),
])
def test_every_key_reads_back_as_what_it_names(key, kind, name):
    assert key.startswith(KEYS.prefix) or kind == "other"
    assert KEYS.kind_of(key) == (kind, name)


def test_a_url_is_one_path_segment_so_one_server_never_prefixes_another():
    assert KEYS.worker(URL) == "/pd-router/prod/v1/workers/http%3A%2F%2F10.0.0.1%3A30000"
    assert not KEYS.worker("http://10.0.0.1:3000").startswith(KEYS.worker(URL)[:-1] + "/")
    assert KEYS.lock(worker_scope(URL)).startswith(KEYS.locks + "worker/")
    assert "/" not in KEYS.worker(URL).removeprefix(KEYS.workers)


def test_an_unreadable_value_reads_as_empty():
    assert decode(encode({"a": 1})) == {"a": 1}
    assert decode(b"not json") == {} and decode(b"[1, 2]") == {}


def test_a_worker_record_means_the_same_whoever_wrote_it_and_whatever_its_local_id():
    registry = Registry()
    worker = registry.add(URL, Role.PREFILL, 8998, state=WorkerState.ACTIVE)
    mine, theirs = worker_record(worker, "replica-a"), worker_record(worker, "replica-b")
    theirs["id"], theirs["at"] = "w9", theirs["at"] + 5
    assert same(mine, theirs)
    registry.hold_out(worker, HoldKind.WEIGHTS, "serves v1")
    held = worker_record(worker, "replica-a")
    assert not same(mine, held)
    assert hold_of(held).kind is HoldKind.WEIGHTS and state_of(held) is WorkerState.FAILED
    later = dict(held, hold={**held["hold"], "since": held["hold"]["since"] + 10})
    assert same(held, later)  # when a hold began is not what it means
    assert not same(held, dict(held, bootstrap_port=9000))


def test_a_state_this_version_does_not_know_reads_as_failed():
    assert state_of({"state": "draining"}) is WorkerState.DRAINING
    assert state_of({"state": "teleporting"}) is WorkerState.FAILED
    assert hold_of({"hold": {"kind": "gone"}}) is None and hold_of({}) is None
