"""The rebalancer's outer loop with a fake clock: observation from the registry and the servers' counters,
advisory vs enabled, several servers in one look, failures, the latency window, refills."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from policies.rebalance import BUSY, FAILURE_COOLDOWN, RebalanceMode, RebalanceConfig
from router.core.records import RequestRecord
from router.flows.rebalancer import ConversionResult, LatencyWindow, Rebalancer
from router.core.registry import Registry, Role, WorkerState

from .helpers import wait_for
from .rebalance_support import DECODE_HEAVY, PREFILL_HEAVY, STEADY, advance, fleet


class Clock:
    def __init__(self, now: float = 100.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


class FakeConverter:
    """Moves the worker like the conversion flow would, after the test opens the gate."""

    def __init__(self, registry: Registry, ok: bool = True):
        self.registry, self.ok = registry, ok
        self.calls: list[tuple[str, Role, str]] = []
        self.gate = asyncio.Event()

    async def convert(self, worker, to_role, *, reason, mode):
        self.calls.append((worker.id, to_role, reason))
        self.registry.set_state(worker, WorkerState.CONVERTING, "rebalancer")
        await self.gate.wait()
        if not self.ok:
            self.registry.set_state(worker, WorkerState.ACTIVE, "switch refused")
            return ConversionResult(False, "server refused the switch")
        self.registry.move(worker, to_role, 9999 if to_role is Role.PREFILL else None, WorkerState.ACTIVE,
                           "converted")
        return ConversionResult(True, "converted")


CONFIG = RebalanceConfig(warmup_secs=0, failure_cooldown_secs=300, min_samples=3, ttft_target_secs=2.0,
                         itl_target_secs=0.2, conversion_secs=2.0)
ENABLED = replace(CONFIG, mode=RebalanceMode.ENABLED)


def make(registry, config=CONFIG, converter=None) -> tuple[Rebalancer, Clock]:
    clock = Clock()
    return Rebalancer(registry, config, converter=converter, clock=clock), clock


def looked(rebalancer, clock, registry, workload, looks: int = 3, secs: float = 5.0):
    """Up to `looks` ticks, `secs` of `workload` between each: the first conversion, else the last decision."""
    decision = rebalancer.tick()
    for _ in range(looks - 1):
        if decision.convert:
            break
        advance(registry, clock, secs, workload)
        decision = rebalancer.tick()
    return decision


def test_observation_reads_routable_workers_and_the_servers_counters():
    registry = fleet()
    unhealthy = registry.add("http://d9:1", Role.DECODE, None)
    registry.set_health(unhealthy, False)
    rebalancer, clock = make(registry)
    advance(registry, clock, 10, STEADY)
    obs = rebalancer.observe()
    assert len(obs.decode) == 2 and obs.busy is None  # the unhealthy one is not part of the pool
    assert [v.started for v in obs.prefill] == [30, 30] and obs.prefill[0].busy_total_s == pytest.approx(3.0)
    assert obs.decode[0].tokens_total == pytest.approx(240)
    # the requests the router sent each server, counted when routed
    d0 = registry.get(obs.decode[0].id)
    registry.acquire(d0)
    registry.release(d0)
    assert [v.started for v in rebalancer.observe().decode] == [31, 30]


def test_advisory_mode_records_would_convert_and_changes_nothing():
    registry = fleet()
    rebalancer, clock = make(registry)
    first = rebalancer.tick()
    assert first.action == "hold" and first.guards == ("no_signal",)  # one look: nothing to fit yet
    decision = looked(rebalancer, clock, registry, PREFILL_HEAVY, looks=3)
    assert decision.action == "convert" and decision.from_role == "decode", decision.reason
    assert rebalancer.decisions[-1]["applied"] == "advisory" and rebalancer.counters["would_convert"] >= 1
    assert [w.role for w in registry.workers()].count(Role.DECODE) == 2  # nothing moved
    snap = rebalancer.snapshot(limit=2)
    assert snap["mode"] == "advisory" and len(snap["decisions"]) == 2
    assert snap["decisions"][-1]["model"]["choice"]["split"] == "3P1D"


async def test_enabled_mode_converts_through_the_flow_and_charges_its_duration():
    registry = fleet()
    converter = FakeConverter(registry)
    rebalancer, clock = make(registry, ENABLED, converter)
    decision = looked(rebalancer, clock, registry, PREFILL_HEAVY)
    assert decision.convert and rebalancer.decisions[-1]["applied"] == "started"
    await wait_for(lambda: converter.calls)
    worker_id, to_role, reason = converter.calls[0]
    assert to_role is Role.PREFILL and "rebalancer" in reason
    advance(registry, clock, 5, PREFILL_HEAVY)  # still converting: counted as arriving, not moved again
    held = rebalancer.tick()
    assert not held.convert and rebalancer.snapshot()["applying"]["worker_id"] == worker_id
    assert rebalancer.observe().joining == ("prefill",)
    clock.now += 7
    converter.gate.set()
    await wait_for(lambda: rebalancer.applying is None)
    assert registry.get(worker_id).role is Role.PREFILL
    assert rebalancer.counters["conversions_succeeded"] == 1
    (done,) = rebalancer.conversions
    assert done["ok"] is True and done["to_role"] == "prefill"
    # the next move that way is charged what this one took
    assert rebalancer.state.conversion_secs[0] == (pytest.approx(12.0),)
    advance(registry, clock, 5, PREFILL_HEAVY)
    assert rebalancer.tick().model["costs_s"]["to_prefill"] == pytest.approx(12.0)


async def test_a_pool_short_of_several_servers_gets_them_in_one_look():
    """2P6D turned decode-heavy... the other way: 6P2D under 17 long answers a second needs three decodes at
    least (two saturate): one look names every server the best split needs."""
    registry = fleet(prefills=6, decodes=2)
    converter = FakeConverter(registry)
    rebalancer, clock = make(registry, ENABLED, converter)
    decision = looked(rebalancer, clock, registry, DECODE_HEAVY)
    assert decision.convert and decision.to_role == "decode" and len(decision.workers) >= 2, decision.reason
    moved = len(decision.workers)
    await wait_for(lambda: len(converter.calls) == moved)
    assert [d["applied"] for d in rebalancer.decisions if d["action"] == "convert"] == ["started"]
    assert len(rebalancer.snapshot()["applying_all"]) == moved
    converter.gate.set()
    await wait_for(lambda: rebalancer.applying is None)
    assert [w.role for w in registry.workers()].count(Role.DECODE) == 2 + moved


async def test_a_failed_conversion_starts_the_failure_cooldown():
    registry = fleet()
    converter = FakeConverter(registry, ok=False)
    converter.gate.set()
    rebalancer, clock = make(registry, ENABLED, converter)
    assert looked(rebalancer, clock, registry, PREFILL_HEAVY).convert
    await wait_for(lambda: rebalancer.counters["conversions_failed"] == 1)
    advance(registry, clock, 100, PREFILL_HEAVY)
    assert FAILURE_COOLDOWN in rebalancer.tick().guards
    assert rebalancer.conversions[-1]["detail"] == "server refused the switch"


async def test_a_converter_that_raises_does_not_stop_the_rebalancer():
    registry = fleet()

    class Broken:
        async def convert(self, worker, to_role, *, reason, mode):
            raise RuntimeError("flow bug")

    rebalancer, clock = make(registry, ENABLED, Broken())
    assert looked(rebalancer, clock, registry, PREFILL_HEAVY).convert
    await wait_for(lambda: rebalancer.applying is None and rebalancer.conversions)
    assert rebalancer.conversions[-1]["ok"] is False and "flow bug" in rebalancer.conversions[-1]["detail"]


async def test_the_loop_looks_as_it_starts_then_every_interval():
    """The first look is the counters the first interval is measured from: taken as the loop starts, not an
    interval later (the model reads a level an interval sooner)."""
    rebalancer, _ = make(fleet(), replace(ENABLED, interval_secs=3600.0))
    loop = asyncio.ensure_future(rebalancer.run())
    try:
        await wait_for(lambda: len(rebalancer.decisions) == 1, timeout=10, message="a decision as the loop starts")
    finally:
        loop.cancel()
    assert rebalancer.decisions[0]["action"] == "hold"


def test_enabled_without_a_conversion_flow_refuses_visibly():
    registry = fleet()
    rebalancer, clock = make(registry, ENABLED)
    assert looked(rebalancer, clock, registry, PREFILL_HEAVY).convert
    assert rebalancer.decisions[-1]["applied"].startswith("not applied")
    assert rebalancer.counters["conversions_failed"] == 1 and rebalancer.state.last_failure_at is not None


def test_an_operators_conversion_counts_as_busy():
    registry = fleet(prefills=2, decodes=3)
    rebalancer, clock = make(registry)
    rebalancer.tick()
    advance(registry, clock, 5, PREFILL_HEAVY)
    registry.set_state(registry.workers(Role.DECODE)[0], WorkerState.DRAINING, "operator")
    advance(registry, clock, 5, PREFILL_HEAVY)
    decision = rebalancer.tick()
    assert BUSY in decision.guards and "draining" in rebalancer.last_observation["busy"], decision.reason


def test_off_mode_does_nothing_and_reconfigure_validates():
    rebalancer, clock = make(fleet(), replace(CONFIG, mode=RebalanceMode.OFF))
    assert rebalancer.tick() is None and not rebalancer.decisions
    with pytest.raises(ValueError):
        rebalancer.reconfigure({"mode": "sometimes"})
    clock.now += 50
    rebalancer.reconfigure({"mode": "advisory", "warmup_secs": 10})
    assert rebalancer.state.started_at == clock.now  # observing again: warm up again


PAIR = Registry().add("http://d:1", Role.DECODE, None)  # a record that reached a pair names it


def record(ttft=None, itl=None, outcome="success", status=200, e2e=0.0, decode=PAIR) -> RequestRecord:
    return RequestRecord(route="/generate", stream=True, ttft_s=ttft, itl_s=itl, outcome=outcome, status=status,
                         e2e_s=e2e, decode=decode)


def test_latency_window_p90_min_samples_and_expiry():
    clock = Clock(0)
    window = LatencyWindow(10, clock)
    for i in range(1, 11):
        window.observe(record(ttft=i / 10, itl=i / 100))
    window.observe(record())  # a unary request: nothing measured
    window.observe(record(ttft=None, outcome="error", status=503, e2e=0.001, decode=None))  # never reached a pair
    window.observe(record(ttft=None, outcome="error", status=400, e2e=0.001))  # the client's error
    summary = window.summary(clock.now, min_samples=5)
    assert (summary["ttft_s"], summary["itl_s"], summary["samples"]) == (0.9, 0.09, 10)
    assert window.summary(clock.now, min_samples=11)["ttft_s"] is None
    clock.now = 10.5
    window.observe(record(ttft=2.0))
    assert window.summary(clock.now, min_samples=1)["ttft_s"] == 2.0
    assert window.summary(clock.now, min_samples=1)["samples"] == 1


def test_the_window_keeps_the_sizes_the_router_read():
    clock = Clock(0)
    window = LatencyWindow(10, clock)
    sized = record(ttft=0.1)
    sized.prompt_size, sized.answer_size = 400, 16
    window.arrived(sized)  # counted as it arrives, not once it ends
    window.arrived(record(ttft=0.1))  # no sizes read: not part of the mix
    clock.now = 5
    assert window.sizes(clock.now) == (((0.0, 400, 16),), ())
    window.observe(sized)
    window.observe(record(ttft=0.1))
    assert window.sizes(clock.now) == (((0.0, 400, 16),), ((400, 16),))
    clock.now = 30
    assert window.sizes(clock.now) == ((), ())


# ---- refilling an empty pool: at once, from a registry change, in any mode with its switch -----------------
def lose_prefills(registry: Registry) -> None:
    for worker in registry.workers(Role.PREFILL):
        registry.set_health(worker, False, "probes failing")


async def test_losing_every_prefill_refills_from_decode_at_once_without_a_tick():
    registry = fleet(prefills=2, decodes=3)
    converter = FakeConverter(registry)
    converter.gate.set()
    config = replace(CONFIG, mode=RebalanceMode.ENABLED, warmup_secs=600)
    rebalancer, _ = make(registry, config, converter)
    lose_prefills(registry)  # the registry's 'routable' events, not the interval, start it
    await wait_for(lambda: rebalancer.counters["refills_succeeded"] == 1)
    ((worker_id, to_role, reason),) = converter.calls
    assert to_role is Role.PREFILL and "no routable server" in reason
    assert registry.get(worker_id).role is Role.PREFILL and registry.routable(Role.PREFILL)
    snap = rebalancer.snapshot()
    assert snap["refill"]["enabled"] is True and snap["refill"]["last"]["applied"] == "started"
    assert "refill it at once" in snap["decisions"][-1]["reason"] and snap["decisions"][-1]["refill"] is True


async def test_the_refill_switch_alone_refills_but_changes_no_ratio():
    registry = fleet()
    converter = FakeConverter(registry)
    converter.gate.set()
    config = replace(CONFIG, mode=RebalanceMode.ADVISORY, refill_empty_pool=True)
    rebalancer, clock = make(registry, config, converter)
    # prefill-heavy: the model would convert, and only advises
    assert looked(rebalancer, clock, registry, PREFILL_HEAVY).convert
    assert rebalancer.decisions[-1]["applied"] == "advisory" and not converter.calls
    lose_prefills(registry)
    await wait_for(lambda: converter.calls)
    assert converter.calls[0][1] is Role.PREFILL


async def test_off_with_the_refill_switch_looks_only_at_empty_pools():
    registry = fleet()
    converter = FakeConverter(registry)
    converter.gate.set()
    rebalancer, _ = make(registry, replace(CONFIG, mode=RebalanceMode.OFF, refill_empty_pool=True), converter)
    assert rebalancer.tick() is None and not rebalancer.decisions  # no pool empty: nothing to do, nothing kept
    lose_prefills(registry)
    await wait_for(lambda: converter.calls)
    assert rebalancer.decisions[-1]["refill"] is True


async def test_advisory_without_the_switch_only_records_the_refill():
    registry = fleet(prefills=2, decodes=3)
    converter = FakeConverter(registry)
    rebalancer, _ = make(registry, replace(CONFIG, mode=RebalanceMode.ADVISORY), converter)
    lose_prefills(registry)
    decision = rebalancer.tick()
    assert decision.refill and decision.convert and rebalancer.decisions[-1]["applied"] == "advisory"
    assert rebalancer.counters["would_refill"] == 1 and not converter.calls


async def test_a_failed_refill_is_tried_again_on_another_server():
    registry = fleet(prefills=2, decodes=3)
    converter = FakeConverter(registry, ok=False)
    converter.gate.set()
    rebalancer, _ = make(registry, replace(CONFIG, mode=RebalanceMode.ENABLED), converter)
    lose_prefills(registry)
    await wait_for(lambda: len(converter.calls) >= 3)
    assert len({worker_id for worker_id, _, _ in converter.calls[:3]}) == 3  # each donor once
    await wait_for(lambda: rebalancer.applying is None)
    assert rebalancer.tick().guards == ("no_candidate",)  # every donor failed lately: none is tried again now


async def test_a_follower_replica_does_not_refill():
    registry = fleet(prefills=2, decodes=3)
    converter = FakeConverter(registry)
    rebalancer = Rebalancer(registry, replace(CONFIG, mode=RebalanceMode.ENABLED), converter=converter,
                            clock=Clock(), leading=lambda: False)
    lose_prefills(registry)
    await wait_for(lambda: not rebalancer._refill_pending)  # the refill check the registry's events scheduled ran
    assert rebalancer.refill_now() is None and not converter.calls and not rebalancer.decisions


def test_a_doubted_server_is_not_convertible():
    registry = fleet()
    rebalancer, _ = make(registry)
    worker = registry.workers(Role.DECODE)[0]
    assert rebalancer.can_convert(worker)
    registry.set_health(worker, True, breaker="half_open")
    assert not rebalancer.can_convert(worker)
