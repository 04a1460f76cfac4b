"""The rebalancer on a simulated fleet that publishes its load rows as 0.5.23 does (a decode running batches every
15 steps, a prefill after every forward): the wrong-direction flip the real tier caught, reproduced.

1P+2D, just after a prefill server moved to decode, under a decode-heavy load: answers of one length, so the
requests a decode admits together finish together, and the next ones are admitted together (7 per decode: a
4096-token pool, 512 tokens reserved each). A decode's row, published in the step it admitted them, shows them
in its transfer queue for the next 14 steps, long after the prefill (short prompts: milliseconds) sent their KV.
Read as waiting on prefill, that is an urgent prefill overload (7 per decode, one prefill): the rebalancer moved
a decode server straight back to prefill. Decode is the bottleneck here; nothing may move to prefill.
"""

from __future__ import annotations

import asyncio

from policies.rebalance import RebalanceConfig, RebalanceMode
from router.core.config import LoadMonitorConfig
from router.flows.rebalancer import REBALANCER
from simulator.fleet import Fleet

from .helpers import wait_for
from .sim_support import FAST

DECODE_HEAVY = {"text": "hello there", "sampling_params": {"max_new_tokens": 24, "ignore_eos": True}}
# A decision every 0.25 s, the default urgent pressure (one sighting), a warm-up past the first burst (every
# user at once: 14 admissions the one prefill serves together).
PACE = RebalanceConfig(mode=RebalanceMode.ENABLED, interval_secs=0.25, warmup_secs=2.0, confirmations=2,
                       urgent_pressure=3.0, cooldown_secs=1.0, step_cooldown_secs=0.5, queue_target=1.0,
                       ttft_target_secs=30.0, itl_target_secs=1.0, min_samples=1)


async def test_a_decode_heavy_load_after_a_move_to_decode_moves_nothing_back_to_prefill(make_router):
    async with Fleet(1, 2, processes=True, prefill_concurrency=1, decode_step_s=0.05,
                     decode_overrides={"max_total_tokens": 4096}, **FAST) as fleet:
        client = await make_router(fleet.prefill, fleet.decode, rebalance=PACE,
                                   load_monitor=LoadMonitorConfig(interval_secs=0.1))
        rebalancer = client.app[REBALANCER]
        answers: list[int] = []
        stop = asyncio.Event()

        async def user() -> None:
            while not stop.is_set():
                resp = await client.post("/generate", json=DECODE_HEAVY)
                await resp.read()
                answers.append(resp.status)

        users = [asyncio.ensure_future(user()) for _ in range(20)]  # 14 in the decodes' room, 6 waiting for it
        try:
            # several rounds of admissions together (each a batch of 24 steps: the rows lag 15 of them)
            await wait_for(lambda: len(answers) >= 100, timeout=60)
        finally:
            stop.set()
            await asyncio.gather(*users)
        assert set(answers) == {200}
        moved_to_prefill = [d for d in rebalancer.decisions if d["action"] == "convert" and d["to_role"] == "prefill"]
        assert not moved_to_prefill, (moved_to_prefill[0]["reason"], moved_to_prefill[0]["pressures"])
        # it did see transfers in rows a batch old (or no prefill held), and read them as nobody's
        uncounted = [d["pressures"]["signals"]["prefill_parts"]["uncounted_transfer"]
                       for d in rebalancer.decisions if "signals" in d["pressures"]]
        assert max(u or 0 for u in uncounted) >= 3, uncounted
