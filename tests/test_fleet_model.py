"""The fleet model (policies/fleet_model.py): its queueing figures, its tails, and how `plan` weighs moves."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from policies.fleet_model import Costs, Mix, Segment, Slo, erlang_c, headroom, plan, predict, recovery_secs

SLO = Slo(ttft_s=2.0, tpot_s=0.2)
# the live benchmark's kinds on its capacity model: a 1000-token prompt costs 0.2056 s of prefill, 3 decode
# tokens; a 20-token prompt 0.0096 s, 15 decode tokens; a step is 40 ms + 8 ms per running request
PREFILL_HEAVY = Mix(rate=11.0, prefill_s=0.2056, decode_tokens=3, step_fixed_s=0.04, step_per_request_s=0.008)
DECODE_HEAVY = Mix(rate=17.0, prefill_s=0.0096, decode_tokens=15, step_fixed_s=0.04, step_per_request_s=0.008)


def test_one_prefill_waits_as_pollaczek_khinchine_says_and_a_pool_as_erlang_c_says():
    one = Mix(rate=4.0, prefill_s=0.2, decode_tokens=3, step_fixed_s=0.04, step_per_request_s=0.008)
    p = predict(one, 1, 1, SLO)
    rho = 4.0 * 0.2
    assert p.prefill_load == pytest.approx(rho)
    # deterministic sizes, one server: Wq = lambda E[s^2] / (2 (1 - rho))
    assert p.prefill_wait_s == pytest.approx(4.0 * 0.2 ** 2 / (2 * (1 - rho)))
    assert erlang_c(3, 2.0) == pytest.approx(4 / 9)  # the textbook value
    three = predict(replace(one, rate=10.0), 3, 1, SLO)  # offered 2 servers' worth to 3
    assert three.prefill_wait_s == pytest.approx(4 / 9 * 0.5 * 0.2 / (3 * (1 - 2 / 3)))
    assert predict(PREFILL_HEAVY, 2, 2, SLO).attainment == 0.0  # rho 1.13
    assert predict(DECODE_HEAVY, 2, 2, SLO).attainment == 0.0  # u = 17/2 x 15 x 0.008 = 1.02
    assert predict(DECODE_HEAVY, 1, 3, SLO).attainment > 0.99


def test_a_decode_out_of_room_saturates_whatever_its_compute():
    """Real 0.5.23 on CPU: a 4096-token decode pool reserves 512 tokens a request, eight at once; the step line
    says the decode is far from busy, the room says it is full."""
    chatty = Mix(rate=0.3, prefill_s=0.05, decode_tokens=63, step_fixed_s=0.3, step_per_request_s=0.01,
                 decode_slots=8)
    assert predict(replace(chatty, decode_slots=float("inf")), 2, 1, Slo(2.0, 1.0)).attainment > 0.9
    # 0.3/s, each held ~24 s: 7.2 of the one decode's 8 places taken on average, most arrivals wait for one
    assert predict(chatty, 2, 1, Slo(2.0, 1.0)).attainment < 0.5
    assert predict(chatty, 1, 2, Slo(2.0, 1.0)).attainment > 0.9
    assert predict(replace(chatty, rate=0.4), 2, 1, Slo(2.0, 1.0)).attainment == 0.0  # past its places


def test_the_decode_batch_follows_littles_law():
    p = predict(DECODE_HEAVY, 1, 3, SLO)
    per_server = 17.0 / 3
    u = per_server * 15 * 0.008
    assert p.decode_load == pytest.approx(u)
    assert p.decode_batch == pytest.approx(per_server * 15 * 0.04 / (1 - u))
    assert p.tpot_s == pytest.approx(0.04 + 0.008 * (p.decode_batch + 1))


def test_a_mean_step_under_the_target_still_misses_it_for_a_share_of_requests():
    """The issue's drift: TPOT p50 at 0.87 of the target left over a quarter of requests over it. The model
    reads the tail: a batch that fluctuates around a mean step near the target misses for many."""
    mix = Mix(rate=29.0, prefill_s=0.01, decode_tokens=20, step_fixed_s=0.03, step_per_request_s=0.0025,
              shapes=((1.0, 0.2), (1.0, 1.8)))
    p = predict(mix, 1, 2, Slo(2.0, 0.125))
    assert p.tpot_s < 0.125 * 0.95
    assert p.attainment < 0.9


def test_the_spread_of_prompt_lengths_costs_first_tokens_at_the_same_mean():
    even = Mix(rate=9.0, prefill_s=0.2, decode_tokens=4, step_fixed_s=0.04, step_per_request_s=0.008)
    spread = Mix(rate=9.0, prefill_s=0.2, decode_tokens=4, step_fixed_s=0.04, step_per_request_s=0.008,
                 shapes=((0.2, 1.0), (0.2, 1.0), (0.2, 1.0), (3.4, 1.0)))
    a, b = predict(even, 2, 2, Slo(1.0, 0.2)), predict(spread, 2, 2, Slo(1.0, 0.2))
    assert b.prefill_wait_s > a.prefill_wait_s
    assert b.attainment < a.attainment


def test_plan_moves_when_the_split_is_wrong_and_holds_when_the_move_costs_more_than_it_wins():
    fast = plan(DECODE_HEAVY, 3, 1, SLO, Costs(2.0, 2.0), horizon_s=120)
    assert (fast[0].prefills, fast[0].decodes, fast[0].moves, fast[0].direction) == (1, 3, 2, "decode")
    holding = next(c for c in fast if c.moves == 0)
    assert holding.value == 0.0 and fast[0].value > 0.9
    # a split that serves it (2P2D on a steady half-half mix) is not worth a conversion that lasts the horizon
    steady = Mix(rate=12.0, prefill_s=0.107, decode_tokens=9, step_fixed_s=0.04, step_per_request_s=0.008)
    slow = plan(steady, 2, 2, SLO, Costs(120.0, 120.0), horizon_s=120)
    assert slow[0].moves == 0


def test_where_every_split_saturates_the_wait_left_behind_tells_them_apart():
    """25 long prompts a second are 5.1 servers of prefill work: no split of 4 serves them (each values 0), but
    the more prefills, the less waits at the horizon's end; moving costs its conversion's time."""
    over = replace(PREFILL_HEAVY, rate=25.0)
    candidates = {(c.prefills, c.decodes): c for c in plan(over, 2, 2, SLO, Costs(5, 5), horizon_s=60)}
    assert all(c.value == 0.0 for c in candidates.values())
    behind = [candidates[(p, 4 - p)].behind_s for p in (3, 2, 1)]
    assert behind == sorted(behind) and behind[0] < behind[-1]
    assert behind[1] == pytest.approx((25.0 * 0.2056 - 2) * 60 / 2)  # holding 2P2D: the growth over 60 s, per server
    slower = {(c.prefills, c.decodes): c for c in plan(over, 2, 2, SLO, Costs(30, 30), horizon_s=60)}
    assert slower[(3, 1)].behind_s > candidates[(3, 1)].behind_s


def test_a_backlog_is_worth_more_capacity_where_it_waits():
    quiet = plan(PREFILL_HEAVY, 3, 1, SLO, Costs(5, 5), horizon_s=60)
    backlog = plan(replace(PREFILL_HEAVY, waiting_prefill=200.0), 3, 1, SLO, Costs(5, 5), horizon_s=60)
    hold_quiet = next(c for c in quiet if c.moves == 0)
    hold_backlog = next(c for c in backlog if c.moves == 0)
    assert hold_backlog.value < hold_quiet.value


def test_recovery_is_when_a_backlog_stops_making_arrivals_late():
    # 3P under the prefill-heavy mix: 11/s x 0.2056 s = 2.26 servers of work, 0.74 spare; a newcomer meets its
    # 2 s TTFT behind at most 3 x 2 = 6 server-seconds of backlog
    backlog = replace(PREFILL_HEAVY, waiting_prefill=100.0)  # 20.56 server-seconds
    clears = recovery_secs(backlog, [Segment(60.0, 3, 1)], SLO)
    assert clears == pytest.approx((20.56 - 6.0) / (3 - 11.0 * 0.2056))
    assert recovery_secs(PREFILL_HEAVY, [Segment(60.0, 3, 1)], SLO) == 0.0  # no backlog: no one is late
    assert recovery_secs(backlog, [Segment(60.0, 2, 2)], SLO) == math.inf  # 2P: the backlog only grows
    # a conversion first (1P for 15 s): the backlog grows meanwhile, then clears at 3P
    grown = 20.56 + 15.0 * (11.0 * 0.2056 - 1)
    moved = recovery_secs(backlog, [Segment(15.0, 1, 1), Segment(60.0, 3, 1)], SLO)
    assert moved == pytest.approx(15.0 + (grown - 6.0) / (3 - 11.0 * 0.2056))


def test_a_backlog_longer_than_the_horizon_still_tells_a_recovery_from_none():
    """A backlog that takes longer than the horizon to clear at the best split: over a horizon from now every
    split is late all of it, and holding (never clearing) values as the move that clears it (both 0). Counted from
    the quickest recovery, the move is worth what it serves after it."""
    drowning = replace(PREFILL_HEAVY, rate=12.5, waiting_prefill=150.0)  # 3P: 0.43 spare, ~57 s to clear
    candidates = plan(drowning, 1, 3, SLO, Costs(15.0, 15.0), horizon_s=30)
    best, hold = candidates[0], next(c for c in candidates if c.moves == 0)
    assert (best.prefills, best.moves) == (3, 2) and hold.value == 0.0
    assert best.value > 0.1 and best.horizon_s > 30
    assert best.horizon_s == pytest.approx(30 + recovery_secs(drowning, [Segment(15.0, 1, 1), Segment(30, 3, 1)], SLO))


def test_servers_on_their_way_are_counted_and_never_undone():
    candidates = plan(DECODE_HEAVY, 3, 0, SLO, Costs(5, 5), horizon_s=60, arriving=("decode", 1, 2.0))
    assert all(c.direction in (None, "decode") for c in candidates)
    hold = next(c for c in candidates if c.moves == 0)
    assert (hold.prefills, hold.decodes) == (3, 1)
    assert not math.isnan(hold.value)


def test_holding_is_a_candidate_even_below_floors_raised_since():
    """An operator raises --rebalance-min-decode above the decodes there are now: the splits a move may reach
    are those within the floors, and holding is still there to be weighed against them (the decision core
    picks its reference from it)."""
    candidates = plan(DECODE_HEAVY, 3, 1, SLO, Costs(2.0, 2.0), horizon_s=120, min_decode=3)
    splits = {(c.prefills, c.decodes): c.moves for c in candidates}
    assert splits[(3, 1)] == 0
    assert set(splits) == {(3, 1), (1, 3)}  # 2P2D is below the new floor too: no move goes there


def test_headroom_is_the_rate_a_split_takes_before_missing_the_target():
    """The decode-heavy mix at 17/s: 1P3D serves it, 2P2D saturates its decodes. Headroom is the factor on the
    rate at which the prediction crosses the target, whichever pool binds."""
    target = 0.9
    served = headroom(DECODE_HEAVY, 1, 3, SLO, target)
    assert served > 1.0
    assert predict(replace(DECODE_HEAVY, rate=17.0 * served), 1, 3, SLO).attainment >= target
    assert predict(replace(DECODE_HEAVY, rate=17.0 * served * 1.02), 1, 3, SLO).attainment < target
    assert headroom(DECODE_HEAVY, 2, 2, SLO, target) < 1.0  # misses it already
    # a fourth decode relieves the pool that binds; a second prefill does not
    assert headroom(DECODE_HEAVY, 1, 4, SLO, target) > served * 1.2
    assert headroom(DECODE_HEAVY, 2, 3, SLO, target) == pytest.approx(served, rel=0.02)
    # a prefill-heavy mix binds on the prefills instead
    assert headroom(PREFILL_HEAVY, 4, 1, SLO, target) > headroom(PREFILL_HEAVY, 3, 1, SLO, target) > 1.0
