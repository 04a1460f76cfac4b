"""The signals the fleet model's backlogs are read from, each able to fail: queues attributed to the pool whose
capacity they wait on (0.5.23's queues, rows published steps ago), refilling an empty pool from the cheapest
undoubted server, and the latency window's sampling of failed and abandoned requests when few finish."""

from __future__ import annotations

from dataclasses import replace

import pytest

from policies.rebalance import (
    FLOOR, NO_CANDIDATE, PENDING, REFILLING, Observation, RebalanceConfig, WorkerView, decide, initial_state,
)
from policies.rebalance_signals import waiting_parts, waits_on_decode, waits_on_prefill
from router.core.records import RequestRecord
from router.core.registry import Registry, Role
from router.flows.latency_window import LatencyWindow

NOW = 1000.0
BASE = RebalanceConfig(warmup_secs=0, failure_cooldown_secs=0, ttft_target_secs=1.0, itl_target_secs=0.05)
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
    assert waits_on_prefill(o) == 24 and waits_on_decode(o) == 0


def test_transfer_queues_count_for_prefill_when_prefills_report_less():
    # the prefills' reports lag (a forward in progress hides its batch): the decode side shows the backlog
    o = obs(prefill(2, waiting_queue=1, inflight=1, forward=9), decode(2, transfer=10))
    assert waits_on_prefill(o) == 2 * 10 - 2 * 1


def test_a_decode_short_of_kv_room_is_decode_hot_though_prefills_count_many_waiting():
    """Decode KV room short: the prefill's bootstrap queue and the decode's prealloc queue hold the same
    requests, waiting on decode. It is decode pressure, counted once."""
    o = obs(prefill(2, bootstrap=10), decode(2, running=7, prealloc_ready=10))
    assert waits_on_prefill(o) == 0 and waits_on_decode(o) == 20


def test_servers_without_the_breakdown_count_their_waiting_for_their_own_pool():
    o = obs((WorkerView("p0", waiting=3),), (WorkerView("d0", waiting=5),))
    assert (waits_on_prefill(o), waits_on_decode(o)) == (3, 5)


# ---- TTFT: where requests clearly wait, never on a tie --------------------------------------------------


# ---- guards do not reset each other ---------------------------------------------------------------------


# ---- rule 1: refill an empty pool -----------------------------------------------------------------------
GUARDED = replace(BASE, warmup_secs=600, failure_cooldown_secs=600)
FRESH = replace(initial_state(NOW - 1), last_conversion_at=NOW - 1, last_direction="to_decode",
                last_failure_at=NOW - 1)


def test_an_empty_prefill_pool_is_refilled_at_once_from_the_cheapest_decode():
    d = (WorkerView("d0", inflight=5, running=5, waiting=0), WorkerView("d1", inflight=1, running=1, waiting=0,
                                                                        used_tokens=900),
         WorkerView("d2", inflight=1, running=1, waiting=0, used_tokens=100))
    decision = decide(obs((), d), FRESH, GUARDED)  # warm-up, failure cooldown, no model yet: none waited for
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


# ---- a decode row 0.5.23 published steps ago --------------------------------------------------------------
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
    parts = waiting_parts(o)
    assert (parts["decode_transfer"], parts["uncounted_transfer"]) == (0, 8)
    # the same rows while the prefill has those legs in a forward: they wait on it
    busy = obs(prefill(1, bootstrap=4, forward=8), stale)
    assert waits_on_prefill(busy) == 8 + 2 * 2 * 4 / 7
    # half of them still held: half the transfers, and half the room they hold, are the prefill's
    half = obs(prefill(1, bootstrap=4, forward=4), stale)
    assert waits_on_prefill(half) == 4 + 2 * 2 * 4 / 7 / 2


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
    # without the ages the smaller count stands (the rule the test above keeps)
    blind = obs(tuple(replace(w, row_age_s=None) for w in p), tuple(replace(w, row_age_s=None) for w in d))
    assert waiting_parts(blind)["pipeline"] == 6 - 2
    # rows within 50 ms of each other are equally current: the smaller count
    close = obs(p, tuple(replace(w, row_age_s=0.03) for w in d))
    assert waiting_parts(close)["pipeline"] == 6 - 2


# ---- the next server beside ours in progress, when those on their way are not enough --------------------


# ---- an urgent prefill queue the prefills were not busy for: a burst ---------------------------------------


# ---- a pool short of capacity: the margin waived ------------------------------------------------------------


# ---- the servers a pool needs, in one look --------------------------------------------------------------
def _moved(o: Observation, role: str, k: int) -> Observation:
    """`o` with k of the donor pool on their way to `role` (out of their pool already), as the loop sees it."""
    donor = "decode" if role == "prefill" else "prefill"
    left = o.pool(donor)[k:]
    return replace(o, **{donor: left}, busy=f"{k} converting to {role}", converting_into=(role,),
                   joining=(role,) * k)


# ---- a decode pool past saturation: what arrives, not the batch it runs -----------------------------------
LINE = dict(decode_step_fixed_s=0.24, decode_step_per_request_s=0.048)


def _two_decodes(batch: int, started: int) -> tuple[WorkerView, ...]:
    return tuple(WorkerView(f"d{i}", running=batch, waiting=0, waiting_queue=0, prealloc=0, prealloc_ready=0,
                            transfer=0, retracted=0, inflight=batch, started=started,
                            decode_step_s=0.24 + 0.048 * batch, **LINE) for i in range(2))


