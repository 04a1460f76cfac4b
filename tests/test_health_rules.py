"""The health and breaker transition rules: pure functions, one test per transition, a fake clock."""

from __future__ import annotations

import pytest

from router.core.config import BreakerConfig, HealthConfig
from router.control.health import (
    CLOSED,
    BreakerState,
    Phase,
    ProbeState,
    after_probe,
    breaker_after_time,
    breaker_after_verdict,
    health_verdict,
    rejoin_refusal,
)

HEALTH = HealthConfig(failure_threshold=3, success_threshold=2)
BREAKER = BreakerConfig(failure_threshold=3, success_threshold=2, timeout_secs=30.0)


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


# ---- probes ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,before,ok,after", [
    ("healthy and proven stays so on a pass",
     ProbeState(proven=True), True, ProbeState(proven=True)),
    ("first pass proves a new worker",
     ProbeState(), True, ProbeState(proven=True)),
    ("a pass clears earlier failures",
     ProbeState(failures=2, proven=True), True, ProbeState(proven=True)),
    ("a failure below the threshold keeps it healthy",
     ProbeState(failures=1, proven=True), False, ProbeState(failures=2, proven=True)),
    ("the threshold-th failure in a row makes it unhealthy",
     ProbeState(failures=2, proven=True), False, ProbeState(healthy=False, failures=3, proven=True)),
    ("a worker that never passed is unhealthy at its first failure",
     ProbeState(), False, ProbeState(healthy=False, failures=1)),
    ("an unhealthy worker counts passes below the threshold",
     ProbeState(healthy=False, failures=3, proven=True), True,
     ProbeState(healthy=False, successes=1, proven=True)),
    ("the threshold-th pass in a row brings it back",
     ProbeState(healthy=False, successes=1, proven=True), True, ProbeState(proven=True)),
    ("a failure while unhealthy restarts the pass count",
     ProbeState(healthy=False, successes=1, proven=True), False,
     ProbeState(healthy=False, failures=1, proven=True)),
])
def test_probe_transition(name, before, ok, after):
    assert after_probe(before, ok, HEALTH) == after, name


def test_flapping_probe_never_reaches_either_threshold():
    """Alternating results: a healthy worker stays in, an unhealthy one stays out (no routing flaps)."""
    up, down = ProbeState(proven=True), ProbeState(healthy=False, failures=3, proven=True)
    for ok in [False, True] * 10:
        up, down = after_probe(up, ok, HEALTH), after_probe(down, ok, HEALTH)
        assert up.healthy and not down.healthy


def test_zero_thresholds_behave_as_one():
    config = HealthConfig(failure_threshold=0, success_threshold=0)
    assert not after_probe(ProbeState(proven=True), False, config).healthy
    assert after_probe(ProbeState(healthy=False, proven=True), True, config).healthy


# ---- breaker -------------------------------------------------------------------------------------------------
def test_closed_breaker_success_is_a_no_op():
    assert breaker_after_verdict(CLOSED, True, 0.0, BREAKER) is CLOSED


def test_closed_breaker_success_clears_failures():
    assert breaker_after_verdict(BreakerState(failures=2), True, 0.0, BREAKER) is CLOSED


def test_closed_breaker_counts_failures_below_threshold():
    clock = FakeClock()
    now = clock()
    assert breaker_after_verdict(BreakerState(failures=1, first_failure_at=now), False, now, BREAKER) == \
        BreakerState(failures=2, first_failure_at=now)


def test_closed_breaker_opens_at_threshold():
    clock = FakeClock()
    now = clock()
    opened = breaker_after_verdict(BreakerState(failures=2, first_failure_at=now), False, now, BREAKER)
    assert opened == BreakerState(Phase.OPEN, failures=3, opened_at=now, first_failure_at=now)


@pytest.mark.parametrize("verdict", [True, False])
def test_open_breaker_ignores_late_verdicts(verdict):
    state = BreakerState(Phase.OPEN, failures=3, opened_at=5.0)
    assert breaker_after_verdict(state, verdict, 6.0, BREAKER) is state


def test_open_breaker_stays_open_before_timeout():
    clock = FakeClock()
    state = BreakerState(Phase.OPEN, failures=3, opened_at=clock())
    clock.advance(BREAKER.timeout_secs - 0.001)
    assert breaker_after_time(state, clock(), BREAKER) is state


def test_open_breaker_goes_half_open_at_timeout():
    clock = FakeClock()
    state = BreakerState(Phase.OPEN, failures=3, opened_at=clock())
    clock.advance(BREAKER.timeout_secs)
    assert breaker_after_time(state, clock(), BREAKER) == BreakerState(Phase.HALF_OPEN)


@pytest.mark.parametrize("state", [CLOSED, BreakerState(failures=2), BreakerState(Phase.HALF_OPEN, successes=1)])
def test_time_changes_only_open_breakers(state):
    assert breaker_after_time(state, 1e9, BREAKER) is state


def test_half_open_counts_successes_below_threshold():
    assert breaker_after_verdict(BreakerState(Phase.HALF_OPEN), True, 0.0, BREAKER) == BreakerState(
        Phase.HALF_OPEN, successes=1)


def test_half_open_closes_at_success_threshold():
    assert breaker_after_verdict(BreakerState(Phase.HALF_OPEN, successes=1), True, 0.0, BREAKER) is CLOSED


def test_half_open_reopens_on_one_failure_and_restarts_the_timer():
    clock = FakeClock(500.0)
    state = breaker_after_verdict(BreakerState(Phase.HALF_OPEN, successes=1), False, clock(), BREAKER)
    assert state == BreakerState(Phase.OPEN, opened_at=500.0)
    clock.advance(BREAKER.timeout_secs / 2)
    assert breaker_after_time(state, clock(), BREAKER) is state


def test_full_breaker_cycle_with_fake_clock():
    clock = FakeClock()
    state = CLOSED
    for _ in range(BREAKER.failure_threshold):
        state = breaker_after_verdict(state, False, clock(), BREAKER)
    assert state.phase is Phase.OPEN
    clock.advance(BREAKER.timeout_secs)
    state = breaker_after_time(state, clock(), BREAKER)
    assert state.phase is Phase.HALF_OPEN
    for _ in range(BREAKER.success_threshold):
        state = breaker_after_verdict(state, True, clock(), BREAKER)
    assert state is CLOSED


# ---- rejoin and the combined verdict ----------------------------------------------------------------------
@pytest.mark.parametrize("version,fleet,refused", [
    ("v2", "v2", False),
    ("v1", "v2", True),
    (None, "v2", False),  # a server that does not report a version cannot be judged
    ("v1", None, False),
])
def test_rejoin_refusal(version, fleet, refused):
    refusal = rejoin_refusal(version, fleet)
    assert (refusal is not None) is refused
    if refused:
        assert version in refusal and fleet in refusal


@pytest.mark.parametrize("probe,breaker,refusal,healthy,fragment", [
    (ProbeState(proven=True), CLOSED, None, True, "healthy"),
    (ProbeState(proven=True), BreakerState(Phase.HALF_OPEN), None, True, "half-open"),
    (ProbeState(healthy=False, failures=3), CLOSED, None, False, "3 failed health probe"),
    (ProbeState(proven=True), BreakerState(Phase.OPEN, failures=3), None, False, "breaker open"),
    (ProbeState(proven=True), CLOSED, "weight version 'a' differs", False, "weight version"),
])
def test_health_verdict(probe, breaker, refusal, healthy, fragment):
    verdict, reason = health_verdict(probe, breaker, refusal)
    assert verdict is healthy and fragment in reason


def test_failures_count_only_within_the_window_of_the_first():
    """--cb-window-duration-secs: two faults 121 s apart are not two in a row; three within 120 s are."""
    config = BreakerConfig(failure_threshold=3, window_secs=120.0)
    state = CLOSED
    for now in (0.0, 60.0):
        state = breaker_after_verdict(state, False, now, config)
    assert state == BreakerState(failures=2, first_failure_at=0.0)
    state = breaker_after_verdict(state, False, 121.0, config)  # the first is out of the window: it starts again
    assert state == BreakerState(failures=1, first_failure_at=121.0)
    state = breaker_after_verdict(breaker_after_verdict(state, False, 150.0, config), False, 200.0, config)
    assert state.phase is Phase.OPEN and state.failures == 3
