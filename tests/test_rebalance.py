"""The rebalancer's decision core (rule 2, following the load): one table row per guard, streaks, convergence
without flapping. Rule 1 (refilling an empty pool) and the signals' attribution: tests/test_rebalance_rules.py."""

from __future__ import annotations

from dataclasses import replace

import pytest

from policies.rebalance import (
    BUSY, CONFIRMATIONS, COOLDOWN, DEADBAND, DRAINING, FAILURE_COOLDOWN, FLOOR, MARGIN, NO_CANDIDATE, NO_SIGNAL,
    STEP_COOLDOWN, WARMUP, RebalanceMode, Observation, RebalanceConfig, RebalanceState, UnknownFields, WorkerView,
    conversion_ended, decide, initial_state, pool_pressures,
)

NOW = 1000.0
# Guards off unless a row turns one on, so each row shows one guard at work.
BASE = RebalanceConfig(warmup_secs=0, confirmations=1, cooldown_secs=0, step_cooldown_secs=0,
                       failure_cooldown_secs=0, queue_target=4, min_pressure=1.0, min_improvement=0.2)


def views(role: str, *waiting: int, inflight: tuple[int, ...] = (), **kw) -> tuple[WorkerView, ...]:
    inflight = inflight or (0,) * len(waiting)
    return tuple(WorkerView(f"{role[0]}{i}", inflight=f, running=0, waiting=w, **kw)
                 for i, (w, f) in enumerate(zip(waiting, inflight)))


def observe(prefill=None, decode=None, **kw) -> Observation:
    prefill = views("prefill", 8, 8) if prefill is None else prefill  # queue term 2.0: hot
    decode = views("decode", 0, 0, inflight=(3, 1)) if decode is None else decode  # idle: cold
    return Observation(now=NOW, prefill=prefill, decode=decode, **kw)


STARTED = initial_state(NOW - 3600)

CASES = [
    # name, config changes, state, observation, action, guards
    ("converts when every guard passes", {}, STARTED, observe(), "convert", ()),
    ("no_signal: decode reports nothing", {}, STARTED,
     observe(decode=(WorkerView("d0"), WorkerView("d1"))), "hold", (NO_SIGNAL,)),
    ("deadband: hot pool under min_pressure", {}, STARTED,
     observe(prefill=views("prefill", 2, 2)), "hold", (DEADBAND,)),
    ("margin: the bottleneck would only move (the proposal is not counted)", {}, STARTED,
     observe(decode=views("decode", 4, 3)), "hold", (MARGIN, CONFIRMATIONS)),
    ("margin: a proposal confirmed before converts once the margin passes", {"confirmations": 2},
     replace(STARTED, streak=2, streak_direction="to_prefill"), observe(), "convert", ()),
    ("warmup", {"warmup_secs": 30}, initial_state(NOW - 5), observe(), "hold", (WARMUP,)),
    ("busy: one conversion at a time", {}, STARTED, observe(busy="d1 converting"), "hold", (BUSY,)),
    ("cooldown after a conversion the other way", {"cooldown_secs": 60},
     replace(STARTED, last_conversion_at=NOW - 10, last_direction="to_decode"), observe(), "hold", (COOLDOWN,)),
    ("cooldown over", {"cooldown_secs": 60},
     replace(STARTED, last_conversion_at=NOW - 61, last_direction="to_decode"), observe(), "convert", ()),
    ("step cooldown after a conversion the same way", {"cooldown_secs": 60, "step_cooldown_secs": 15},
     replace(STARTED, last_conversion_at=NOW - 10, last_direction="to_prefill"), observe(), "hold",
     (STEP_COOLDOWN,)),
    ("the same way again once the step cooldown is over", {"cooldown_secs": 60, "step_cooldown_secs": 15},
     replace(STARTED, last_conversion_at=NOW - 16, last_direction="to_prefill"), observe(), "convert", ()),
    ("draining: the hot backlog shrank since the last look", {}, replace(STARTED, last_waits=(40, 0)),
     observe(), "hold", (DRAINING, CONFIRMATIONS)),
    ("failure cooldown", {"failure_cooldown_secs": 300}, replace(STARTED, last_failure_at=NOW - 100),
     observe(), "hold", (FAILURE_COOLDOWN,)),
    ("floor: the donor pool is at its minimum", {}, STARTED,
     observe(decode=views("decode", 0)), "hold", (FLOOR,)),
    ("floor: a larger minimum", {"min_decode": 2}, STARTED, observe(), "hold", (FLOOR,)),
    ("confirmations: first sighting", {"confirmations": 3}, STARTED, observe(), "hold", (CONFIRMATIONS,)),
    ("confirmations: third sighting", {"confirmations": 3},
     replace(STARTED, streak=2, streak_direction="to_prefill"), observe(), "convert", ()),
    ("confirmations: an urgent overload converts on its first sighting", {"confirmations": 3}, STARTED,
     observe(prefill=views("prefill", 12, 12)), "convert", ()),
    ("confirmations: not when urgency is off", {"confirmations": 3, "urgent_pressure": 0}, STARTED,
     observe(prefill=views("prefill", 12, 12)), "hold", (CONFIRMATIONS,)),
    ("confirmations: the streak was the other way", {"confirmations": 2},
     replace(STARTED, streak=5, streak_direction="to_decode"), observe(), "hold", (CONFIRMATIONS,)),
    ("no_candidate", {}, STARTED,
     observe(decode=views("decode", 0, 0, convertible=False)), "hold", (NO_CANDIDATE,)),
    ("every hold guard that fires is named", {"warmup_secs": 30, "cooldown_secs": 60, "confirmations": 2},
     replace(initial_state(NOW - 5), last_conversion_at=NOW - 1, last_direction="to_decode"), observe(busy="w9"),
     "hold", (WARMUP, BUSY, COOLDOWN, CONFIRMATIONS)),
    ("decode hot: a prefill server moves", {}, STARTED,
     observe(prefill=views("prefill", 0, 0, 0), decode=views("decode", 9, 9)), "convert", ()),
    ("latency alone is a signal", {"itl_target_secs": 0.05}, STARTED,
     observe(prefill=views("prefill", 0, 0), decode=views("decode", 0, 0, inflight=(3, 3)), itl_s=0.2), "convert",
     ()),
    ("latency left from before is not charged to a pool idle now", {"itl_target_secs": 0.05}, STARTED,
     observe(prefill=views("prefill", 0, 0), decode=views("decode", 0, 0), itl_s=0.2), "hold", (DEADBAND,)),
]


@pytest.mark.parametrize("name,changes,state,obs,action,guards", CASES, ids=[c[0] for c in CASES])
def test_guards(name, changes, state, obs, action, guards):
    decision = decide(obs, state, replace(BASE, **changes))
    assert decision.action == action, decision.reason
    assert decision.guards == guards, decision.reason
    assert decision.reason  # every decision says why
    if action == "hold":
        assert decision.worker_id is None
        assert decision.state.last_conversion_at == state.last_conversion_at
    else:
        assert decision.state.last_conversion_at == NOW and decision.state.conversions == state.conversions + 1


def test_convert_names_the_least_busy_server_and_the_prediction():
    decision = decide(observe(), STARTED, BASE)
    assert (decision.worker_id, decision.from_role, decision.to_role) == ("d1", "decode", "prefill")
    assert decision.direction == "to_prefill"
    # prefill 2.0 over 2 servers -> 3 servers: 1.33; decode 0 -> 0: predicted worst 1.33, 33 % better
    assert decision.predicted_worst == pytest.approx(4 / 3, abs=1e-3)
    assert decision.improvement == pytest.approx(1 / 3, abs=1e-3)
    assert "d1" in decision.reason and decision.pressures["prefill"]["queue"] == 2.0
    d = decision.to_dict()
    assert d["guards"] == [] and "state" not in d and d["worker_id"] == "d1"


def test_hold_guards_keep_the_streak_but_signal_guards_reset_it():
    config = replace(BASE, confirmations=3, cooldown_secs=60)
    state = replace(STARTED, last_conversion_at=NOW - 1, last_direction="to_decode")
    for expected in (1, 2, 3, 4):  # cooldown holds; the sustained signal keeps counting
        decision = decide(observe(), state, config)
        assert decision.guards == (COOLDOWN,) + ((CONFIRMATIONS,) if expected < 3 else ())
        assert decision.streak == expected
        state = decision.state
    quiet = decide(observe(prefill=views("prefill", 0, 0)), state, config)
    assert quiet.guards == (DEADBAND,) and quiet.state.streak == 0


def test_a_sustained_signal_converts_once_then_cools_down():
    config = replace(BASE, confirmations=3, cooldown_secs=60, step_cooldown_secs=60)
    state = STARTED
    actions = []
    for tick in range(8):
        decision = decide(replace(observe(), now=NOW + tick * 5), state, config)
        actions.append(decision.action)
        state = decision.state
    assert actions == ["hold", "hold", "convert", "hold", "hold", "hold", "hold", "hold"]
    assert state.conversions == 1


def test_conversion_ended_starts_the_cooldowns_from_the_end():
    state = replace(STARTED, streak=2, streak_direction="to_prefill")
    ok = conversion_ended(state, NOW, ok=True)
    assert (ok.last_conversion_at, ok.streak, ok.last_failure_at) == (NOW, 0, None)
    failed = conversion_ended(state, NOW, ok=False)
    assert (failed.last_failure_at, failed.streak, failed.last_conversion_at) == (NOW, 0, None)
    assert decide(observe(), failed, replace(BASE, failure_cooldown_secs=10)).guards == (FAILURE_COOLDOWN,)


class Plant:
    """A toy fleet: each pool's queue per server is its demand divided by its size."""

    def __init__(self, prefill: int, decode: int):
        self.sizes = {"prefill": prefill, "decode": decode}

    def observation(self, now: float, demand: dict) -> Observation:
        pools = {}
        for role, n in self.sizes.items():
            per = demand[role] / n
            pools[role] = tuple(WorkerView(f"{role[0]}{i}", waiting=round(per), running=0) for i in range(n))
        return Observation(now=now, prefill=pools["prefill"], decode=pools["decode"])

    def apply(self, decision) -> None:
        self.sizes[decision.from_role] -= 1
        self.sizes[decision.to_role] += 1


@pytest.mark.parametrize("demand,start,margin,expected_sizes,conversions", [
    ({"prefill": 12, "decode": 12}, (2, 2), 0.2, (2, 2), 0),  # balanced: nothing to do
    ({"prefill": 18, "decode": 6}, (2, 2), 0.2, (3, 1), 1),  # prefill-heavy: one D->P, then stays
    ({"prefill": 4, "decode": 30}, (3, 3), 0.25, (2, 4), 1),  # decode-heavy: a 5th D would gain only 20 %
    ({"prefill": 0, "decode": 60}, (3, 3), 0.2, (1, 5), 2),  # no prefill load at all: down to the floor
    ({"prefill": 13, "decode": 11}, (2, 2), 0.2, (2, 2), 0),  # a near-balance sits in the margin
])
def test_converges_without_flapping(demand, start, margin, expected_sizes, conversions):
    config = replace(BASE, confirmations=2, cooldown_secs=20, step_cooldown_secs=10, min_pressure=1.0,
                     min_improvement=margin)
    plant = Plant(*start)
    state = initial_state(0)
    directions = []
    for tick in range(60):
        decision = decide(plant.observation(tick * 5.0, demand), state, config)
        state = decision.state
        if decision.convert:
            plant.apply(decision)
            directions.append(decision.direction)
    assert (plant.sizes["prefill"], plant.sizes["decode"]) == expected_sizes
    assert len(directions) == conversions
    assert len(set(directions)) <= 1, f"flapped: {directions}"


def test_pool_pressure_terms():
    config = RebalanceConfig(queue_target=4, kv_target=0.8, ttft_target_secs=1.0, itl_target_secs=0.1)
    prefill = (WorkerView("a", waiting=4, kv_usage=0.4), WorkerView("b", waiting=0, kv_usage=0.8))
    decode = (WorkerView("c", waiting=0, running=1, kv_usage=0.4), WorkerView("d"))  # d reports nothing
    obs = Observation(now=0, prefill=prefill, decode=decode, ttft_s=0.5, itl_s=0.05)
    p, d = pool_pressures(obs, config)
    assert p == pytest.approx({"queue": 0.5, "ttft": 0.5})  # 4 waiting on prefill, none on decode
    assert d == pytest.approx({"queue": 0.0, "kv": 0.5, "itl": 0.5})
    empty = Observation(now=0, prefill=(WorkerView("a"),), decode=(WorkerView("b"),))
    assert pool_pressures(empty, config) == ({}, {})


def test_a_decode_bound_fleet_with_high_ttft_moves_a_prefill_server_to_decode():
    obs = observe(prefill=views("prefill", 0, 0), decode=views("decode", 12, 12), ttft_s=8.0)
    decision = decide(obs, STARTED, BASE)
    assert decision.convert and decision.to_role == "decode", decision.reason


@pytest.mark.parametrize("changes,fragment", [
    ({"mode": "sometimes"}, "mode"),
    ({"interval_secs": 0}, "interval_secs"),
    ({"confirmations": 0}, "confirmations"),
    ({"min_decode": 0}, "min_decode"),
    ({"min_improvement": 1.0}, "min_improvement"),
    ({"cooldown_secs": -1}, "cooldown_secs"),
    ({"step_cooldown_secs": -1}, "step_cooldown_secs"),
    ({"busy_target": 0}, "busy_target"),
    ({"refill_empty_pool": "yes"}, "refill_empty_pool"),
    ({"urgent_pressure": -1}, "urgent_pressure"),
    ({"ttft_target_secs": True}, "ttft_target_secs"),
])
def test_config_is_validated(changes, fragment):
    with pytest.raises(ValueError, match=fragment):
        RebalanceConfig().with_changes(changes)


def test_config_rejects_unknown_keys_and_parses_the_mode():
    with pytest.raises(UnknownFields, match="bogus"):
        RebalanceConfig().with_changes({"bogus": 1, "mode": "enabled"})
    config = RebalanceConfig().with_changes({"mode": "enabled", "cooldown_secs": 5})
    assert config.mode is RebalanceMode.ENABLED and config.to_dict()["mode"] == "enabled"
    assert len(RebalanceConfig(interval_secs=0, confirmations=0, min_improvement=2).problems()) == 3


def test_the_step_cooldown_is_a_quarter_of_the_cooldown_unless_set():
    assert RebalanceConfig(cooldown_secs=60).step_cooldown == 15
    assert RebalanceConfig(cooldown_secs=8).step_cooldown == 2
    assert RebalanceConfig(cooldown_secs=60, step_cooldown_secs=0).step_cooldown == 0
    state = replace(STARTED, last_conversion_at=NOW - 3, last_direction="to_prefill")
    assert decide(observe(), state, replace(BASE, cooldown_secs=8, step_cooldown_secs=None)).convert  # 3 s > 2 s
    held = replace(BASE, cooldown_secs=20, step_cooldown_secs=None, interval_secs=1)  # 3 s < 5 s
    assert decide(observe(), state, held).guards == (STEP_COOLDOWN,)


def test_a_look_within_half_an_interval_of_the_step_cooldowns_end_counts_as_after_it():
    """Looks every 6 s, a step cooldown of 6 s run from a conversion's end (0.3 s after its look): the next
    look, 5.7 s after, used to fall inside it, and every next move waited a second look."""
    config = replace(BASE, interval_secs=6, step_cooldown_secs=6)
    state = replace(STARTED, last_conversion_at=NOW - 5.7, last_direction="to_prefill")
    assert decide(observe(), state, config).convert
    early = replace(state, last_conversion_at=NOW - 2.9)  # more than half an interval before its end
    assert decide(observe(), early, config).guards == (STEP_COOLDOWN,)
