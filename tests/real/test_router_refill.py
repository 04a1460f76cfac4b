"""Refilling an empty pool on real servers: the only prefill server is killed (SIGKILL of its process group)
under load, and the router converts a decode server to prefill on its own; the fleet serves again, with
answers token-identical to the reference server's.

The router runs 1P+2D with only `--rebalance-refill-empty-pool` (no ratio changes). The refill starts the
moment the prefill's breaker opens (well under a second here), but a real 0.5.23 decode server whose requests
waited on the dead prefill keeps their KV for its deferred-release timeout (30 s,
SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT) and its role switch waits for that: the donor serves
as prefill some 30 s later. This module runs last in the tier: the killed prefill is not started again (a fleet
attached with PDR_REAL_FLEET is left alone: the test is skipped there).
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from .load import Load
from .real_client import live_role, wait_until
from .rebalancing import expected_outputs, rebalancer_decisions, roles, start_router

SAMPLING = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
PROMPTS = ("Hello world, this is", "The quick brown fox", "Numbers 0 1 2 3 and", "SGLang router routes")
REFILL_STARTS_WITHIN_S = 30.0
SERVES_WITHIN_S = 90.0  # the donor's deferred KV release (30 s) and its switch


def started_refills(router) -> list[dict]:
    return [d for d in rebalancer_decisions(router) if d["refill"] and d.get("applied") == "started"]


def test_the_lone_prefill_killed_under_load_is_replaced_by_a_decode_server(fleet, tmp_path):
    if fleet.attached:
        pytest.skip("kills the fleet's prefill server: not on a fleet attached with PDR_REAL_FLEET")
    expected = expected_outputs(fleet.reference, PROMPTS, SAMPLING)
    router = start_router(fleet, tmp_path / "router.log", "--rebalance", "off", "--rebalance-refill-empty-pool")
    try:
        with Load(router.url, expected, SAMPLING, concurrency=3) as load:
            load.wait_completed(6, timeout=60)
            assert not load.failures(), load.failures()[:3]
            killed_at = time.monotonic()
            os.killpg(fleet.prefill.info.pid, signal.SIGKILL)
            wait_until(lambda: started_refills(router), timeout=REFILL_STARTS_WITHIN_S,
                       what=lambda: f"a refill decision ({roles(router)})")
            # the decision that started it (refill.last may already be a later one: held while it runs)
            refill = started_refills(router)[0]
            donor = next(w["url"] for w in router.workers() if w["id"] == refill["worker_id"])
            assert donor in (fleet.decode.url, fleet.spare.url) and refill["to_role"] == "prefill"
            assert "the prefill pool has no routable server" in refill["reason"]
            wait_until(lambda: live_role(donor) == "prefill" and any(
                w["url"] == donor and w["role"] == "prefill" and w["routable"] for w in router.workers()),
                timeout=SERVES_WITHIN_S, what=lambda: f"{donor} routable as prefill ({roles(router)})")
            refilled_at = time.monotonic()
            load.wait_completed(load.completed() + 9, timeout=60)  # the fleet serves again, through the new prefill
        after = [o for o in load.stop() if o.sent >= refilled_at]
        assert len(after) >= 3 and all(o.status == 200 and o.output_ids == expected[o.prompt] for o in after), after[:3]
        assert refilled_at - killed_at < SERVES_WITHIN_S
    finally:
        router.stop()
