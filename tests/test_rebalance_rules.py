"""The decision rules of issue 20, each able to fail: queues attributed to the pool whose capacity they wait on,
TTFT charged only where requests clearly wait (no tie, not flipped by one request, not to an idle pool), guards
that do not reset each other, refilling an empty pool, the cheapest undoubted server, and the latency window's
sampling of failed and abandoned requests when few finish."""

from __future__ import annotations

from dataclasses import replace

import pytest

from policies.rebalance import (
    BUSY, CONFIRMATIONS, FLOOR, MARGIN, NO_CANDIDATE, PENDING, REFILLING, STEP_COOLDOWN, Observation,
    RebalanceConfig, WorkerView, decide, initial_state, pool_pressures, ttft_charged_to, waits_on_decode,
    waits_on_prefill,
)
from policies.rebalance_signals import decode_overload, waiting_parts
from router.core.records import RequestRecord
from router.core.registry import Registry, Role
from router.flows.latency_window import LatencyWindow

NOW = 1000.0
BASE = RebalanceConfig(warmup_secs=0, confirmations=1, cooldown_secs=0, step_cooldown_secs=0,
                       failure_cooldown_secs=0, queue_target=4, min_pressure=1.0, min_improvement=0.2,
                       ttft_target_secs=1.0, itl_target_secs=0.05)
STARTED = initial_state(NOW - 3600)


def prefill(n: int, waiting_queue: int = 0, bootstrap: int = 0, inflight: int = 0, forward: int = 0,
            **kw) -> tuple[WorkerView, ...]:
    """0.5.23 prefill servers: num_waiting_reqs = waiting queue + bootstrap queue, never a running batch; a
    forward's batch is in no queue of the row. The router has a leg open on each of them."""
    return tuple(WorkerView(f"p{i}", running=0, waiting=waiting_queue + bootstrap, waiting_queue=waiting_queue,
                            bootstrap=bootstrap, inflight_queue=inflight,
                            inflight=waiting_queue + bootstrap + inflight + forward, **kw) for i in range(n))


def decode(n: int, running: int = 0, transfer: int = 0, prealloc_ready: int = 0, waiting_queue: int = 0,
           **kw) -> tuple[WorkerView, ...]:
    """0.5.23 decode servers: num_waiting_reqs = waiting + prealloc + transfer (+ retracted) queues."""
    return tuple(WorkerView(f"d{i}", running=running, waiting=waiting_queue + prealloc_ready + transfer,
                            waiting_queue=waiting_queue, prealloc=prealloc_ready, prealloc_ready=prealloc_ready,
                            transfer=transfer, retracted=0, inflight=running + transfer, **kw)
                 for i in range(n))


def obs(p, d, **kw) -> Observation:
    return Observation(**{"now": NOW, **kw}, prefill=p, decode=d)


# ---- which pool a queue waits on -----------------------------------------------------------------------
def test_a_prefill_short_fleet_is_prefill_hot_though_decode_servers_count_many_waiting():
    """The issue's case: with prefill short, each decode reports as many waiting (its transfer queue) as the
    prefills queue, so both looked equally loaded and nothing moved. The transfer queue waits on prefill."""
    o = obs(prefill(2, waiting_queue=12), decode(2, running=1, transfer=12))
    p_terms, d_terms = pool_pressures(o, BASE)
    assert p_terms["queue"] == pytest.approx(24 / 2 / 4) and d_terms["queue"] == 0.0
    decision = decide(o, STARTED, BASE)
    assert decision.convert and (decision.from_role, decision.to_role) == ("decode", "prefill"), decision.reason


def test_transfer_queues_count_for_prefill_when_prefills_report_less():
    # the prefills' reports lag (a forward in progress hides its batch): the decode side shows the backlog
    o = obs(prefill(2, waiting_queue=1, inflight=1, forward=9), decode(2, transfer=10))
    assert waits_on_prefill(o) == 2 * 10 - 2 * 1


def test_a_decode_short_of_kv_room_is_decode_hot_though_prefills_count_many_waiting():
    """Decode KV room short: the prefill's bootstrap queue and the decode's prealloc queue hold the same
    requests, waiting on decode. It is decode pressure, counted once."""
    o = obs(prefill(2, bootstrap=10), decode(2, running=7, prealloc_ready=10))
    assert waits_on_prefill(o) == 0 and waits_on_decode(o) == 20
    decision = decide(o, STARTED, BASE)
    assert decision.convert and decision.to_role == "decode", decision.reason


def test_kv_reserved_for_a_prefill_to_fill_is_not_decode_pressure():
    d = tuple(WorkerView(f"d{i}", running=1, waiting=8, waiting_queue=0, prealloc=0, transfer=8, retracted=0,
                         kv_usage=0.95, own_kv_usage=0.1) for i in range(2))
    _, d_terms = pool_pressures(obs(prefill(2, waiting_queue=8), d), BASE)
    assert d_terms["kv"] == pytest.approx(0.1 / 0.9)


def test_servers_without_the_breakdown_count_their_waiting_for_their_own_pool():
    o = obs((WorkerView("p0", waiting=3),), (WorkerView("d0", waiting=5),))
    assert (waits_on_prefill(o), waits_on_decode(o)) == (3, 5)


def test_a_decode_row_left_behind_by_its_growing_batch_is_read_with_the_routers_counts():
    """One decode whose last row (15 steps ago) showed 0.06 s steps; the router has 60 decode legs open on it
    now (2 of them still in prefill): by its fitted line (0.04 s + 8 ms a request) a step takes 0.504 s now."""
    p = prefill(3, waiting_queue=0, forward=1)  # each prefill has one leg open (a request in its forward)
    d = (WorkerView("d0", inflight=63, running=3, decode_step_s=0.06, decode_batch=3.0, decode_step_fixed_s=0.04,
                    decode_step_per_request_s=0.008),)
    _, d_terms = pool_pressures(obs(p, d), BASE)
    assert d_terms["itl"] == pytest.approx((0.04 + 0.008 * 60) / 0.05)
    decision = decide(obs(p, d + (WorkerView("d1", inflight=0, running=0),)), STARTED, BASE)
    assert decision.to_role == "decode"
    # the reported step stands when it is the larger, and nothing is predicted without a fit
    idle = (replace(d[0], inflight=0, decode_step_s=0.2),)
    assert pool_pressures(obs(prefill(3), idle), BASE)[1]["itl"] == pytest.approx(0.2 / 0.05)
    unfitted = (replace(d[0], decode_step_fixed_s=None, decode_step_per_request_s=None),)
    assert pool_pressures(obs(p, unfitted), BASE)[1]["itl"] == pytest.approx(0.06 / 0.05)
    # decode legs whose prefill leg is still open wait for their KV, not for decode
    waiting = (replace(d[0], inflight=10),)
    busy_prefills = prefill(2, waiting_queue=5)  # 5 legs open on each
    assert pool_pressures(obs(busy_prefills, waiting), BASE)[1]["itl"] == pytest.approx(0.06 / 0.05)


def test_the_servers_own_decode_step_is_the_current_latency():
    d = decode(2, running=10, decode_step_s=0.1, decode_batch=10.0)
    _, d_terms = pool_pressures(obs(prefill(2), d, itl_s=0.01), BASE)
    assert d_terms["itl"] == pytest.approx(0.1 / 0.05)  # the report, not the router's old p90


# ---- TTFT: where requests clearly wait, never on a tie --------------------------------------------------
@pytest.mark.parametrize("wp,wd,charged", [
    (0, 0, None),  # 0 vs 0: a tie, no queue anywhere
    (6, 6, None),  # a tie
    (3, 2, None),  # one request more is no cause
    (2, 3, None),
    (1, 0, None),  # one request waiting is not a queue
    (4, 2, "prefill"),
    (2, 4, "decode"),
    (8, 0, "prefill"),
    (0, 8, "decode"),
])
def test_ttft_is_charged_only_where_requests_clearly_wait(wp, wd, charged):
    assert ttft_charged_to(wp, wd) == charged
    o = obs(prefill(1, waiting_queue=wp), decode(1, prealloc_ready=wd), ttft_s=5.0)
    p_terms, d_terms = pool_pressures(o, BASE)
    assert ("ttft" in p_terms, "ttft" in d_terms) == (charged == "prefill", charged == "decode")


def test_a_slow_first_token_left_from_the_last_phase_does_not_hold_an_idle_prefill_pool():
    """Decode is now the bottleneck (its step is 3x the target); the p90 TTFT still holds the last phase's
    slow first tokens, but nothing waits on prefill now: prefill is not charged, the move goes to decode."""
    o = obs(prefill(2), decode(2, running=20, decode_step_s=0.15, decode_batch=20.0), ttft_s=12.0)
    decision = decide(o, STARTED, BASE)
    assert decision.convert and decision.to_role == "decode", decision.reason
    assert "ttft" not in decision.pressures["prefill"]


# ---- guards do not reset each other ---------------------------------------------------------------------
def test_a_margin_hold_between_confirmations_does_not_restart_the_streak():
    config = replace(BASE, confirmations=3, urgent_pressure=0)
    hot = obs(prefill(2, waiting_queue=12), decode(2))
    close = obs(prefill(2, waiting_queue=12), decode(2, prealloc_ready=8))  # moving would only move it
    state, guards = STARTED, []
    for o in (hot, close, hot, close, hot):
        decision = decide(o, state, config)
        state = decision.state
        guards.append(decision.guards)
        if decision.convert:
            break
    assert guards[1] == (MARGIN, CONFIRMATIONS) and guards[3] == (MARGIN, CONFIRMATIONS)
    assert decision.convert and len(guards) == 5  # three sightings that passed the margin, two held ones between


# ---- rule 1: refill an empty pool -----------------------------------------------------------------------
GUARDED = replace(BASE, warmup_secs=600, confirmations=5, cooldown_secs=600, step_cooldown_secs=600,
                  failure_cooldown_secs=600)
FRESH = replace(initial_state(NOW - 1), last_conversion_at=NOW - 1, last_direction="to_decode",
                last_failure_at=NOW - 1)


def test_an_empty_prefill_pool_is_refilled_at_once_from_the_cheapest_decode():
    d = (WorkerView("d0", inflight=5, running=5, waiting=0), WorkerView("d1", inflight=1, running=1, waiting=0,
                                                                        used_tokens=900),
         WorkerView("d2", inflight=1, running=1, waiting=0, used_tokens=100))
    decision = decide(obs((), d), FRESH, GUARDED)  # warm-up, cooldowns, failure cooldown, confirmations: none waited
    assert decision.convert and decision.refill and decision.guards == ()
    assert (decision.worker_id, decision.from_role, decision.to_role) == ("d2", "decode", "prefill")
    assert decision.conversion_mode == "abort"  # requests on it: waiting for them keeps the fleet down
    assert "no routable server" in decision.reason and decision.state.refills == 1


def test_an_idle_donor_is_converted_in_drain_mode():
    decision = decide(obs(prefill(3), ()), STARTED, BASE)
    assert decision.refill and decision.to_role == "decode" and decision.conversion_mode == "drain"


def test_a_doubted_server_is_never_the_donor():
    d = (WorkerView("d0", convertible=False), WorkerView("d1", inflight=9, running=9))
    assert decide(obs((), d), STARTED, BASE).worker_id == "d1"
    all_doubted = tuple(WorkerView(f"d{i}", convertible=False) for i in range(2))
    assert decide(obs((), all_doubted), STARTED, BASE).guards == (NO_CANDIDATE,)


@pytest.mark.parametrize("observation,guard", [
    (obs((), decode(1)), FLOOR),  # one decode: none to spare
    (obs((), decode(3), converting_into=("prefill",), busy="d9 converting"), REFILLING),
    (obs((), decode(3), pending=("prefill",)), PENDING),  # start-up: prefills not read yet
    (obs((), ()), FLOOR),
])
def test_refill_holds(observation, guard):
    decision = decide(observation, STARTED, BASE)
    assert decision.action == "hold" and decision.guards == (guard,), decision.reason


def test_the_normal_rule_chooses_the_cheapest_undoubted_server():
    d = (WorkerView("d0", waiting=0, running=0, inflight=0, convertible=False),
         WorkerView("d1", waiting=0, running=3, inflight=3), WorkerView("d2", waiting=0, running=1, inflight=1))
    decision = decide(obs(prefill(2, waiting_queue=12), d), STARTED, BASE)
    assert decision.convert and decision.worker_id == "d2"
    # a decode moving to prefill re-sends what waits on the prefills (shed); the operator's abort mode stands
    assert decision.conversion_mode == "shed" and "shed mode" in decision.reason
    assert decide(obs(prefill(2, waiting_queue=12), d), STARTED, replace(BASE, conversion_mode="abort")).conversion_mode is None
    to_decode = decide(obs(prefill(2), decode(2, running=1, waiting_queue=40)), STARTED, BASE)
    assert to_decode.convert and to_decode.to_role == "decode" and to_decode.conversion_mode is None


# ---- latency: failed and abandoned requests, and too few samples ----------------------------------------
PAIR = Registry().add("http://d:1", Role.DECODE, None)


def ended(ttft=None, outcome="success", status=200, e2e=1.0, itl=None) -> RequestRecord:
    return RequestRecord(route="/generate", stream=True, ttft_s=ttft, itl_s=itl, outcome=outcome, status=status,
                         e2e_s=e2e, decode=PAIR)


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_abandoned_and_failed_requests_count_with_the_time_they_waited():
    window = LatencyWindow(10, Clock(0))
    for _ in range(3):
        window.observe(ended(ttft=0.2))
    for _ in range(3):  # clients gave up after 30 s without a first token; a deadline cut one more
        window.observe(ended(outcome="client_disconnect", status=499, e2e=30.0))
    window.observe(ended(outcome="error", status=504, e2e=60.0))
    summary = window.summary(0, min_samples=5)
    assert summary["ttft_s"] == 60.0 and summary["without_first_token"] == 4 and summary["samples"] == 7


def test_too_few_in_the_window_takes_the_newest_rather_than_nothing():
    clock = Clock(0)
    window = LatencyWindow(10, clock)
    for t in (0, 1, 2):
        clock.now = t
        window.observe(ended(ttft=8.0))
    clock.now = 15  # the window (10 s) holds none of them; an overload finishes few
    window.observe(ended(ttft=9.0))
    window.observe(ended(ttft=9.5))
    summary = window.summary(15, min_samples=5)
    assert summary["ttft_s"] == 9.5 and summary["samples"] == 2
    assert window.summary(15, min_samples=6)["ttft_s"] is None  # fewer than that even four windows back
    assert window.summary(56, min_samples=1)["ttft_s"] is None  # all older than four windows


def test_waiting_for_kv_room_held_by_requests_that_wait_on_prefill_is_prefill_pressure():
    """Seen on real 0.5.23 with 1500-token prompts: a 4096-token decode pool admits two (prompt + 512 reserved),
    both sit in the transfer queue waiting for the prefill, and the rest wait for their room (prealloc_ready).
    Those wait on prefill compute, not on decode: a decode server must move to prefill."""
    o = obs(prefill(1, waiting_queue=3, forward=4, bootstrap=4), decode(2, transfer=2, prealloc_ready=2))
    assert waits_on_decode(o) == 0 and waits_on_prefill(o) == 4 + 4
    decision = decide(o, STARTED, BASE)
    assert decision.convert and decision.to_role == "prefill", decision.reason
    # the same wait for room, behind requests that decode: decode's own
    busy = obs(prefill(1), decode(2, running=7, prealloc_ready=5))
    assert waits_on_decode(busy) == 10 and waits_on_prefill(busy) == 0


def test_requests_started_before_the_last_conversion_ended_do_not_count():
    """A request that waited out a conversion's drain (or began under the old split) describes the old split:
    its slow first token must not push the new one back."""
    clock = Clock(100)
    window = LatencyWindow(30, clock)
    for started in (80.0, 85.0, 90.0):  # waited through the drain that ended at 95
        window.observe(RequestRecord(route="/generate", stream=True, ttft_s=25.0, started=started, decode=PAIR))
    for started in (96.0, 97.0):
        window.observe(RequestRecord(route="/generate", stream=True, ttft_s=0.3, started=started, decode=PAIR))
    assert window.summary(100, min_samples=2)["ttft_s"] == 25.0
    after = window.summary(100, min_samples=2, since=95.0)
    assert after["ttft_s"] == 0.3 and after["samples"] == 2


# ---- a decode row 0.5.23 published steps ago, and undoing the last conversion -------------------------
def test_transfers_a_decode_row_shows_but_no_prefill_holds_are_nobodys():
    """Seen on real 0.5.23 (the real tier's CI failure): right after a prefill moved to decode, a decode-heavy
    load. A decode running batches publishes its row every 15 steps: the requests it admitted together in that
    step sit in that row's transfer queue for seconds, while the prefill computed their KV at once and answered
    their legs. Read as waiting on prefill, they moved the server straight back. The prefill holds only the
    legs of those waiting for decode room (its bootstrap queue): no transfer waits on it."""
    p = prefill(1, bootstrap=4)
    stale = decode(2, running=3, transfer=4, prealloc_ready=2)
    o = obs(p, stale)
    assert waits_on_prefill(o) == 0
    assert waits_on_decode(o) == 2 * 2  # the room they wait for is the decode's own
    decision = decide(o, STARTED, replace(BASE, queue_target=1))
    assert not (decision.convert and decision.to_role == "prefill"), decision.reason
    parts = decision.pressures["signals"]["prefill_parts"]
    assert (parts["decode_transfer"], parts["uncounted_transfer"]) == (0, 8)
    # the same rows while the prefill has those legs in a forward: they wait on it
    busy = obs(prefill(1, bootstrap=4, forward=8), stale)
    assert waits_on_prefill(busy) == 8 + 2 * 2 * 4 / 7
    # half of them still held: half the transfers, and half the room they hold, are the prefill's
    half = obs(prefill(1, bootstrap=4, forward=4), stale)
    assert waits_on_prefill(half) == 4 + 2 * 2 * 4 / 7 / 2


URGENT_PACE = replace(BASE, confirmations=3, urgent_pressure=3.0, cooldown_secs=10)


def test_a_pool_still_hot_after_a_conversion_its_way_gets_the_next_server_on_one_sighting():
    """Eight servers, a phase turning prefill-heavy: the first move was confirmed, and each next one waited on
    fresh confirmations (one move every two looks, four moves taking most of the phase). Within the cooldown of
    a conversion the same way, the pool still hot after it acted, one sighting converts."""
    config = replace(URGENT_PACE, step_cooldown_secs=5)
    hot_prefill = obs(prefill(2, waiting_queue=6), decode(6))  # pressure 1.5: not urgent
    assert decide(hot_prefill, STARTED, config).guards == (CONFIRMATIONS,)  # a first move is confirmed
    after = replace(STARTED, last_conversion_at=NOW - 6, last_direction="to_prefill")
    decision = decide(hot_prefill, after, config)
    assert decision.convert and decision.to_role == "prefill" and "one sighting" in decision.reason
    # not within its step cooldown, not long after it, never the other way
    assert decide(hot_prefill, replace(after, last_conversion_at=NOW - 2), config).guards == (STEP_COOLDOWN,)
    assert decide(hot_prefill, replace(after, last_conversion_at=NOW - 11), config).guards == (CONFIRMATIONS,)
    assert CONFIRMATIONS in decide(hot_prefill, replace(after, last_direction="to_decode", last_conversion_at=NOW - 11),
                                   config).guards


def test_undoing_the_last_conversion_soon_after_it_needs_every_confirmation_however_urgent():
    just_moved_to_decode = replace(STARTED, last_conversion_at=NOW - 15, last_direction="to_decode")
    hot_prefill = obs(prefill(1, waiting_queue=20), decode(3))
    decision = decide(hot_prefill, just_moved_to_decode, URGENT_PACE)
    assert decision.guards == (CONFIRMATIONS,) and "undoing the last conversion" in decision.reason
    state = decision.state
    for _ in range(2):  # it holds for three sightings: then it converts
        decision = decide(hot_prefill, state, URGENT_PACE)
        state = decision.state
    assert decision.convert and decision.to_role == "prefill"
    # the same way as the last conversion, or long after it: one sighting of an urgent overload is enough
    assert decide(hot_prefill, replace(STARTED, last_conversion_at=NOW - 15, last_direction="to_prefill"),
                  URGENT_PACE).convert
    assert decide(hot_prefill, replace(just_moved_to_decode, last_conversion_at=NOW - 21), URGENT_PACE).convert


def test_waiting_for_decode_room_is_read_from_the_side_whose_row_is_less_out_of_date():
    """Prefill-heavy, 2 of 8 requests admitted by the one decode: the prefill's row is from before its long
    forward (its bootstrap queue still lists one now in the forward), the idle decode's is current. The
    decode's prealloc count (6) says what waits for room: the 2 transfers wait on prefill, and so do the 6."""
    p = (WorkerView("p0", inflight=8, running=0, waiting=7, waiting_queue=0, bootstrap=7, inflight_queue=0),)
    d = (WorkerView("d0", inflight=8, running=0, waiting=8, waiting_queue=0, prealloc=6, prealloc_ready=6,
                    transfer=2, retracted=0),)
    o = obs(p, d)
    assert (waits_on_prefill(o), waits_on_decode(o)) == (2 + 6, 0)
    # with the rows' ages: the same, the prefill's row a forward old and the decode's current
    aged = obs((replace(p[0], row_age_s=0.8),), (replace(d[0], row_age_s=0.0),))
    assert (waits_on_prefill(aged), waits_on_decode(aged)) == (2 + 6, 0)


def test_a_decode_row_published_when_it_admitted_its_batch_does_not_hide_those_waiting_for_its_room():
    """The simulated fleet's CI failure (1P2D, decode-heavy, 20 users, room for 7 per decode): d0's row, from the
    step that admitted its batch, lists 7 transfers and none waiting for room; d1's, 10 steps old, 2. The idle
    prefill's row is current: its bootstrap queue holds the 6 legs that wait for decode room now. Read with the
    smaller count (2), 4 of those legs were pipeline, d0's transfers were theirs, and the rebalancer moved a
    decode to prefill (pressure 3.96 vs 1.02)."""
    p = (WorkerView("p0", inflight=6, running=0, waiting=6, waiting_queue=0, bootstrap=6, inflight_queue=0,
                    row_age_s=0.0),)
    d = (WorkerView("d0", inflight=10, running=0, waiting=7, waiting_queue=0, prealloc=0, prealloc_ready=0,
                    transfer=7, retracted=0, row_age_s=0.7),
         WorkerView("d1", inflight=10, running=7, waiting=2, waiting_queue=0, prealloc=2, prealloc_ready=2,
                    transfer=0, retracted=0, row_age_s=0.5))
    o = obs(p, d)
    parts = waiting_parts(o)
    assert (parts["pipeline"], parts["decode_transfer"], parts["uncounted_transfer"]) == (0, 0, 7)
    assert waits_on_prefill(o) == 0
    decision = decide(o, STARTED, replace(BASE, queue_target=1))
    assert not (decision.convert and decision.to_role == "prefill"), decision.reason
    # without the ages the smaller count stands (the rule the test above keeps)
    blind = obs(tuple(replace(w, row_age_s=None) for w in p), tuple(replace(w, row_age_s=None) for w in d))
    assert waiting_parts(blind)["pipeline"] == 6 - 2
    # rows within 50 ms of each other are equally current: the smaller count
    close = obs(p, tuple(replace(w, row_age_s=0.03) for w in d))
    assert waiting_parts(close)["pipeline"] == 6 - 2


# ---- the next server beside ours in progress, when those on their way are not enough --------------------
def test_an_overload_one_server_cannot_relieve_gets_the_next_while_ours_is_still_on_its_way():
    """1P3D, a decode on its way to prefill (out of the decode pool already): 40 wait on the one prefill
    (pressure 10; 5 once the server on its way arrives, still over min_pressure). The next decode is
    converted now, its drain beside the first one's, rather than after it."""
    config = replace(BASE, urgent_pressure=3.0, confirmations=3, step_cooldown_secs=600)
    moving = dict(busy="d2 converting to prefill", converting_into=("prefill",), joining=("prefill",))
    state = replace(STARTED, last_conversion_at=NOW - 1, last_direction="to_prefill")
    decision = decide(obs(prefill(1, waiting_queue=40), decode(2), **moving), state, config)
    assert decision.convert and decision.to_role == "prefill", decision.reason
    assert "once the 1 on their way arrive" in decision.reason
    # relieved enough once it arrives (6 waiting: pressure 1.5, 0.75 with it): one at a time
    held = decide(obs(prefill(1, waiting_queue=6), decode(2), **moving), state, config)
    assert BUSY in held.guards and STEP_COOLDOWN in held.guards, held.reason
    # an operator's conversion, or ours going the other way: one at a time, however urgent
    operator = dict(moving, others_busy="d1 draining", busy="d2 converting to prefill, d1 draining")
    assert BUSY in decide(obs(prefill(1, waiting_queue=40), decode(2), **operator), state, config).guards
    other_way = dict(busy="p1 converting to decode", converting_into=("decode",), joining=("decode",))
    assert BUSY in decide(obs(prefill(1, waiting_queue=40), decode(2), **other_way), state, config).guards
    # the donor pool's floor still holds: the last decode is never taken
    assert FLOOR in decide(obs(prefill(1, waiting_queue=40), decode(1), **moving), state, config).guards



def test_a_decode_pool_at_half_its_capacity_is_not_halved_for_a_burst_of_long_prompts():
    """2P2D serving a steady mix: a Poisson burst queues 9 long prompts on each prefill (4.5); the decodes'
    steps are 77 ms against a 150 ms target (0.51), their fitted line 40 ms + 8 ms a request. Proportionally,
    1D would read 1.03 and the move would pass the margin; by the line half of a step is per request (u
    0.48), one decode would carry 0.96 of its capacity: saturated. Held; and a decode with room does give one."""
    config = replace(BASE, queue_target=2, itl_target_secs=0.15)
    line = dict(decode_step_fixed_s=0.04, decode_step_per_request_s=0.008, decode_batch=4.6)
    burst = obs(prefill(2, waiting_queue=9), decode(2, running=5, decode_step_s=0.077, **line))
    held = decide(burst, STARTED, config)
    assert MARGIN in held.guards and held.predicted_worst > 5, held.reason
    proportional = obs(prefill(2, waiting_queue=9), decode(2, running=5, decode_step_s=0.077))
    assert decide(proportional, STARTED, config).convert  # without the line: the move that flapped
    roomy = obs(prefill(2, waiting_queue=9), decode(2, running=1, decode_step_s=0.048, **line))
    assert decide(roomy, STARTED, config).convert  # u 0.17: one decode carries it at 61 ms


# ---- an urgent prefill queue the prefills were not busy for: a burst ---------------------------------------
def test_a_prefill_queue_new_since_the_last_look_with_the_prefills_mostly_idle_needs_a_second_look():
    """1P2D, decode-heavy: 7 answers finish together on a decode and their successors arrive together at the one
    prefill (or the prefill's process was starved of CPU for a moment): 4 wait for a forward of milliseconds.
    Pressure 4 is urgent, but the prefill was busy 10 % of the time: a burst its next forward clears, not short
    compute. Seen once, it converts nothing; seen again at the next look, it does (a real overload persists)."""
    config = replace(URGENT_PACE, queue_target=1.0)
    burst = obs(prefill(1, waiting_queue=4, prefill_busy=0.1), decode(2, running=7))
    first = decide(burst, STARTED, config)
    assert first.action == "hold" and first.guards == (CONFIRMATIONS,), first.reason
    assert "a burst" in first.reason and "busy 10%" in first.reason
    second = decide(burst, first.state, config)
    assert second.convert and second.to_role == "prefill", second.reason
    # the prefills busy (compute really short): one sighting is enough, as for any urgent overload
    saturated = obs(prefill(1, waiting_queue=4, prefill_busy=0.9), decode(2, running=7))
    assert decide(saturated, STARTED, config).convert
    # a look in between that saw nothing hot: the next one is new again
    calm = obs(prefill(1, prefill_busy=0.1), decode(2, running=1))
    assert decide(burst, decide(calm, first.state, config).state, config).guards == (CONFIRMATIONS,)


def test_a_server_that_reports_no_busy_time_is_read_as_before_one_urgent_sighting_converts():
    config = replace(URGENT_PACE, queue_target=1.0)
    assert decide(obs(prefill(1, waiting_queue=4), decode(2, running=7)), STARTED, config).convert


# ---- a pool short of capacity: the margin waived ------------------------------------------------------------
def test_a_backlog_that_would_not_clear_within_the_ttft_target_waives_the_margin():
    """The eight-server benchmark's phase 3: 5P3D, 100 waiting on the prefills (pressure 10 at a queue target
    of 2), 102 at the look before, 6 s ago: at 0.33 a second they take 300 s to clear. A sixth prefill relieves
    them by only 1/6, under the 20 % margin, which kept the pool at five for the whole phase; but a backlog
    clears at (capacity - arrivals), which one more server multiplies. The decodes (3, near idle) keep two,
    near idle too: the margin is waived and the move is made."""
    config = replace(BASE, queue_target=2, ttft_target_secs=6.0, urgent_pressure=3.0)
    looked = replace(STARTED, last_waits=(102.0, 0.0), last_look_at=NOW - 6)
    short = obs(prefill(5, waiting_queue=20), decode(3, running=1))
    decision = decide(short, looked, config)
    assert decision.convert and decision.to_role == "prefill", decision.reason
    assert decision.improvement < config.min_improvement  # the margin alone would have held it
    assert "margin waived" in decision.reason and "300 s to clear" in decision.reason, decision.reason
    # a growing backlog never clears at its pace: waived too
    assert "grows" in decide(short, replace(looked, last_waits=(80.0, 0.0)), config).reason
    # the same backlog clearing within the target (130 a look before: 5 a second, 20 s, but a target of
    # 30 s): the margin holds
    patient = replace(config, ttft_target_secs=30)
    assert MARGIN in decide(short, replace(looked, last_waits=(130.0, 0.0)), patient).guards
    # no earlier look to tell the pace: the margin holds
    assert MARGIN in decide(short, replace(STARTED, last_waits=None), config).guards
    # nor when the last look came before the last conversion ended (the backlog grew while it converted)
    converted = replace(looked, last_waits=(80.0, 0.0), last_conversion_at=NOW - 5.8, last_direction="to_prefill")
    assert MARGIN in decide(short, converted, config).guards
    assert decide(short, replace(converted, last_conversion_at=NOW - 6.2), config).convert


def test_the_margin_is_not_waived_for_a_donor_left_with_one_server_or_a_cold_pool_the_move_makes_hot():
    """The eight-server benchmark overshot to 7P1D with a waiver that trusted a 2D latency (0.32) to predict
    1D's (1.4 to 3.8 once there): the donor keeps two servers at least. Nor when the cold pool would be over
    min_pressure without the server (the move would only move the bottleneck)."""
    config = replace(BASE, queue_target=2, ttft_target_secs=6.0, urgent_pressure=3.0)
    looked = replace(STARTED, last_waits=(80.0, 0.0), last_look_at=NOW - 6)
    six_two = obs(prefill(6, waiting_queue=16), decode(2, running=1))  # 96 waiting, growing
    held = decide(six_two, looked, config)
    assert MARGIN in held.guards and not held.convert, held.reason
    # three decodes with requests waiting for their KV room (1.5 now; more with two): the move would only move it
    busy = obs(prefill(5, waiting_queue=20), decode(3, running=1, prealloc_ready=3))
    assert MARGIN in decide(busy, looked, config).guards


# ---- the servers a pool needs, in one look --------------------------------------------------------------
def _moved(o: Observation, role: str, k: int) -> Observation:
    """`o` with k of the donor pool on their way to `role` (out of their pool already), as the loop sees it."""
    donor = "decode" if role == "prefill" else "prefill"
    left = o.pool(donor)[k:]
    return replace(o, **{donor: left}, busy=f"{k} converting to {role}", converting_into=(role,),
                   joining=(role,) * k)


def test_a_pool_short_of_several_servers_gets_them_in_the_look_that_started_the_first():
    """The eight-server benchmark's phase 3: 2P6D turned prefill-heavy, 80 waiting (pressure 10). One server a
    look took four looks and most of the phase: asked again in the same look, with the first on its way, the
    next goes beside it while the hot pool is over min_pressure with those on their way and the donor keeps
    two servers under min_pressure."""
    config = replace(URGENT_PACE, step_cooldown_secs=6)
    short = obs(prefill(2, waiting_queue=40), decode(6))
    first = decide(short, STARTED, config)
    assert first.convert and first.to_role == "prefill"
    state, moved = first.state, []
    for k in range(1, 6):
        decision = decide(_moved(short, "prefill", k), state, config)
        if not decision.convert:
            break
        moved.append(decision.worker_id)
        state = decision.state
    assert len(moved) == 3, moved  # 6P2D: the fifth would leave the decodes one server
    assert decision.guards == ("same_look",), decision.reason
    # a look later the rules are the ones before (the floor is min_decode, not two)
    later = decide(replace(_moved(short, "prefill", 4), now=NOW + 6), state, config)
    assert later.convert, later.reason


def test_no_second_server_in_one_look_from_a_donor_it_would_make_hot():
    """The same look, each of six decodes with 7 waiting for room (0.7 at a queue target of 10). The second
    server's prediction is of the pool that carried the load when it was read: four left for the load of six
    read 1.05, over min_pressure: only one goes in this look. (From the five still in the pool it would read
    0.875: the servers this look took have not handed their load over yet.)"""
    config = replace(URGENT_PACE, step_cooldown_secs=6, queue_target=10)
    short = obs(prefill(2, waiting_queue=60), decode(6, running=1, prealloc_ready=7))
    first = decide(short, STARTED, config)
    assert first.convert and first.state.look_moves == 1
    second = decide(_moved(short, "prefill", 1), first.state, config)
    assert second.guards == ("same_look",), second.reason
    assert "keep 4 at 1.05" in second.reason, second.reason
    # the same at the next look is the alongside rule's, as before (the margin is its only check on the donor)
    next_look = replace(_moved(short, "prefill", 1), now=NOW + 6)
    assert "same_look" not in decide(next_look, first.state, config).guards


# ---- a decode pool past saturation: what arrives, not the batch it runs -----------------------------------
LINE = dict(decode_step_fixed_s=0.24, decode_step_per_request_s=0.048)


def _two_decodes(batch: int, started: int) -> tuple[WorkerView, ...]:
    return tuple(WorkerView(f"d{i}", running=batch, waiting=0, waiting_queue=0, prealloc=0, prealloc_ready=0,
                            transfer=0, retracted=0, inflight=batch, started=started,
                            decode_step_s=0.24 + 0.048 * batch, decode_batch=batch, **LINE) for i in range(2))


def test_decode_overload_is_arrivals_over_completions_between_two_looks_at_the_same_servers():
    # 34 arrived in 6 s, the batch grew by 20: 14 completed, arrivals 34 / 14 = 2.43 times the completions
    assert decode_overload((112, 1034, 2), (92, 1000, 2), 6.0) == pytest.approx(34 / 14)
    assert decode_overload((90, 1034, 2), (92, 1000, 2), 6.0) == 1.0  # the batch shrank: it keeps up
    assert decode_overload((112, 1034, 3), (92, 1000, 2), 6.0) == 1.0  # other servers: nothing to compare
    assert decode_overload((112, 1000, 2), (92, 1000, 2), 6.0) == 1.0  # nothing arrived (a count reset)
    assert decode_overload((125, 1034, 2), (92, 1000, 2), 6.0) == 4.0  # one completion: capped


def test_a_decode_pool_past_saturation_gets_the_servers_its_arrivals_need_in_one_look():
    """The eight-server benchmark's phase 2: 6P2D turned decode-heavy, each decode's batch growing from 46 to
    56 in a look (steps 2.9 s against a fixed 0.24 s: u 0.92 by the step line) while 2.4 times what completes
    arrives. By the step line one more decode would carry the batch at 0.68 of the ITL target, and the pool
    got one decode a look for five looks; on what arrives, three more are still past the target, and the
    look takes four (2P6D: the prefills keep two)."""
    config = replace(URGENT_PACE, itl_target_secs=0.9, queue_target=2, step_cooldown_secs=6)
    idle_prefills = prefill(6, prefill_busy=0.05)
    first_look = obs(idle_prefills, _two_decodes(46, 1000), now=NOW - 6)
    seen = decide(first_look, STARTED, config).state
    growing = obs(idle_prefills, _two_decodes(56, 1017))
    first = decide(growing, seen, config)
    assert first.convert and first.to_role == "decode", first.reason
    assert "decode arrivals 2.43x its completions" in first.reason, first.reason

    def moves_in_the_look(decision) -> int:
        state, moved = decision.state, 1
        while True:
            decision = decide(_moved(growing, "decode", moved), state, config)
            if not decision.convert:
                return moved
            state, moved = decision.state, moved + 1

    assert moves_in_the_look(first) == 4
    # by the step line alone (no earlier look to compare with): one
    blind = decide(growing, STARTED, config)
    assert blind.convert and "arrivals" not in blind.reason and moves_in_the_look(blind) == 1
