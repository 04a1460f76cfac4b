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
from router.core.registry import Role
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


class Users:
    """`count` clients posting `body` back to back while the block runs; `answers` holds each status."""

    def __init__(self, client, body: dict, count: int) -> None:
        self.client, self.body, self.count = client, body, count
        self.answers: list[int] = []
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Future] = []

    async def _user(self) -> None:
        while not self._stop.is_set():
            resp = await self.client.post("/generate", json=self.body)
            await resp.read()
            self.answers.append(resp.status)

    async def __aenter__(self) -> "Users":
        self._tasks = [asyncio.ensure_future(self._user()) for _ in range(self.count)]
        return self

    async def __aexit__(self, *exc) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)


async def test_a_decode_heavy_load_after_a_move_to_decode_moves_nothing_back_to_prefill(make_router):
    async with Fleet(1, 2, processes=True, prefill_concurrency=1, decode_step_s=0.05,
                     decode_overrides={"max_total_tokens": 4096}, **FAST) as fleet:
        client = await make_router(fleet.prefill, fleet.decode, rebalance=PACE,
                                   load_monitor=LoadMonitorConfig(interval_secs=0.1))
        rebalancer = client.app[REBALANCER]
        async with Users(client, DECODE_HEAVY, 20) as users:  # 14 in the decodes' room, 6 waiting for it
            # several rounds of admissions together (each a batch of 24 steps: the rows lag 15 of them)
            await wait_for(lambda: len(users.answers) >= 100, timeout=60)
        assert set(users.answers) == {200}
        moved_to_prefill = [d for d in rebalancer.decisions if d["action"] == "convert" and d["to_role"] == "prefill"]
        assert not moved_to_prefill, (moved_to_prefill[0]["reason"], moved_to_prefill[0]["pressures"])
        # it did see transfers in rows a batch old (or no prefill held), and read them as nobody's
        uncounted = [d["pressures"]["signals"]["prefill_parts"]["uncounted_transfer"]
                       for d in rebalancer.decisions if "signals" in d["pressures"]]
        assert max(u or 0 for u in uncounted) >= 3, uncounted


LONG_PROMPT = {"text": "word " * 200, "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}}
# A decision every 0.25 s after a warm-up that lets the backlog build (every user at once); a one-prefill
# overload is urgent (queue target 1); two decodes stay (no third move a look later); none after a failure.
ONE_LOOK = RebalanceConfig(mode=RebalanceMode.ENABLED, interval_secs=0.25, warmup_secs=3.0, confirmations=3,
                           urgent_pressure=3.0, cooldown_secs=5.0, step_cooldown_secs=5.0, queue_target=1.0,
                           ttft_target_secs=30.0, itl_target_secs=1.0, min_samples=1, min_decode=2)


async def test_two_decodes_go_in_one_look_and_one_killed_on_its_way_loses_no_request(make_router):
    """1P4D under long prompts (0.1 s a forward, 8 users: 7 waiting on the one prefill): one look converts two
    decodes (four keep two), each switch call held at its server; one of the two is SIGKILLed there. Its
    conversion fails, the other's succeeds, and no client sees a failure (both were drained before their switch:
    shed mode re-sent what waited on the prefill)."""
    async with Fleet(1, 4, processes=True, prefill_concurrency=1, prefill_overhead_s=0.1, decode_step_s=0.005,
                     max_prefill_tokens=256, **FAST) as fleet:  # one prompt a forward: the rest wait in view
        for handle in fleet.decode:
            await fleet.set_faults(handle, switch_arrival_delay_s=3.0)
        client = await make_router(fleet.prefill, fleet.decode, rebalance=ONE_LOOK,
                                   load_monitor=LoadMonitorConfig(interval_secs=0.1))
        rebalancer = client.app[REBALANCER]
        async with Users(client, LONG_PROMPT, 8) as users:
            await wait_for(lambda: len(rebalancer.snapshot()["applying_all"]) == 2, timeout=30,
                           message="two conversions under way")
            moves = [d for d in rebalancer.decisions if d["action"] == "convert"]
            assert [m["to_role"] for m in moves] == ["prefill", "prefill"], [m["reason"] for m in moves]
            assert moves[0]["at"] == moves[1]["at"]  # one look
            held = {h.url: h for h in fleet.decode}
            victim, survivor = (held[record["url"]] for record in rebalancer.snapshot()["applying_all"])
            for handle in (victim, survivor):  # both drained, their switch calls held at the servers
                await fleet.wait_for(handle, lambda state: state["switch_calls_arriving"] == 1)
            fleet.kill(victim)
            await wait_for(lambda: rebalancer.applying is None, timeout=30, message="both conversions ended")
        assert rebalancer.counters["conversions_failed"] == 1 and rebalancer.counters["conversions_succeeded"] == 1
        prefills = {w.url for w in client.registry.routable(Role.PREFILL)}
        assert prefills == {fleet.prefill[0].url, survivor.url}
        assert users.answers and set(users.answers) == {200}, sorted(set(users.answers))


# The model core (policies/rebalance_model.py) on the same fleets: its SLOs are the targets, nothing else tuned.
MODEL = RebalanceConfig(mode=RebalanceMode.ENABLED, core="model", interval_secs=0.25, window_secs=3.0,
                        warmup_secs=3.0, ttft_target_secs=1.0, itl_target_secs=1.0, conversion_secs=1.0,
                        min_decode=2)


async def test_the_model_core_moves_two_decodes_in_one_look_to_an_overloaded_prefill(make_router):
    """1P4D under long prompts (one a forward, 0.1 s each; 8 users back to back): the one prefill is saturated
    (the requests that arrive need ~1 server of forwards, its queue holds the rest), three prefills serve them
    within a second; the model names two decodes in one look (two decodes must stay), and nothing is lost."""
    async with Fleet(1, 4, processes=True, prefill_concurrency=1, prefill_overhead_s=0.1, decode_step_s=0.005,
                     max_prefill_tokens=256, **FAST) as fleet:
        client = await make_router(fleet.prefill, fleet.decode, rebalance=MODEL,
                                   load_monitor=LoadMonitorConfig(interval_secs=0.1))
        rebalancer = client.app[REBALANCER]
        async with Users(client, LONG_PROMPT, 8) as users:
            await wait_for(lambda: rebalancer.counters["conversions_succeeded"] >= 2, timeout=60,
                           message="two conversions done")
            await wait_for(lambda: len(users.answers) >= 40, timeout=60)
        moves = [d for d in rebalancer.decisions if d["action"] == "convert"]
        assert moves and moves[0]["to_role"] == "prefill" and len(moves[0]["workers"]) == 2, \
            [m["reason"] for m in moves]
        model = moves[0]["model"]
        assert model["choice"]["split"] == "3P2D" and model["mix"]["prefill_s"] > 0.05, model
        assert all(m["to_role"] == "prefill" for m in moves)  # never back
        assert {w.url for w in client.registry.routable(Role.DECODE)} and \
            len(client.registry.routable(Role.PREFILL)) == 3
        assert users.answers and set(users.answers) == {200}, sorted(set(users.answers))
        # GET /admin/rebalancer shows each candidate split with its predicted attainment and cost
        snapshot = await (await client.get("/admin/rebalancer")).json()
        shown = next(d for d in snapshot["decisions"] if d["action"] == "convert")
        assert {c["split"] for c in shown["model"]["candidates"]} >= {"1P4D", "2P3D", "3P2D"}
        assert all("value" in c and "cost_s" in c for c in shown["model"]["candidates"])


async def test_the_model_core_moves_nothing_to_prefill_under_a_decode_heavy_load(make_router):
    """The rules core's wrong-direction flip (module docstring), for the model core: it reads work from the
    counters, not the queues the rows show, and a decode-bound fleet moves nothing to prefill."""
    async with Fleet(1, 2, processes=True, prefill_concurrency=1, decode_step_s=0.05,
                     decode_overrides={"max_total_tokens": 4096}, **FAST) as fleet:
        config = RebalanceConfig(mode=RebalanceMode.ENABLED, core="model", interval_secs=0.25, window_secs=3.0,
                                 warmup_secs=2.0, ttft_target_secs=30.0, itl_target_secs=1.0, conversion_secs=1.0)
        client = await make_router(fleet.prefill, fleet.decode, rebalance=config,
                                   load_monitor=LoadMonitorConfig(interval_secs=0.1))
        rebalancer = client.app[REBALANCER]
        async with Users(client, DECODE_HEAVY, 20) as users:
            await wait_for(lambda: len(users.answers) >= 100, timeout=60)
        assert set(users.answers) == {200}
        moved_to_prefill = [d for d in rebalancer.decisions if d["action"] == "convert" and d["to_role"] == "prefill"]
        assert not moved_to_prefill, moved_to_prefill[0]["reason"]
        fitted = [d for d in rebalancer.decisions if (d.get("model") or {}).get("mix")]
        assert fitted, [d["reason"] for d in rebalancer.decisions][-3:]  # it read the fleet, and held
        assert fitted[-1]["model"]["mix"]["decode_tokens"] > 10
