"""SLO goodput of the rebalancer against every static P/D split of the same servers and an oracle, on one seeded
workload that shifts between prefill-heavy and decode-heavy phases (and on a steady one).

    python -m bench.rebalance_splits                          # 4 servers, shifting, quiet machine (~13 min)
    python -m bench.rebalance_splits --servers 8              # 1P7D ... 7P1D
    python -m bench.rebalance_splits --workload steady        # one mixed phase: the rebalancer must not lose
    python -m bench.rebalance_splits --hog 2                  # the same with two CPU hogs beside it (busy machine)

Variants, all at once on the same machine from the same start (so every ratio is of one run, under the same
load): one static split per kPmD (the rebalancer off), the rebalancer enabled from N/2 P + N/2 D, and an
oracle that knows the workload: it starts where the rebalancer does and, at the start and at each phase
boundary, converts servers (the router's conversion flow, drain mode, in parallel) to the split best for the
next. Best per phase is worked out from the capacity model below (printed, and checked against the static
splits' measured goodput per phase). Each variant has its own simulated fleet (one process) and router
process; one load generator sends every variant the same seeded Poisson schedule.

The simulated servers' capacity model (simulator/capacity.py; the load they report is 0.5.23's): one prefill
forward at a time batching what waited, 5 ms + 0.2 ms per prompt token; a continuously batched decode step of
40 ms + 8 ms per running request. `--time-scale k` makes every simulated duration, router interval and SLO k
times longer and every arrival rate k times lower: the same experiment at k times less CPU per simulated
second, so that what is measured is the policy, not how busy the machine's CPUs are (`--hog` shows it).

A request meets the SLO when it completes with TTFT <= --ttft-slo and TPOT (mean gap between its tokens) <=
--tpot-slo; the goodput is the share that does. Printed: goodput per phase and overall for every variant, the
rebalancer's ratio to the best static split and to the oracle, its conversions and flaps (a conversion undone
within a phase), and for each conversion where its time went: seconds (wall clock) from its phase's start to
the first proposal of its direction, to the decision, to the end, and the conversion's steps (drain, switch,
verify). The JSON result lands under out/bench/, with every decision of the run (guards, each pool's terms).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import random
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp
import orjson

from bench import charts, procs
from bench import rebalance_goodput as rg
from bench.contenders import REPO_ROOT
from bench.simfleet import SimFleet

TARGETS = {"vs_best_static": 1.5, "vs_oracle": 0.85, "steady_vs_best_static": 0.95}
# The capacity model at time scale 1 (seconds): see the module docstring and rebalance_goodput.sim_args.
PREFILL_OVERHEAD, PREFILL_PER_TOKEN, STEP, STEP_PER_RUNNING = 0.005, 0.0002, 0.04, 0.008


@dataclass(frozen=True)
class Kind:
    prompt_words: int
    max_new_tokens: int
    share: float  # of the phase's requests


@dataclass(frozen=True)
class Phase:
    name: str
    secs: float
    rate: float  # requests per second over every kind
    kinds: tuple[Kind, ...]


LONG_PROMPT = Kind(1000, 4, 1.0)  # prefill-heavy: long prompts, short answers
LONG_ANSWER = Kind(20, 16, 1.0)  # decode-heavy


def workload(name: str, servers: int, phase_secs: float, time_scale: float) -> list[Phase]:
    """Rates are for 4 servers at time scale 1, scaled by servers / 4 and divided by the time scale. Shifting:
    11 long prompts/s need 3 prefill servers (2 do 9.8/s), 17 long answers/s need 3 decode servers (2 are past
    saturation): no static split of four serves both. Steady: half of each kind at 12/s, which 2P2D serves
    and neither 3P1D (decode past the TPOT target) nor 1P3D (prefill saturated) does."""
    k = servers / 4 / time_scale
    p = Phase("prefill-heavy", phase_secs, 11.0 * k, (LONG_PROMPT,))
    d = Phase("decode-heavy", phase_secs, 17.0 * k, (LONG_ANSWER,))
    if name == "steady":
        mixed = (Kind(1000, 4, 0.5), Kind(20, 16, 0.5))
        return [Phase("steady mix", phase_secs * 2, 12.0 * k, mixed)]
    return [p, d, p, d]


def schedule(phases: list[Phase], seed: int) -> list[tuple[float, int, int]]:
    """Poisson arrivals: (seconds from the start, phase index, kind index), the same for every variant."""
    rng = random.Random(seed)
    out, start = [], 0.0
    for index, phase in enumerate(phases):
        t = start
        while phase.rate > 0:
            t += rng.expovariate(phase.rate)
            if t >= start + phase.secs:
                break
            pick, kind = rng.random(), 0
            while kind < len(phase.kinds) - 1 and pick > phase.kinds[kind].share:
                pick -= phase.kinds[kind].share
                kind += 1
            out.append((t, index, kind))
        start += phase.secs
    return out


# ---- the capacity model: which split serves a phase best (the oracle's knowledge) -----------------------
def model_score(phase: Phase, prefills: int, decodes: int, time_scale: float, ttft_slo: float,
                tpot_slo: float) -> float:
    """The worst of (prefill wait / TTFT SLO, decode step / TPOT SLO) the model predicts; inf: saturated."""
    k = time_scale
    rate = phase.rate
    forward = sum(kd.share * k * (PREFILL_OVERHEAD + PREFILL_PER_TOKEN * (kd.prompt_words + 3)) for kd in phase.kinds)
    rho = rate * forward / prefills
    steps = sum(kd.share * max(kd.max_new_tokens - 1, 0) for kd in phase.kinds)
    load = rate / decodes * steps * STEP_PER_RUNNING * k
    if rho >= 0.97 or load >= 0.97:
        return float("inf")
    wait = forward + rho * forward / (2 * (1 - rho))  # M/D/1
    batch = rate / decodes * steps * STEP * k / (1 - load)
    itl = (STEP + STEP_PER_RUNNING * batch) * k
    return max(wait / ttft_slo, itl / tpot_slo)


def best_split(phase: Phase, servers: int, args) -> int:
    """The number of prefill servers the model serves the phase best with."""
    scores = {p: model_score(phase, p, servers - p, args.time_scale, args.ttft_slo, args.tpot_slo)
              for p in range(1, servers)}
    return min(scores, key=lambda p: (scores[p], abs(p - servers / 2)))


# ---- routers -------------------------------------------------------------------------------------------
def router_args(args, mode: str) -> list[str]:
    k = args.time_scale
    common = ["--prefill-policy", "power_of_two", "--decode-policy", "power_of_two", "--log-level", "warning",
              "--load-poll-interval-secs", str(0.5 * k), "--load-poll-timeout-secs", str(2 * k)]
    if mode != "enabled":
        return [*common, "--rebalance", "off"]
    # the workload suite's configuration (bench/workload_suite.py): the defaults, the SLOs as the targets
    from bench.workload_suite import live_flags
    return [*common, *live_flags(k, args.ttft_slo, args.tpot_slo)]


@dataclass
class Variant:
    name: str
    prefills: int
    decodes: int
    mode: str  # "static" | "enabled" | "oracle"
    url: str = ""
    outcomes: list | None = None


def start_variant(stack: ExitStack, variant: Variant, args, workdir: Path) -> None:
    fleet = stack.enter_context(SimFleet(workdir / variant.name, prefills=variant.prefills,
                                         decodes=variant.decodes, extra_args=rg.sim_args(args.time_scale),
                                         processes=False))
    port = procs.free_port()
    argv = [sys.executable, "-m", "router", *fleet.mini_lb_args(), "--host", "127.0.0.1", "--port", str(port),
            *router_args(args, variant.mode)]
    router = procs.start(f"router-{variant.name}", argv, workdir / variant.name, cwd=str(REPO_ROOT))
    stack.callback(procs.stop, router)
    variant.url = f"http://127.0.0.1:{port}"
    procs.wait_until(lambda: procs.http_status(variant.url + "/health") == 200, timeout=60,
                     what=f"{variant.name}'s router serving", child=router)
    if variant.mode == "enabled":  # keep every decision of the run: the report explains each conversion
        request = urllib.request.Request(variant.url + "/admin/rebalancer", data=b'{"history": 2000}',
                                         method="PUT", headers={"Content-Type": "application/json"})
        urllib.request.urlopen(request, timeout=10).close()


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


# ---- load and the oracle -------------------------------------------------------------------------------
async def drive(session: aiohttp.ClientSession, variant: Variant, phases: list[Phase],
                plan: list[tuple[float, int, int]], t0: float, drain_timeout: float) -> list[rg.Outcome]:
    tasks = []
    total = sum(p.secs for p in phases)
    for n, (at, index, kind) in enumerate(plan):
        delay = t0 + at - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        k = phases[index].kinds[kind]
        shape = rg.Phase(phases[index].name, phases[index].secs, 0, k.prompt_words, k.max_new_tokens)
        tasks.append(asyncio.ensure_future(rg.one_request(session, variant.url, shape, index, n, t0,
                                                          total - at + drain_timeout)))
    return list(await asyncio.gather(*tasks))


async def oracle(session: aiohttp.ClientSession, variant: Variant, phases: list[Phase], targets: list[int],
                 t0: float) -> list[dict]:
    """At each phase boundary, convert servers (in parallel, drain mode) to the split best for the next."""
    done, start = [], 0.0
    for index, target in enumerate(targets):
        await asyncio.sleep(max(0.0, t0 + start - time.monotonic()))
        done += await convert_to(session, variant.url, target, index)
        start += phases[index].secs
    return done


async def convert_to(session: aiohttp.ClientSession, url: str, prefills: int, phase: int) -> list[dict]:
    async with session.get(url + "/workers") as resp:
        workers = (await resp.json())["workers"]
    now = [w for w in workers if w["worker_type"] == "prefill"]
    if len(now) == prefills:
        return []
    source = "decode" if len(now) < prefills else "prefill"
    movers = sorted((w for w in workers if w["worker_type"] == source), key=lambda w: w.get("load") or 0)
    count = abs(prefills - len(now))
    to_role = "prefill" if source == "decode" else "decode"

    async def one(worker: dict) -> dict:
        started = time.monotonic()
        async with session.post(f"{url}/admin/workers/{worker['id']}/convert",
                                data=orjson.dumps({"new_role": to_role, "mode": "drain"}),
                                headers={"Content-Type": "application/json"}) as resp:
            await resp.read()
        return {"worker": worker["id"], "to_role": to_role, "phase": phase, "status": resp.status,
                "secs": round(time.monotonic() - started, 2)}

    return list(await asyncio.gather(*(one(w) for w in movers[:count])))


async def run_all(variants: list[Variant], phases: list[Phase], targets: list[int], args) -> dict:
    plan = schedule(phases, args.seed)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        t0 = time.monotonic() + 1.0
        jobs = [drive(session, v, phases, plan, t0, args.drain_timeout * args.time_scale) for v in variants]
        oracles = [oracle(session, v, phases, targets, t0) for v in variants if v.mode == "oracle"]
        results = await asyncio.gather(*jobs, *oracles)
    for variant, outcomes in zip(variants, results):
        variant.outcomes = outcomes
    return {"t0": t0, "oracle_conversions": results[len(variants)] if oracles else []}


# ---- one run -------------------------------------------------------------------------------------------
def measure(args) -> dict:
    servers = args.servers
    phases = workload(args.workload, servers, args.phase_secs * args.time_scale, args.time_scale)
    targets = [best_split(p, servers, args) for p in phases]
    half = servers // 2
    variants = [Variant(f"static {p}P{servers - p}D", p, servers - p, "static") for p in range(1, servers)]
    variants.append(Variant("rebalancer", half, servers - half, "enabled"))
    # the oracle starts where the rebalancer does and converts to the first phase's split as it starts (as the
    # workload suite's): the fleet it is given, not a head start no policy has
    variants.append(Variant("oracle", half, servers - half, "oracle"))
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.hog)]
    try:
        with tempfile.TemporaryDirectory(prefix="rebalance-splits-") as tmp, ExitStack() as stack:
            for variant in variants:
                start_variant(stack, variant, args, Path(tmp))
            load_before = procs.load_average()[0]
            started = time.monotonic()
            timing = asyncio.run(run_all(variants, phases, targets, args))
            elapsed = time.monotonic() - started
            load_after = procs.load_average()[0]
            rebalancer = next(v for v in variants if v.mode == "enabled")
            snapshot = _get_json(rebalancer.url + "/admin/rebalancer?limit=2000")
            snapshot["records"] = {c["id"]: c for c in
                                   _get_json(rebalancer.url + "/admin/conversions?limit=100")["conversions"]}
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    return report(variants, phases, targets, timing, snapshot, args,
                  machine={"elapsed_s": round(elapsed, 1), "load_average": [round(load_before, 2),
                                                                            round(load_after, 2)],
                           "cpu_hogs": args.hog})


def replayed(variants: list[Variant], phases: list[Phase], targets: list[int], args) -> dict[str, float]:
    """Every variant's goodput in replay (bench/replay.py: the same capacity model in virtual time, the same
    decision core) on the same seeded arrivals: what the live run is checked against."""
    from bench import replay
    from bench.workload_suite import suite_config_for
    k = args.time_scale
    arrivals = [(t / k, phases[i].kinds[kind].prompt_words + 2, phases[i].kinds[kind].max_new_tokens, i)
                for t, i, kind in schedule(phases, args.seed)]
    bounds, start = [], 0.0
    for p in phases:
        bounds.append((p.name, start / k, (start + p.secs) / k))
        start += p.secs
    ttft, tpot = args.ttft_slo / k, args.tpot_slo / k
    out = {}
    for v in variants:
        extra: dict = {}
        if v.mode == "enabled":
            from policies.rebalance import decide
            extra = dict(config=suite_config_for(ttft, tpot), decide=decide)
        elif v.mode == "oracle":
            extra = dict(schedule=[(b[1], t) for b, t in zip(bounds, targets)])
        run = replay.run(arrivals, bounds, v.prefills, v.decodes, replay.Capacity(), abandon_s=None,
                         drain_s=args.drain_timeout, routing="power_of_two", **extra)
        out[v.name] = round(run.goodput(ttft, tpot), 4)
    return out


def report(variants: list[Variant], phases: list[Phase], targets: list[int], timing: dict, snapshot: dict,
           args, machine: dict) -> dict:
    shapes = [rg.Phase(p.name, p.secs, p.rate, 0, 0) for p in phases]
    results = {v.name: rg.summarize(v.outcomes, shapes, args.ttft_slo, args.tpot_slo) for v in variants}
    statics = [v.name for v in variants if v.mode == "static"]
    best_static = max(statics, key=lambda n: results[n]["overall"]["goodput"] or 0)
    measured_best = [max(statics, key=lambda n, i=i: results[n]["phases"][i]["goodput"] or 0)
                     for i in range(len(phases))]
    bounds = [sum(p.secs for p in phases[:i + 1]) for i in range(len(phases))]
    conversions = []
    for c in snapshot.get("conversions", []):
        at = c["started_at"] - timing["t0"]  # both CLOCK_MONOTONIC (Linux): comparable across processes
        conversions.append({"at_s": round(at, 1), "worker": c["worker_id"], "to_role": c["to_role"],
                            "ok": c.get("ok"), "phase": next((i for i, b in enumerate(bounds) if at < b),
                                                              len(phases) - 1),
                            "secs": round(c["ended_at"] - c["started_at"], 2) if c.get("ended_at") else None,
                            "steps": rg._steps(snapshot.get("records", {}).get(c.get("conversion_id"))),
                            "first_proposed_s": _first_proposed(snapshot, c, timing["t0"]),
                            "reason": c.get("reason"), "signals": _signals_at(snapshot, c["started_at"])})
    good = {name: r["overall"]["goodput"] or 0.0 for name, r in results.items()}
    replay_good = replayed(variants, phases, targets, args)
    return {
        "replay": replay_good,
        "live_minus_replay_points": {n: round((good[n] - replay_good[n]) * 100, 1) for n in good},
        "bench": "rebalance_splits", "at": dt.datetime.now().isoformat(timespec="seconds"),
        "workload": args.workload, "servers": args.servers, "time_scale": args.time_scale, "seed": args.seed,
        "slo": {"ttft_s": args.ttft_slo, "tpot_s": args.tpot_slo}, "machine": machine,
        "phases": [asdict(p) for p in phases],
        "oracle_plan": [f"{t}P{args.servers - t}D" for t in targets],
        "best_static_per_phase_measured": measured_best,
        "results": results, "best_static": best_static,
        "ratio_vs_best_static": round(good["rebalancer"] / good[best_static], 3) if good[best_static] else None,
        "ratio_vs_oracle": round(good["rebalancer"] / good["oracle"], 3) if good["oracle"] else None,
        "conversions": conversions, "flaps": rg.flaps(conversions),
        "oracle_conversions": timing["oracle_conversions"],
        "decisions": [_compact(d, timing["t0"]) for d in snapshot.get("decisions", [])],
        "rebalancer_counters": snapshot.get("counters", {}), "targets": TARGETS,
    }


def _compact(decision: dict, t0: float) -> dict:
    """One decision of the run, small enough to keep them all (the model's mix, its pools' load, its choice)."""
    model = decision.get("model") or {}
    return {"at_s": round(decision["at"] - t0, 1), "action": decision["action"], "guards": decision["guards"],
            "direction": decision.get("direction"), "pools": decision.get("pools"), "mix": model.get("mix"),
            "now": model.get("now"), "choice": model.get("choice")}


def _first_proposed(snapshot: dict, conversion: dict, t0: float) -> float | None:
    """When (s from the start) the rebalancer first proposed this conversion's direction without a break since
    the conversion before it ended: the decision latency is at_s minus this."""
    direction = f"to_{conversion['to_role']}"
    earlier = [c["ended_at"] for c in snapshot.get("conversions", [])
               if c.get("ended_at") and c["ended_at"] <= conversion["started_at"]]
    after = max(earlier) if earlier else float("-inf")
    first = None
    for d in snapshot.get("decisions", []):
        if d["at"] <= after or d["at"] > conversion["started_at"]:
            continue
        if d.get("direction") == direction:
            first = d["at"] if first is None else first
        else:
            first = None  # the proposal broke off (deadband, the other way, no signal)
    return None if first is None else round(first - t0, 1)


def timeline(result: dict) -> list[str]:
    """Per conversion: phase boundary -> first proposal -> decision -> done, and where the conversion's time
    went (its steps). Nothing for a result without conversions (or written before phases carried their length)."""
    if not result["conversions"] or any("secs" not in p for p in result["phases"]):
        return []
    bounds = [0.0]
    for p in result["phases"]:
        bounds.append(bounds[-1] + p["secs"])
    lines = []
    for c in result["conversions"]:
        start = bounds[c["phase"]]
        steps = ", ".join(f"{k} {v}" for k, v in (c.get("steps") or {}).items())
        first = c.get("first_proposed_s")
        lines.append(f"  phase {c['phase'] + 1} +{c['at_s'] - start:6.1f} s: proposed at +"
                     f"{'?' if first is None else f'{first - start:.1f}'} s, decided +{c['at_s'] - start:.1f} s, "
                     f"done +{c['at_s'] - start + (c['secs'] or 0):.1f} s ({steps})")
    return lines


def _signals_at(snapshot: dict, at: float) -> dict | None:
    """What the rebalancer read when it decided the conversion that started at `at` (to explain a flap)."""
    decided = [d for d in snapshot.get("decisions", []) if d["action"] == "convert" and d["at"] <= at]
    return decided[-1].get("model") if decided else None


def render(result: dict) -> str:
    names = list(result["results"])
    phases = [p["name"] for p in result["phases"]]
    width = max(len(n) for n in names) + 2
    lines = [f"{result['servers']} servers, {result['workload']} workload, time scale {result['time_scale']}, "
             f"SLO TTFT <= {result['slo']['ttft_s']} s, TPOT <= {result['slo']['tpot_s']} s; machine: "
             f"{result['machine']}",
             f"oracle plan {result['oracle_plan']}; best static per phase measured "
             f"{result['best_static_per_phase_measured']}",
             f"{'variant':<{width}}" + "".join(f"{p[:18]:>20}" for p in phases) + f"{'overall':>20}"]
    for name in names:
        r = result["results"][name]
        lines.append(f"{name:<{width}}" + "".join(f"{rg._cell(ph):>20}" for ph in r["phases"])
                     + f"{rg._cell(r['overall']):>20}")
    t = result["targets"]
    vs_best, vs_oracle = result["ratio_vs_best_static"], result["ratio_vs_oracle"]
    if result["workload"] == "steady":
        verdict = "meets" if vs_best is not None and vs_best >= t["steady_vs_best_static"] else "misses"
        lines.append(f"rebalancer / best static ({result['best_static']}): {vs_best}x "
                     f"({verdict} >= {t['steady_vs_best_static']}x); / oracle: {vs_oracle}x")
    else:
        ok = vs_best is not None and vs_best >= t["vs_best_static"] and (vs_oracle or 0) >= t["vs_oracle"]
        lines.append(f"rebalancer / best static ({result['best_static']}): {vs_best}x, / oracle: {vs_oracle}x "
                     f"({'meets' if ok else 'misses'} >= {t['vs_best_static']}x and >= {t['vs_oracle']:.0%})")
    if result.get("replay"):
        lines.append("replay of the same arrivals (bench/replay.py): " + ", ".join(
            f"{n} {result['replay'][n] * 100:.1f}% ({result['live_minus_replay_points'][n]:+.1f} live)"
            for n in names))
    lines.append(f"rebalancer conversions: {len(result['conversions'])} ({result['flaps']} flaps)")
    for c in result["conversions"]:
        lines.append(f"  t={c['at_s']:>7}s  {c['worker']} -> {c['to_role']:<8} ok={c['ok']}  took {c['secs']} s"
                     f"  (phase {c['phase'] + 1})")
    lines.extend(timeline(result))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.rebalance_splits", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", type=int, default=4)
    parser.add_argument("--workload", choices=("shifting", "steady"), default="shifting")
    parser.add_argument("--phase-secs", type=float, default=90.0, help="simulated seconds per phase")
    parser.add_argument("--time-scale", type=float, default=2.0,
                        help="simulated durations, intervals and SLOs x k, arrival rates / k")
    parser.add_argument("--ttft-slo", type=float, default=None, help="default: 2 s x time scale")
    parser.add_argument("--tpot-slo", type=float, default=None, help="default: 0.2 s x time scale")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--hog", type=int, default=0, help="CPU-bound processes to run beside it (busy machine)")
    parser.add_argument("--drain-timeout", type=float, default=30.0,
                        help="simulated seconds stragglers may run after the last request was sent")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "out" / "bench")
    parser.add_argument("--chart", type=Path, default=None, help="write the SVG chart here too")
    parser.add_argument("--chart-from", type=Path, default=None, metavar="RESULT.json",
                        help="run nothing: draw the chart of a result written before (with --chart)")
    args = parser.parse_args(argv)
    if args.chart_from is not None:
        if args.chart is None:
            parser.error("--chart-from needs --chart")
        charts.write(args.chart, chart(json.loads(args.chart_from.read_text())))
        return 0
    if args.servers < 2:
        parser.error("--servers must be at least 2")
    args.ttft_slo = args.ttft_slo if args.ttft_slo is not None else 2.0 * args.time_scale
    args.tpot_slo = args.tpot_slo if args.tpot_slo is not None else 0.2 * args.time_scale
    result = measure(args)
    print(render(result))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"rebalance_splits-{args.workload}-{args.servers}-{dt.datetime.now():%Y%m%d-%H%M%S}.json"
    path.write_text(json.dumps(result, indent=2))
    for target in (path.with_suffix(".svg"), args.chart):
        if target is not None:
            charts.write(target, chart(result))
    print(f"\nresult: {path} (chart: {path.with_suffix('.svg')})")
    return 0


def chart(result: dict) -> str:
    """SLO goodput per phase and overall, each variant a bar: the rebalancer against every static split and
    the oracle."""
    names = list(result["results"])
    phases = [p["name"] for p in result["phases"]]
    groups = [f"{i + 1}. {name}" for i, name in enumerate(phases)] + ["overall"]

    def goodput(cell: dict) -> float:
        return (cell.get("goodput") or 0.0) * 100
    series = {n: [goodput(ph) for ph in result["results"][n]["phases"]] + [goodput(result["results"][n]["overall"])]
              for n in names}
    return charts.grouped_bars(f"SLO goodput, {result['servers']} servers, live: every static split, the "
                               f"rebalancer, the oracle", groups, series, y_max=100.0)


if __name__ == "__main__":
    sys.exit(main())
