"""Routability: the pure rules (one table each) and the registry that applies them and reports each change."""

from __future__ import annotations

import pytest

from router.core.registry import Registry, Role, WorkerState
from router.core.routability import Hold, HoldKind, choose_fleet_version, judge
from router.flows.weight_updates import version_after_update

ACTIVE, PENDING, FAILED, DRAINING = WorkerState.ACTIVE, WorkerState.PENDING, WorkerState.FAILED, WorkerState.DRAINING
P, D = Role.PREFILL, Role.DECODE
PAUSED_HOLD = Hold(HoldKind.PAUSED, "not ready")


# ---- judge --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("state,monitor,breaker,version,fleet,hold,routable,healthy,fragment", [
    (ACTIVE, True, "closed", "v1", "v1", None, True, True, ""),
    (ACTIVE, True, "half_open", "v1", "v1", None, True, True, ""),  # trial traffic
    (ACTIVE, True, "closed", None, "v1", None, True, True, ""),  # a server that reports no version: not judged
    (ACTIVE, True, "closed", "v1", None, None, True, True, ""),  # no fleet version: nobody held to one
    (ACTIVE, True, "closed", "v0", "v1", None, False, False, "weight version 'v0' differs from the fleet's 'v1'"),
    (ACTIVE, False, "closed", "v1", "v1", None, False, False, "unhealthy: 3 failed probes"),
    (ACTIVE, True, "open", "v1", "v1", None, False, True, "circuit breaker open"),
    (PENDING, True, "closed", "v1", "v1", None, False, True, "state pending"),
    (DRAINING, True, "closed", "v1", "v1", None, False, True, "state draining"),
    (FAILED, True, "closed", "v1", "v1", PAUSED_HOLD, False, True, "held out (paused): not ready"),
    (ACTIVE, True, "closed", "v1", "v1", PAUSED_HOLD, False, True, "held out (paused)"),  # a hold alone suffices
])
def test_judge(state, monitor, breaker, version, fleet, hold, routable, healthy, fragment):
    verdict = judge(state, monitor, "3 failed probes", breaker, version, fleet, hold)
    assert (verdict.routable, verdict.healthy) == (routable, healthy)
    assert fragment in verdict.reason and (verdict.reason == "") is routable


def test_judge_health_reason_names_the_probes_before_the_weights():
    assert judge(ACTIVE, False, "probes failing", "closed", "v0", "v1", None).health_reason == "probes failing"
    assert "weight version" in judge(ACTIVE, True, "healthy", "closed", "v0", "v1", None).health_reason


# ---- the fleet's version at start-up ------------------------------------------------------------------------
@pytest.mark.parametrize("servers,chosen", [
    ([], None),
    ([(P, None), (D, None)], None),
    ([(P, "v1"), (D, "v1")], "v1"),
    ([(P, "v2"), (D, "v2"), (D, "v1")], "v2"),  # most servers
    ([(P, "v1"), (D, "v1"), (D, "v2"), (D, "v2")], "v1"),  # v2 has no prefill: it cannot serve
    ([(P, "v1"), (P, "v2"), (D, "v1"), (D, "v2"), (D, "v2")], "v2"),
    ([(P, "v2"), (D, "v1"), (P, "v1"), (D, "v2")], "v2"),  # a tie: the earliest server's version
    ([(P, "v1"), (P, "v2"), (P, "v2")], "v2"),  # no pair anywhere: the most common
    ([(P, None), (D, "v3"), (P, "v3")], "v3"),
])
def test_choose_fleet_version(servers, chosen):
    assert choose_fleet_version(servers) == chosen


# ---- the version after an update: one rule, at the update's own end and at a takeover's -------------------------
@pytest.mark.parametrize("target,reports,chosen", [
    ("v2", [(P, "v2"), (D, "v2")], "v2"),
    ("v2", [(P, "v1"), (D, "v1"), (D, "v2")], "v1"),  # v2 reached no prefill: the pair that serves
    ("v2", [(D, "v2"), (D, "v2")], "v2"),  # no pair anywhere: the most common
    (None, [(P, "v3"), (D, "v3"), (D, "v1")], "v3"),
    (None, [(P, "v1"), (D, "v1"), (D, "v3"), (D, "v3")], "v1"),  # v3 has no prefill
    ("v2", [], None),  # nobody reports a version: the fleet's stays
    ("v2", [(P, None), (D, None)], None),
])
def test_version_after_update(target, reports, chosen):
    assert version_after_update(target, reports) == chosen


# ---- the registry applies the rules and tells every change ---------------------------------------------------
@pytest.fixture
def registry():
    registry = Registry()
    registry.events = []
    registry.subscribe(lambda event, worker, details: registry.events.append(
        (event, worker.url if worker else None, details)))
    return registry


def routable_events(registry) -> list[tuple[str, bool]]:
    return [(url, details["routable"]) for event, url, details in registry.events if event == "routable"]


def test_every_change_of_routability_is_an_event_and_the_snapshot_follows(registry):
    p = registry.add("http://p:1", P, 8998, state=PENDING)
    d = registry.add("http://d:1", D, None)
    assert routable_events(registry) == [("http://d:1", True)] and registry.routable(P) == ()
    registry.set_state(p, ACTIVE, "live state read")
    assert routable_events(registry)[-1] == ("http://p:1", True) and registry.routable(P) == (p,)
    registry.set_health(d, False, "probes failing", breaker="closed")
    assert routable_events(registry)[-1] == ("http://d:1", False) and registry.routable(D) == ()
    assert d.unroutable_reason == "unhealthy: probes failing"
    registry.set_health(d, True, "healthy")
    registry.set_health(d, True, "", breaker="open")  # the breaker alone takes it out too
    assert routable_events(registry)[-2:] == [("http://d:1", True), ("http://d:1", False)]
    count = len(registry.events)
    registry.update_info(p, switch_api="pd_role_switch")  # no change of routability: no routable event
    assert [e for e, *_ in registry.events[count:]] == ["info"]
    registry.remove(p)
    assert routable_events(registry)[-1] == ("http://p:1", False) and registry.routable(P) == ()


def test_the_fleet_version_takes_out_a_server_on_other_weights(registry):
    p = registry.add("http://p:1", P, 8998)
    d1 = registry.add("http://d1:1", D, None)
    d2 = registry.add("http://d2:1", D, None)
    for worker, version in ((p, "v2"), (d1, "v2"), (d2, "v1")):
        registry.update_info(worker, weight_version=version)
    assert len(registry.routable(D)) == 2  # no fleet version yet: nobody is held to one
    registry.set_fleet_version("v2", "test")
    assert registry.routable(D) == (d1,) and not d2.healthy and "'v1' differs" in d2.health_reason
    assert ("fleet_version", None, {"old": None, "new": "v2", "reason": "test"}) in registry.events
    assert routable_events(registry)[-1] == ("http://d2:1", False)
    # An update's versions and the fleet's new one land in one step: no server flaps on the way.
    count = len(registry.events)
    registry.set_fleet_version("v3", "update", worker_versions={p: "v3", d1: "v3", d2: "v3"})
    assert registry.routable(D) == (d1, d2) and registry.routable(P) == (p,)
    assert routable_events(registry)[-1] == ("http://d2:1", True)
    assert not [e for e in registry.events[count:] if e[0] == "routable" and not e[2]["routable"]]


def test_a_hold_takes_a_worker_out_until_it_ends_or_an_operator_acts(registry):
    d1 = registry.add("http://d1:1", D, None)
    d2 = registry.add("http://d2:1", D, None)
    registry.hold_out(d1, HoldKind.PAUSED, "not ready")
    assert (d1.state, d1.hold.kind, d1.routable) == (FAILED, HoldKind.PAUSED, False)
    assert d1.state_reason == "left out by paused: not ready" and registry.held(HoldKind.PAUSED) == [d1]
    assert d1.to_dict()["hold"]["kind"] == "paused" and d1.to_dict()["unroutable_reason"].startswith("held out")
    assert not registry.end_hold(d1, [HoldKind.WEIGHTS], "wrong kind")
    assert registry.end_hold(d1, [HoldKind.PAUSED], "ready again")
    assert (d1.state, d1.hold, d1.routable) == (ACTIVE, None, True) and registry.routable(D) == (d1, d2)
    registry.hold_out(d2, HoldKind.WEIGHTS, "update failed")
    registry.set_state(d2, ACTIVE, "reinstated by an operator")  # an operator's hand ends any hold
    assert d2.hold is None and d2.routable
    registry.hold_out(d2, HoldKind.MEMORY, "resume failed")
    registry.move(d2, P, 9000, ACTIVE, "reinstated as prefill")
    assert d2.hold is None and registry.routable(P) == (d2,)
    kinds = [(event, details.get("kind")) for event, _, details in registry.events if "hold" in event or event == "held"]
    assert kinds == [("held", "paused"), ("hold_ended", "paused"), ("held", "weights"), ("hold_ended", "weights"),
                     ("held", "memory"), ("hold_ended", "memory")]
