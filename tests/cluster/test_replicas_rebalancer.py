"""The rebalancer among router replicas sharing one fleet: it decides on the leader only, refills included.

Two replicas with the rebalancer enabled lose every prefill server (their health verdicts, each replica's own):
both see the prefill pool empty, the leader alone converts a decode server, and the follower applies that
conversion from etcd instead of starting one of its own.
"""

from __future__ import annotations

import pytest

from policies.rebalance import RebalanceConfig, RebalanceMode
from router.flows.rebalancer import REBALANCER
from router.core.registry import Role
from simulator.fleet import Fleet

from ..helpers import wait_for
from .replicas import SIM, cluster_config, start_replica


@pytest.fixture
async def fleet():
    fleet = await Fleet(2, 2, **SIM).start()
    yield fleet
    await fleet.stop()


async def test_only_the_leader_refills_an_empty_pool(etcd, fleet):
    config = cluster_config(fleet, etcd.endpoints, rebalance=RebalanceConfig(mode=RebalanceMode.ENABLED))
    a = await start_replica(config)
    b = await start_replica(config)
    try:
        await wait_for(lambda: a.cluster.leadership.leading or b.cluster.leadership.leading, timeout=5)
        leader, follower = (a, b) if a.cluster.leadership.leading else (b, a)
        for replica in (follower, leader):  # the follower sees the pool empty first
            for worker in replica.registry.workers(Role.PREFILL):
                replica.registry.set_health(worker, False, "probes failing")
        await wait_for(lambda: leader.app[REBALANCER].counters["refills_succeeded"] == 1, timeout=15)
        (refilled,) = leader.registry.routable(Role.PREFILL)
        await wait_for(lambda: follower.worker(next(h for h in fleet.decode if h.url == refilled.url)).role
                       is Role.PREFILL, timeout=5, message="the follower applies the leader's conversion")
        assert follower.app[REBALANCER].counters["refills_started"] == 0
        assert follower.app[REBALANCER].refill_now() is None
        switched = [h for h in fleet.decode if (await fleet.state(h))["counters"]["role_switches"]]
        assert [h.url for h in switched] == [refilled.url]  # one conversion on the servers, not two
    finally:
        await b.close()
        await a.close()
