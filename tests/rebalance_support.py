"""Registries whose servers' counters say what a workload does: the rebalancer's model reads counters between
looks, so a test advances them (and the clock) as a fleet under that workload would, then ticks."""

from __future__ import annotations

from dataclasses import dataclass

from policies import ServerLoad
from policies.load_report import LoadReport
from router.core.registry import Registry, Role

# a step of 40 ms + 8 ms per running request (the simulator's benchmark fleet)
STEP_FIXED_S, STEP_PER_REQUEST_S = 0.04, 0.008


@dataclass
class Workload:
    rate: float  # requests per second arriving
    prefill_s: float  # forward seconds each
    decode_tokens: float  # tokens decoded each
    waiting_prefill: int = 0  # per prefill server, in its waiting queue


PREFILL_HEAVY = Workload(rate=11.0, prefill_s=0.2056, decode_tokens=3, waiting_prefill=12)  # 2 prefills saturate (rho 1.13)
DECODE_HEAVY = Workload(rate=17.0, prefill_s=0.0096, decode_tokens=15)  # 2 decodes saturate (u 1.02)
STEADY = Workload(rate=6.0, prefill_s=0.1, decode_tokens=8)  # 2P2D serves it


def fleet(prefills: int = 2, decodes: int = 2) -> Registry:
    registry = Registry()
    for i in range(prefills):
        registry.add(f"http://p{i}:1", Role.PREFILL, 8998)
    for i in range(decodes):
        registry.add(f"http://d{i}:1", Role.DECODE, None)
    for worker in registry.workers():
        worker.server_load = _load(worker.role, 0.0, 0.0, 0)
    return registry


def _load(role: Role, busy_s: float, tokens: float, waiting: int) -> ServerLoad:
    if role is Role.PREFILL:
        report = LoadReport(running=0, waiting=waiting, waiting_queue=waiting, bootstrap=0, inflight=0,
                            prefill_busy_us=int(busy_s * 1e6), mode="prefill")
        return ServerLoad(running=0, waiting=waiting, report=report)
    # decode moments (steps, sum batch, sum step us, sum batch^2, sum batch x us, tokens), from a spread of
    # batch sizes on the step line, so that the load monitor's fit would find it
    steps = max(1.0, tokens / 4)
    moments = (steps, tokens, steps * (STEP_FIXED_S + STEP_PER_REQUEST_S * 4) * 1e6, tokens * 20,
               tokens * (STEP_FIXED_S + STEP_PER_REQUEST_S * 5) * 1e6, tokens) if tokens else None
    report = LoadReport(running=0, waiting=0, waiting_queue=0, prealloc=0, prealloc_ready=0, transfer=0,
                        retracted=0, prefill_busy_us=0, decode_moments=moments, mode="decode")
    return ServerLoad(running=0, waiting=0, report=report, decode_step_fixed_s=STEP_FIXED_S,
                      decode_step_per_request_s=STEP_PER_REQUEST_S, decode_step_s=STEP_FIXED_S + 4 * STEP_PER_REQUEST_S)


def advance(registry: Registry, clock, secs: float, workload: Workload) -> None:
    """`secs` of `workload` on the routable servers: every request sent, served and finished (the router's
    counts), forward seconds and decode tokens added to the servers' counters; the clock moved on."""
    prefills, decodes = registry.routable(Role.PREFILL), registry.routable(Role.DECODE)
    arrivals = workload.rate * secs
    for worker in prefills:
        share = round(arrivals / len(prefills))
        worker.requests_total += share
        report = worker.server_load.report if worker.server_load else None
        busy = (report.prefill_busy_us or 0) / 1e6 if report else 0.0
        worker.server_load = _load(Role.PREFILL, busy + share * workload.prefill_s, 0.0, workload.waiting_prefill)
    for worker in decodes:
        share = round(arrivals / len(decodes))
        worker.requests_total += share
        report = worker.server_load.report if worker.server_load else None
        tokens = report.decode_moments[5] if report is not None and report.decode_moments else 0.0
        worker.server_load = _load(Role.DECODE, 0.0, tokens + share * workload.decode_tokens, 0)
    clock.now += secs
