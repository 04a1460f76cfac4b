"""The rebalancer on a simulated fleet that publishes its load rows as 0.5.23 does (a decode running batches every
15 steps, a prefill after every forward).

1. 1P4D under long prompts: the one prefill is saturated; the fleet model names two decodes in one look (two
   decodes must stay), one of them is SIGKILLed while its switch call is held at the server: its conversion
   fails, the other's succeeds, and no client sees a failure.
2. 1P+2D just after a prefill server moved to decode, under a decode-heavy load: answers of one length, so the
   requests a decode admits together finish together, and the next ones are admitted together (7 per decode: a
   4096-token pool, 512 tokens reserved each). A decode's row, published in the step it admitted them, shows
   them in its transfer queue for the next 14 steps, long after the prefill (short prompts: milliseconds) sent
   their KV. Read as waiting on prefill, the pressure-ratio rules moved a decode server straight back to
   prefill; decode is the bottleneck here, and nothing may move to prefill.
"""

from __future__ import annotations

import asyncio

from bench import replay
from policies.rebalance import RebalanceConfig, RebalanceMode, decide
from router.core.config import LoadMonitorConfig
from router.core.registry import Role
from router.flows.rebalancer import REBALANCER
from simulator.fleet import Fleet

from .helpers import wait_for
from .sim_support import FAST

DECODE_HEAVY = {"text": "hello there", "sampling_params": {"max_new_tokens": 24, "ignore_eos": True}}
LONG_PROMPT = {"text": "word " * 200, "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}}


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


# A decision every 0.25 s, the mix fitted on 3 s: the SLOs are the targets, nothing else tuned.
MODEL = RebalanceConfig(mode=RebalanceMode.ENABLED, interval_secs=0.25, window_secs=3.0,
                        warmup_secs=3.0, ttft_target_secs=1.0, itl_target_secs=1.0, conversion_secs=1.0,
                        min_decode=2)


async def test_two_decodes_go_in_one_look_and_one_killed_on_its_way_loses_no_request(make_router):
    """1P4D under long prompts (one a forward, 0.1 s each; 8 users back to back): the one prefill is saturated
    (the requests that arrive need about one server of forwards, its queue holds the rest), three prefills
    serve them within a second; the model names two decodes in one look (two decodes must stay). Each switch
    call is held at its server, and one of the two servers is SIGKILLed there: its conversion fails, the
    other's succeeds, and no client sees a failure (both were drained before their switch: shed mode re-sent
    what waited on the prefill)."""
    async with Fleet(1, 4, processes=True, prefill_concurrency=1, prefill_overhead_s=0.1, decode_step_s=0.005,
                     max_prefill_tokens=256, **FAST) as fleet:  # one prompt a forward: the rest wait in view
        for handle in fleet.decode:
            await fleet.set_faults(handle, switch_arrival_delay_s=3.0)
        client = await make_router(fleet.prefill, fleet.decode, rebalance=MODEL,
                                   load_monitor=LoadMonitorConfig(interval_secs=0.1))
        rebalancer = client.app[REBALANCER]
        async with Users(client, LONG_PROMPT, 8) as users:
            await wait_for(lambda: len(rebalancer.snapshot()["applying_all"]) == 2, timeout=30,
                           message="two conversions under way")
            moves = [d for d in rebalancer.decisions if d["action"] == "convert"]
            assert len(moves) == 1 and moves[0]["to_role"] == "prefill" and len(moves[0]["workers"]) == 2, \
                [m["reason"] for m in moves]
            model = moves[0]["model"]
            assert model["choice"]["split"] == "3P2D" and model["mix"]["prefill_s"] > 0.05, model
            held = {h.url: h for h in fleet.decode}
            victim, survivor = (held[record["url"]] for record in rebalancer.snapshot()["applying_all"])
            for handle in (victim, survivor):  # both drained, their switch calls held at the servers
                await fleet.wait_for(handle, lambda state: state["switch_calls_arriving"] == 1)
            fleet.kill(victim)
            await wait_for(lambda: rebalancer.applying is None, timeout=30, message="both conversions ended")
            await wait_for(lambda: len(users.answers) >= 40, timeout=60)
        assert rebalancer.counters["conversions_failed"] == 1 and rebalancer.counters["conversions_succeeded"] == 1
        prefills = {w.url for w in client.registry.routable(Role.PREFILL)}
        assert prefills == {fleet.prefill[0].url, survivor.url}
        assert all(m["to_role"] == "prefill" for m in rebalancer.decisions if m["action"] == "convert")
        assert users.answers and set(users.answers) == {200}, sorted(set(users.answers))
        # GET /admin/rebalancer shows each candidate split with its predicted attainment and cost
        snapshot = await (await client.get("/admin/rebalancer")).json()
        shown = next(d for d in snapshot["decisions"] if d["action"] == "convert")
        assert {c["split"] for c in shown["model"]["candidates"]} >= {"1P4D", "2P3D", "3P2D"}
        assert all("value" in c and "cost_s" in c for c in shown["model"]["candidates"])
        # its recording replays offline through the decision core to the same decisions, the failed conversion
        # (the killed server's cooldown) and the one that succeeded (its measured duration) fed back
        recording = await (await client.get("/admin/rebalancer/recording")).json()
        made, again = replay.replay_recording(recording, decide)
        assert len(made) == len(again) == len(recording["observations"]) > 10
        assert [(d["action"], d["reason"], d["workers"]) for d in again] == \
            [(d["action"], d["reason"], d["workers"]) for d in made]
        assert {c["ok"] for c in recording["conversions"]} == {True, False}
        # ... and with another setting it decides otherwise: the recording is an experiment's input
        _, held = replay.replay_recording(recording, decide, min_prefill=1, min_decode=4)
        assert not any(d["action"] == "convert" for d in held)


async def test_a_decode_heavy_load_after_a_move_to_decode_moves_nothing_back_to_prefill(make_router):
    """The wrong-direction flip of the module docstring: the model reads work from the counters, backlogs from
    queues attributed to the pool they wait on, and a decode-bound fleet moves nothing to prefill."""
    async with Fleet(1, 2, processes=True, prefill_concurrency=1, decode_step_s=0.05,
                     decode_overrides={"max_total_tokens": 4096}, **FAST) as fleet:
        config = RebalanceConfig(mode=RebalanceMode.ENABLED, interval_secs=0.25, window_secs=3.0,
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
