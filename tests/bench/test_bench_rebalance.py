"""The goodput and cache-hit benchmarks' own logic: workload schedules, SLO accounting, flap counting,
rendering; and one short load against a live router on the in-process simulated fleet."""

from __future__ import annotations

import pytest

from bench import cache_aware_hits, rebalance_goodput as rg
from bench.rebalance_goodput import Outcome, Phase


def test_schedule_is_seeded_poisson_within_each_phase():
    phases = [Phase("a", 100, 10, 5, 2), Phase("b", 100, 2, 5, 2), Phase("idle", 50, 0, 5, 2)]
    plan = rg.schedule(phases, seed=3)
    assert plan == rg.schedule(phases, seed=3) and plan != rg.schedule(phases, seed=4)
    counts = [sum(1 for _, i in plan if i == k) for k in range(3)]
    assert 850 < counts[0] < 1150 and 150 < counts[1] < 250 and counts[2] == 0
    assert all(0 <= t < 100 for t, i in plan if i == 0) and all(100 <= t < 200 for t, i in plan if i == 1)
    assert [t for t, _ in plan] == sorted(t for t, _ in plan)


@pytest.mark.parametrize("outcome,good", [
    (Outcome(0, 0, ok=True, ttft=1.0, tpot=0.1, tokens=4), True),
    (Outcome(0, 0, ok=True, ttft=2.5, tpot=0.1, tokens=4), False),  # TTFT over
    (Outcome(0, 0, ok=True, ttft=1.0, tpot=0.3, tokens=4), False),  # TPOT over
    (Outcome(0, 0, ok=True, ttft=1.0, tpot=None, tokens=1), True),  # one token: no TPOT to miss
    (Outcome(0, 0, ok=False, ttft=0.1, tpot=0.1, error="HTTP 503"), False),
])
def test_slo(outcome, good):
    assert rg.meets_slo(outcome, ttft_slo=2.0, tpot_slo=0.2) is good


def test_summarize_per_phase_and_overall():
    phases = [Phase("a", 1, 1, 1, 1), Phase("b", 1, 1, 1, 1)]
    outcomes = [Outcome(0, 0, ok=True, ttft=1, tpot=0.1), Outcome(0, 0, ok=True, ttft=9, tpot=0.1),
                Outcome(1, 1, ok=True, ttft=1, tpot=0.1), Outcome(1, 1, ok=False, error="x")]
    s = rg.summarize(outcomes, phases, 2.0, 0.2)
    assert s["overall"]["goodput"] == 0.5 and s["overall"]["errors"] == 1
    assert [p["goodput"] for p in s["phases"]] == [0.5, 0.5]
    assert s["phases"][0]["ttft_p90_s"] == 9


def test_flaps_count_conversions_undone_within_a_phase():
    c = lambda phase, role: {"phase": phase, "to_role": role}  # noqa: E731
    assert rg.flaps([c(0, "prefill"), c(1, "decode"), c(1, "decode"), c(2, "prefill")]) == 0
    assert rg.flaps([c(0, "prefill"), c(0, "decode"), c(0, "prefill")]) == 2


def test_render_reports_the_ratio_and_the_verdict():
    phase = {"phase": "a", "goodput": 0.2, "requests": 10}
    static = {"phases": [phase], "overall": {"goodput": 0.2, "requests": 10}, "advised_conversions": 3}
    better = {"phases": [{**phase, "goodput": 0.8}], "overall": {"goodput": 0.8, "requests": 10},
              "conversions": [{"at_s": 5.0, "worker": "w3", "to_role": "prefill", "ok": True, "secs": 1.0,
                               "phase": 0}], "flaps": 0, "final_pools": {"prefill": 3, "decode": 1}}
    text = rg.render({"slo": {"ttft_s": 2, "tpot_s": 0.2}, "static": static, "rebalancer": better,
                      "goodput_ratio": 4.0, "target_ratio": 1.5})
    assert "4.0x (meets the 1.5x target)" in text and "w3 -> prefill" in text and "0 flaps" in text


def test_cache_workload_is_seeded_and_shares_prefixes():
    prompts = cache_aware_hits.system_prompts(4, 10)
    texts = cache_aware_hits.requests(prompts, 40, seed=1)
    assert texts == cache_aware_hits.requests(prompts, 40, seed=1)
    assert len(set(texts)) == 40 and all(any(t.startswith(p) for p in prompts) for t in texts)


async def test_one_short_shifting_load_against_a_live_router(make_router):
    """drive() against pd-router on the in-process simulated fleet: every request answered and timed."""
    from simulator.fleet import Fleet
    from tests.sim_support import FAST

    phases = [Phase("p", 1.0, 8, 50, 2), Phase("d", 1.0, 8, 5, 6)]
    async with Fleet(1, 1, **FAST) as fleet:
        client = await make_router(fleet.prefill, fleet.decode)
        outcomes = await rg.drive(str(client.make_url("")).rstrip("/"), phases, seed=1, drain_timeout=20)
    assert outcomes and all(o.ok for o in outcomes), [o.error for o in outcomes if not o.ok]
    assert {o.tokens for o in outcomes if o.phase == 1} == {6}
    assert all(o.ttft is not None and o.ttft >= 0 for o in outcomes)
    assert rg.summarize(outcomes, phases, 60, 60)["overall"]["goodput"] == 1.0


# ---- bench.rebalance_splits: every static split, the rebalancer and an oracle --------------------------
def splits_args(**kw):
    import argparse

    return argparse.Namespace(**{"time_scale": 2.0, "ttft_slo": 4.0, "tpot_slo": 0.4, **kw})


def test_split_schedule_is_seeded_and_mixes_kinds_by_share():
    from bench import rebalance_splits as rs

    (steady,) = rs.workload("steady", 4, 100, 1.0)
    plan = rs.schedule([steady], seed=5)
    assert plan == rs.schedule([steady], seed=5) and plan != rs.schedule([steady], seed=6)
    kinds = [k for _, _, k in plan]
    assert 0.4 < kinds.count(0) / len(kinds) < 0.6 and set(kinds) == {0, 1}
    shifting = rs.workload("shifting", 8, 50, 2.0)
    assert [p.name for p in shifting] == ["prefill-heavy", "decode-heavy"] * 2
    assert shifting[0].rate == 11.0 * 2 / 2  # scaled by servers / 4, divided by the time scale


def test_the_oracle_knows_which_split_serves_each_phase():
    from bench import rebalance_splits as rs

    args = splits_args()
    p, d, *_ = rs.workload("shifting", 4, 180, 2.0)
    assert rs.best_split(p, 4, args) == 3 and rs.best_split(d, 4, args) == 1  # 3P1D, then 1P3D
    assert rs.model_score(p, 2, 2, 2.0, 4.0, 0.4) == float("inf")  # two prefills cannot keep up
    (steady,) = rs.workload("steady", 4, 180, 2.0)
    assert rs.best_split(steady, 4, args) == 2
    assert rs.best_split(rs.workload("shifting", 8, 180, 2.0)[1], 8, args) <= 3


def test_splits_render_says_whether_the_targets_are_met():
    from bench import rebalance_splits as rs

    phase = {"phase": "a", "goodput": 0.5, "requests": 10}
    row = lambda g: {"phases": [{**phase, "goodput": g}], "overall": {"goodput": g, "requests": 10}}  # noqa: E731
    result = {"servers": 4, "workload": "shifting", "time_scale": 2.0, "slo": {"ttft_s": 4, "tpot_s": 0.4},
              "machine": {}, "oracle_plan": ["3P1D"], "best_static_per_phase_measured": ["static 3P1D"],
              "phases": [{"name": "a"}], "results": {"static 3P1D": row(0.4), "rebalancer": row(0.8),
                                                     "oracle": row(0.9)},
              "best_static": "static 3P1D", "ratio_vs_best_static": 2.0, "ratio_vs_oracle": 0.889,
              "conversions": [], "flaps": 0, "targets": rs.TARGETS}
    assert "meets >= 1.5x and >= 85%" in rs.render(result)
    assert "misses" in rs.render({**result, "ratio_vs_oracle": 0.8})
