"""The rebalancer on real 0.5.23 servers: a workload that shifts from prefill-heavy to decode-heavy makes it
convert, each time in the right direction, from what the real servers report, while every answer stays
token-identical to the reference server's.

The router runs 1P+2D (prefill P, decode D, spare decode S) with the rebalancer enabled at a test's pace.
1. Prefill-heavy: long prompts (1500 tokens), one token answered. The prefill's forwards are the work; its
   waiting queue and the decodes' transfer queues (KV room taken, waiting for the prefill's KV) grow, and the
   decodes idle: a decode server must move to prefill, in shed mode (its requests that wait on the prefill
   are aborted on both servers and re-sent, not waited for).
2. Decode-heavy: short prompts, long answers, more of them than a decode's KV pool admits (0.5.23 reserves
   512 tokens per request in a 4096-token pool): they wait in the decode's prealloc queue and their prefill
   legs in the prefill's bootstrap queue; a prefill server must move to decode, and nothing back (the
   requests a decode admits together sit in its transfer queue in the row it publishes for 15 steps, long
   after their KV came: no prefill holds them, they wait on nobody).
"""

from __future__ import annotations

from .load import Load
from .real_client import live_role, wait_until
from .rebalancing import (
    convert_decisions, expected_outputs, keep_record, long_prompts, rebalancer_conversions, rebalancer_decisions, roles,
    start_router,
)

PREFILL_HEAVY = {"temperature": 0, "max_new_tokens": 1}
# Long enough that a decode's room stays taken while the others wait, short enough that a request waiting for
# room, then decoding, ends well within the client's deadline on a busy CPU (steps of 0.3-0.6 s seen).
DECODE_HEAVY = {"temperature": 0, "max_new_tokens": 64, "ignore_eos": True}
SHORT_PROMPTS = ("Hello world, this is", "The quick brown fox", "Numbers 0 1 2 3 and", "SGLang router routes")
PHASE_TIMEOUT_S = 120.0


def test_a_shifting_workload_converts_in_the_right_direction_with_identical_answers(fleet, tmp_path):
    long = expected_outputs(fleet.reference, long_prompts(6, 1500), PREFILL_HEAVY)
    short = expected_outputs(fleet.reference, SHORT_PROMPTS, DECODE_HEAVY)
    router = start_router(fleet, tmp_path / "router.log", "--rebalance", "enabled")
    try:
        with Load(router.url, long, PREFILL_HEAVY, concurrency=8) as load:
            wait_until(lambda: any(c["to_role"] == "prefill" and c.get("ok") for c in rebalancer_conversions(router)),
                       timeout=PHASE_TIMEOUT_S, what=lambda: f"a conversion to prefill ({roles(router)})")
            load.wait_completed(load.completed() + 8, timeout=PHASE_TIMEOUT_S)  # served by the new split
        assert not load.failures(), load.failures()[:3]
        first = rebalancer_conversions(router)
        decided = len(convert_decisions(router))
        # never the wrong way
        assert [c["to_role"] for c in first] == ["prefill"] * len(first), convert_decisions(router)
        # a decode moved to prefill re-sends what waits on the prefill (shed), answers identical all the same
        assert [c["mode"] for c in first] == ["shed"] * len(first), first
        moved = next(c for c in first if c["ok"])["url"]
        assert live_role(moved) == "prefill"

        with Load(router.url, short, DECODE_HEAVY, concurrency=12) as load:
            wait_until(lambda: any(c["to_role"] == "decode" and c.get("ok") for c in rebalancer_conversions(router)),
                       timeout=PHASE_TIMEOUT_S, what=lambda: f"a conversion to decode ({roles(router)})")
            load.wait_completed(load.completed() + 12, timeout=PHASE_TIMEOUT_S)
        assert not load.failures(), load.failures()[:3]
        later = rebalancer_conversions(router)[len(first):]
        assert later and [c["to_role"] for c in later] == ["decode"] * len(later), convert_decisions(router, decided)
        assert [c["mode"] for c in later] == ["drain"] * len(later), later
        decisions = [d for d in rebalancer_decisions(router) if d["action"] == "convert"]
        assert all(not d["refill"] for d in decisions)  # the ratio rule, not a refill
    finally:
        keep_record(router, tmp_path / "rebalancer.json")
        router.stop()

