"""Losing every prefill (or every decode) server under load, with the rebalancer enabled: the fleet serves again
on its own, well within 30 s, and without a failure once refilled; when the lost servers come back, they rejoin
and the normal rule decides again. The servers are real simulator processes, killed with SIGKILL; the router
runs its defaults (health probes every 5 s, the breaker after 10 failures, the rebalancer's warm-up and its
model's fit), so what refills the pool is the registry change that emptied it, not a tuned interval.
Only the breaker's open time is shortened (3 s, from 30) and the probes are every second, so that the restarted
servers are trusted again within the test's time."""

from __future__ import annotations

import asyncio
import time

import pytest

from policies.rebalance import RebalanceConfig, RebalanceMode
from router.core.config import BreakerConfig, HealthConfig
from router.flows.rebalancer import REBALANCER
from router.core.registry import Role
from simulator.fleet import Fleet

from .helpers import wait_for

SIM = dict(health_check_s=0.0, bootstrap_retries=3, bootstrap_retry_interval_s=0.02, deferred_release_s=0.0,
           decode_step_s=0.005, disconnect_check_s=0.05)
BODY = {"text": "the quick brown fox", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
RECOVERY_BOUND_S = 30.0


class Load:
    """`concurrency` clients sending requests back to back; each answer kept with when it was sent."""

    def __init__(self, client, concurrency: int = 6) -> None:
        self.client, self.concurrency = client, concurrency
        self.answers: list[tuple[float, float, bool, str]] = []  # (sent, ended, ok, why not)
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    async def _user(self, index: int) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            stream = (index + n) % 2 == 0
            sent = time.monotonic()
            try:
                resp = await self.client.post("/generate", json={**BODY, "stream": stream})
                raw = await resp.read()
                ok = resp.status == 200 and (not stream or raw.rstrip().endswith(b"[DONE]")) and b'"error"' not in raw
                why = "" if ok else f"HTTP {resp.status}: {raw[:120]!r}"
            except Exception as exc:  # the client's view: any failure counts
                ok, why = False, repr(exc)
            self.answers.append((sent, time.monotonic(), ok, why))

    def start(self) -> None:
        self._tasks = [asyncio.ensure_future(self._user(i)) for i in range(self.concurrency)]

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)

    def first_success_after(self, t: float) -> float | None:
        return min((ended for sent, ended, ok, _ in self.answers if ok and sent >= t), default=None)

    def failures_sent_after(self, t: float) -> list[str]:
        return [why for sent, _, ok, why in self.answers if not ok and sent >= t]


@pytest.mark.parametrize("lost", ["prefill", "decode"])
async def test_a_pool_lost_under_load_is_refilled_and_serves_without_failures(lost, make_router):
    async with Fleet(2, 3, processes=True, **SIM) as fleet:
        client = await make_router(fleet.prefill, fleet.decode,
                                   rebalance=RebalanceConfig(mode=RebalanceMode.ENABLED),
                                   breaker=BreakerConfig(timeout_secs=3.0), health=HealthConfig(interval_secs=1.0))
        rebalancer = client.app[REBALANCER]
        load = Load(client)
        load.start()
        await wait_for(lambda: sum(ok for *_, ok, _ in load.answers) >= 20, timeout=30)
        victims = fleet.prefill if lost == "prefill" else fleet.decode
        killed_at = time.monotonic()
        for handle in victims:
            fleet.kill(handle)
        await wait_for(lambda: rebalancer.counters["refills_succeeded"] == 1, timeout=RECOVERY_BOUND_S,
                       message="the empty pool refilled")
        refilled_at = time.monotonic()
        await wait_for(lambda: load.first_success_after(refilled_at) is not None, timeout=10)
        await wait_for(lambda: len([a for a in load.answers if a[0] >= refilled_at]) >= 40, timeout=30)
        await load.stop()
        recovered = load.first_success_after(killed_at + 0.5)  # a request sent after the loss, answered
        assert recovered is not None and recovered - killed_at < RECOVERY_BOUND_S
        assert load.failures_sent_after(refilled_at) == []  # once refilled: no failure at all
        survivors = Role.DECODE if lost == "prefill" else Role.PREFILL
        assert len(client.registry.routable(Role(lost))) == 1 and len(client.registry.routable(survivors)) >= 1
        snapshot = rebalancer.snapshot()
        assert snapshot["refill"]["last"]["to_role"] == lost
        assert f"the {lost} pool has no routable server" in snapshot["refill"]["last"]["reason"]
        metrics = await (await client.get("/metrics")).text()
        assert 'pd_router_rebalancer_refills_total{outcome="succeeded"} 1.0' in metrics

        # the lost servers come back on their ports: they rejoin their pool, and the normal rule decides again
        for handle in victims:
            await fleet.restart(handle)
        await wait_for(lambda: len(client.registry.routable(Role(lost))) == 1 + len(victims), timeout=30,
                       message="the restarted servers routable again")
        decided = len(rebalancer.decisions)
        rebalancer.tick()
        assert len(rebalancer.decisions) == decided + 1 and rebalancer.decisions[-1]["refill"] is False


async def test_a_donor_killed_during_its_refill_conversion_is_replaced_by_another(make_router):
    """The refill's donor dies (SIGKILL) while its role switch is on its way: that conversion fails, and the
    refill goes on at once with another donor, which serves."""
    async with Fleet(1, 3, processes=True, **SIM) as fleet:
        client = await make_router(fleet.prefill, fleet.decode,
                                   rebalance=RebalanceConfig(mode=RebalanceMode.ENABLED))
        rebalancer = client.app[REBALANCER]
        for handle in fleet.decode:  # each donor's switch call waits a second before the server sees it
            await fleet.set_faults(handle, switch_arrival_delay_s=1.0)
        fleet.kill(fleet.prefill[0])
        client.registry.set_health(client.registry.workers(Role.PREFILL)[0], False, "probes failing")
        await wait_for(lambda: rebalancer.applying is not None, timeout=10)
        first = rebalancer.applying["url"]
        fleet.kill(next(h for h in fleet.decode if h.url == first))
        await wait_for(lambda: rebalancer.counters["refills_succeeded"] == 1, timeout=RECOVERY_BOUND_S)
        assert rebalancer.counters["refills_failed"] == 1
        (refilled,) = client.registry.routable(Role.PREFILL)
        assert refilled.url != first and refilled.url in fleet.decode_urls
        resp = await client.post("/generate", json=BODY)
        assert resp.status == 200 and (await resp.json())["meta_info"]["finish_reason"]["type"] == "length"
