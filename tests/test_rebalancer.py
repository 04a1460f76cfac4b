"""The rebalancer's outer loop with a fake clock: observation from the registry, advisory vs enabled,
one conversion at a time (a second beside it only for an urgent overload), failures, the latency window."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from policies import ServerLoad
from policies.rebalance import BUSY, FAILURE_COOLDOWN, STEP_COOLDOWN, RebalanceMode, RebalanceConfig
from router.core.records import RequestRecord
from router.flows.rebalancer import ConversionResult, LatencyWindow, Rebalancer
from router.core.registry import Registry, Role, WorkerState

from .helpers import wait_for


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


CONFIG = RebalanceConfig(warmup_secs=0, confirmations=2, cooldown_secs=60, failure_cooldown_secs=300,
                         queue_target=4, min_samples=3)


def fleet(prefill_waiting=(8, 8), decode_waiting=(0, 0)) -> Registry:
    registry = Registry()
    for i, waiting in enumerate(prefill_waiting):
        w = registry.add(f"http://p{i}:1", Role.PREFILL, 8998)
        w.server_load = ServerLoad(running=1, waiting=waiting)
    for i, waiting in enumerate(decode_waiting):
        w = registry.add(f"http://d{i}:1", Role.DECODE, None)
        w.server_load = ServerLoad(running=1, waiting=waiting)
    return registry


def make(registry, config=CONFIG, converter=None) -> tuple[Rebalancer, Clock]:
    clock = Clock()
    return Rebalancer(registry, config, converter=converter, clock=clock), clock


def test_observation_reads_routable_workers_and_server_reports():
    registry = fleet()
    unhealthy = registry.add("http://d9:1", Role.DECODE, None)
    registry.set_health(unhealthy, False)
    rebalancer, _ = make(registry)
    obs = rebalancer.observe()
    assert [v.waiting for v in obs.prefill] == [8, 8]
    assert len(obs.decode) == 2 and obs.busy is None  # the unhealthy one is not part of the pool
    # the requests the router sent each server (decode_overload's arrivals), counted when routed
    d0 = registry.get(obs.decode[0].id)
    registry.acquire(d0)
    registry.release(d0)
    assert [v.started for v in rebalancer.observe().decode] == [1, 0]


def test_advisory_mode_records_would_convert_and_changes_nothing():
    registry = fleet()
    rebalancer, clock = make(registry)
    first = rebalancer.tick()
    assert first.action == "hold" and first.guards == ("confirmations",)
    clock.now += 5
    second = rebalancer.tick()
    assert second.action == "convert" and second.from_role == "decode"
    assert rebalancer.decisions[-1]["applied"] == "advisory" and rebalancer.counters["would_convert"] == 1
    assert [w.role for w in registry.workers()].count(Role.DECODE) == 2  # nothing moved
    clock.now += 5  # the virtual conversion starts the cooldown, so advice keeps the real cadence
    # the streak restarted too, but the same way within the cooldown one sighting is enough: only the step
    # cooldown holds it
    assert rebalancer.tick().guards == (STEP_COOLDOWN,)
    snap = rebalancer.snapshot(limit=2)
    assert snap["mode"] == "advisory" and len(snap["decisions"]) == 2
    assert snap["counters"]["decisions_convert"] == 1 and snap["counters"]["guard_step_cooldown"] == 1


async def test_enabled_mode_converts_through_the_flow_one_at_a_time():
    registry = fleet(prefill_waiting=(5, 5))  # one more prefill is enough: the next waits for it
    converter = FakeConverter(registry)
    rebalancer, clock = make(registry, replace(CONFIG, mode=RebalanceMode.ENABLED, confirmations=1), converter)
    decision = rebalancer.tick()
    assert decision.convert and rebalancer.decisions[-1]["applied"] == "started"
    await wait_for(lambda: converter.calls)
    worker_id, to_role, reason = converter.calls[0]
    assert to_role is Role.PREFILL and "rebalancer" in reason
    clock.now += 100  # long past the cooldown, but the conversion is still running
    held = rebalancer.tick()
    assert BUSY in held.guards and rebalancer.snapshot()["applying"]["worker_id"] == worker_id
    converter.gate.set()
    await wait_for(lambda: rebalancer.applying is None)
    assert registry.get(worker_id).role is Role.PREFILL
    assert rebalancer.counters["conversions_succeeded"] == 1
    (done,) = rebalancer.conversions
    assert done["ok"] is True and done["to_role"] == "prefill"
    # the cooldown runs from the end of the conversion (pressure again, on the new split)
    registry.get(worker_id).server_load = ServerLoad(running=1, waiting=8)
    assert STEP_COOLDOWN in rebalancer.tick().guards


async def test_an_urgent_overload_converts_a_second_server_beside_the_first():
    """1P3D with 40 waiting on the prefill: the first decode goes, and while it is still on its way the
    overload left for it (5x) is still urgent: a second one goes beside it; the last decode stays (floor)."""
    registry = fleet(prefill_waiting=(40,), decode_waiting=(0, 0, 0))
    converter = FakeConverter(registry)
    rebalancer, clock = make(registry, replace(CONFIG, mode=RebalanceMode.ENABLED), converter)
    assert rebalancer.tick().convert
    clock.now += 1
    second = rebalancer.tick()
    assert second.convert and rebalancer.decisions[-1]["applied"] == "started", second.reason
    await wait_for(lambda: len(converter.calls) == 2)
    assert len(rebalancer.snapshot()["applying_all"]) == 2 and rebalancer.observe().joining == ("prefill",) * 2
    clock.now += 1
    assert "floor" in rebalancer.tick().guards
    converter.gate.set()
    await wait_for(lambda: rebalancer.applying is None)
    assert [w.role for w in registry.workers()].count(Role.PREFILL) == 3
    assert rebalancer.counters["conversions_succeeded"] == 2 and len(rebalancer.conversions) == 2


@pytest.mark.parametrize("waiting, moved", [(40, 4), (6, 2)])
async def test_a_pool_short_of_several_servers_gets_them_in_one_tick(waiting, moved):
    """2P6D, each prefill with `waiting` queued: one tick converts decodes while the prefills, with those on
    their way, stay over min_pressure and the decodes keep two: 40 each (pressure 10) takes four (6P2D, the
    decodes' two kept), 6 each (1.5) two. Every one is a decision of its own, of the same look."""
    registry = fleet(prefill_waiting=(waiting, waiting), decode_waiting=(0,) * 6)
    converter = FakeConverter(registry)
    rebalancer, _ = make(registry, replace(CONFIG, mode=RebalanceMode.ENABLED, confirmations=1), converter)
    first = rebalancer.tick()
    assert first.convert and first.to_role == "prefill"
    await wait_for(lambda: len(converter.calls) == moved)
    assert [d["action"] for d in rebalancer.decisions] == ["convert"] * moved
    assert {d["at"] for d in rebalancer.decisions} == {first.at}
    assert len(rebalancer.snapshot()["applying_all"]) == moved and len(converter.calls) == moved
    converter.gate.set()
    await wait_for(lambda: rebalancer.applying is None)
    assert [w.role for w in registry.workers()].count(Role.PREFILL) == 2 + moved


def test_advisory_mode_advises_one_server_a_look():
    """Nothing moves in advisory mode, so the same look would advise the same server again: one a look."""
    registry = fleet(prefill_waiting=(40, 40), decode_waiting=(0,) * 6)
    rebalancer, _ = make(registry, replace(CONFIG, confirmations=1))
    assert rebalancer.tick().convert
    assert [d["applied"] for d in rebalancer.decisions] == ["advisory"]


async def test_a_failed_conversion_starts_the_failure_cooldown():
    registry = fleet()
    converter = FakeConverter(registry, ok=False)
    converter.gate.set()
    rebalancer, clock = make(registry, replace(CONFIG, mode=RebalanceMode.ENABLED, confirmations=1), converter)
    assert rebalancer.tick().convert
    await wait_for(lambda: rebalancer.counters["conversions_failed"] == 1)
    clock.now += 100
    assert FAILURE_COOLDOWN in rebalancer.tick().guards
    assert rebalancer.conversions[-1]["detail"] == "server refused the switch"


async def test_a_converter_that_raises_does_not_stop_the_rebalancer():
    registry = fleet()

    class Broken:
        async def convert(self, worker, to_role, *, reason, mode):
            raise RuntimeError("flow bug")

    rebalancer, _ = make(registry, replace(CONFIG, mode=RebalanceMode.ENABLED, confirmations=1), Broken())
    rebalancer.tick()
    await wait_for(lambda: rebalancer.applying is None and rebalancer.conversions)
    assert rebalancer.conversions[-1]["ok"] is False and "flow bug" in rebalancer.conversions[-1]["detail"]


def test_enabled_without_a_conversion_flow_refuses_visibly():
    rebalancer, _ = make(fleet(), replace(CONFIG, mode=RebalanceMode.ENABLED, confirmations=1))
    assert rebalancer.tick().convert
    assert rebalancer.decisions[-1]["applied"].startswith("not applied")
    assert rebalancer.counters["conversions_failed"] == 1 and rebalancer.state.last_failure_at is not None


def test_an_operators_conversion_counts_as_busy():
    registry = fleet()
    registry.set_state(registry.workers(Role.DECODE)[0], WorkerState.DRAINING, "operator")
    registry.add("http://d7:1", Role.DECODE, None).server_load = ServerLoad(0, 0)
    rebalancer, _ = make(registry, replace(CONFIG, confirmations=1))
    decision = rebalancer.tick()
    assert BUSY in decision.guards and "draining" in rebalancer.last_observation["busy"]


def test_off_mode_does_nothing_and_reconfigure_validates():
    rebalancer, clock = make(fleet(), replace(CONFIG, mode=RebalanceMode.OFF))
    assert rebalancer.tick() is None and not rebalancer.decisions
    with pytest.raises(ValueError):
        rebalancer.reconfigure({"mode": "sometimes"})
    clock.now += 50
    rebalancer.reconfigure({"mode": "advisory", "warmup_secs": 10})
    assert rebalancer.state.started_at == clock.now  # observing again: warm up again
    assert rebalancer.tick().guards[0] == "warmup"


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


def test_latency_feeds_the_decision():
    registry = fleet(prefill_waiting=(0, 0), decode_waiting=(0, 0))
    rebalancer, clock = make(registry, replace(CONFIG, confirmations=1, itl_target_secs=0.05))
    for _ in range(5):
        rebalancer.window.observe(record(ttft=0.1, itl=0.2))  # ITL 4x its target: decode is hot
    decision = rebalancer.tick()
    assert decision.convert and decision.to_role == "decode"
    assert rebalancer.last_observation["itl_p90_s"] == 0.2


# ---- refilling an empty pool: at once, from a registry change, in any mode with its switch -----------------
def lose_prefills(registry: Registry) -> None:
    for worker in registry.workers(Role.PREFILL):
        registry.set_health(worker, False, "probes failing")


async def test_losing_every_prefill_refills_from_decode_at_once_without_a_tick():
    registry = fleet(prefill_waiting=(0, 0), decode_waiting=(0, 0, 0))
    converter = FakeConverter(registry)
    converter.gate.set()
    config = replace(CONFIG, mode=RebalanceMode.ENABLED, warmup_secs=600, confirmations=9)
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
    registry = fleet()  # prefill-hot: the ratio rule would convert
    converter = FakeConverter(registry)
    converter.gate.set()
    config = replace(CONFIG, mode=RebalanceMode.ADVISORY, refill_empty_pool=True, confirmations=1)
    rebalancer, clock = make(registry, config, converter)
    assert rebalancer.tick().convert and rebalancer.decisions[-1]["applied"] == "advisory" and not converter.calls
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
    registry = fleet(decode_waiting=(0, 0, 0))
    converter = FakeConverter(registry)
    rebalancer, _ = make(registry, replace(CONFIG, mode=RebalanceMode.ADVISORY), converter)
    lose_prefills(registry)
    decision = rebalancer.tick()
    assert decision.refill and decision.convert and rebalancer.decisions[-1]["applied"] == "advisory"
    assert rebalancer.counters["would_refill"] == 1 and not converter.calls


async def test_a_failed_refill_is_tried_again_on_another_server():
    registry = fleet(decode_waiting=(0, 0, 0))
    converter = FakeConverter(registry, ok=False)
    converter.gate.set()
    rebalancer, _ = make(registry, replace(CONFIG, mode=RebalanceMode.ENABLED), converter)
    lose_prefills(registry)
    await wait_for(lambda: len(converter.calls) >= 3)
    assert len({worker_id for worker_id, _, _ in converter.calls[:3]}) == 3  # each donor once
    await wait_for(lambda: rebalancer.applying is None)
    assert rebalancer.tick().guards == ("no_candidate",)  # every donor failed lately: none is tried again now


async def test_a_follower_replica_does_not_refill():
    registry = fleet(decode_waiting=(0, 0, 0))
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
