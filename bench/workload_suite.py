"""The autopilot's workload suite: every workload against every static split, an oracle and the rebalancer.

    python -m bench.workload_suite                     # the whole suite in replay (bench/replay.py), 3 seeds, ~a minute
    python -m bench.workload_suite --only drift6 burst4
    python -m bench.workload_suite --held-out          # the workloads no rule was tried on (see `held_out`)

The suite, not any one workload, is the target: phase shifts (4 and 8 servers), a gradual drift (6 servers,
other constants and SLOs, lognormal lengths), heavy-tailed lengths, bursts shorter than a conversion (the
right answer is to hold), steady mixes (one of heavy-tailed lengths that a single split serves), slow
conversions (15 s switches), and a compressed day. Each workload
says whether its mix changes: where it does, the rebalancer should reach `TARGETS["changing"]` of the best
static split and `TARGETS["oracle"]` of the oracle; where it does not, at least `TARGETS["steady"]` of the best
static split. Every run uses the same rebalancer configuration (`suite_config`): the operator's SLOs as its
targets and nothing fitted to a workload.

The oracle knows the phases: from each phase's best static split (measured here), it converts at each phase's
start, in parallel, to that split, starting from the split the rebalancer starts from. Flaps are conversions
undone within a phase.

`held_out()` is a second set, run to see whether what the suite made of the rebalancer holds elsewhere: other
fleet sizes (5, 10), phases shorter than the window's reading allows, 30 s switches, tighter SLOs, a rate that
rises or swings with the mix unchanged, two kinds of requests far apart, and bursts of long prompts at a rate
near the mix's (added in the eighth session, where it was found failing). No rule is tried on it; a defect
it shows is fixed on the suite's terms (tails6 came from it) and it is measured once more at the end.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from bench import charts, replay
from policies import rebalance
from policies.rebalance import RebalanceConfig, RebalanceMode

TARGETS = {"changing": 1.3, "oracle": 0.85, "steady": 0.95}


@dataclass(frozen=True)
class Lengths:
    """A length distribution: its mean and, for a lognormal, the sigma of its log (0: always the mean)."""

    mean: float
    sigma: float = 0.0

    def draw(self, rng: random.Random) -> int:
        if self.sigma <= 0:
            return max(1, round(self.mean))
        mu = math.log(self.mean) - self.sigma ** 2 / 2
        return max(1, round(rng.lognormvariate(mu, self.sigma)))


@dataclass(frozen=True)
class Kind:
    prompt: Lengths
    answer: Lengths


@dataclass(frozen=True)
class Phase:
    name: str
    secs: float
    rate: Callable[[float], float] | float  # requests/s, or of the time into the phase (0..1)
    mix: Callable[[float], float] | float  # the share of kind A (else kind B), or of the time into the phase
    a: Kind
    b: Kind


@dataclass(frozen=True)
class Workload:
    name: str
    servers: int
    phases: tuple[Phase, ...]
    capacity: replay.Capacity
    ttft_s: float
    tpot_s: float
    changing: bool  # the mix changes (whether a static split serves it anyway is measured: see `verdict`)
    start_prefills: int | None = None  # the split the rebalancer starts from (default: half)


def arrivals(workload: Workload, seed: int) -> tuple[list[replay.Arrival], list[tuple[str, float, float]]]:
    rng = random.Random(seed)
    out, phases, start = [], [], 0.0
    for index, phase in enumerate(workload.phases):
        t = start
        peak = max(phase.rate(x / 50) for x in range(51)) if callable(phase.rate) else phase.rate
        while True:  # thinning: a Poisson process of a varying rate
            t += rng.expovariate(peak)
            if t >= start + phase.secs:
                break
            x = (t - start) / phase.secs
            rate = phase.rate(x) if callable(phase.rate) else phase.rate
            if rng.random() * peak > rate:
                continue
            share = phase.mix(x) if callable(phase.mix) else phase.mix
            kind = phase.a if rng.random() < share else phase.b
            out.append((t, kind.prompt.draw(rng), kind.answer.draw(rng), index))
        phases.append((phase.name, start, start + phase.secs))
        start += phase.secs
    return out, phases


# ---- the suite ----------------------------------------------------------------------------------------
LONG_PROMPT = Kind(Lengths(1000), Lengths(4))  # the live benchmark's kinds (bench/rebalance_splits.py)
LONG_ANSWER = Kind(Lengths(20), Lengths(16))
BASE = replay.Capacity()


def _shift(servers: int, secs: float, switch_s: float = 0.5) -> tuple[Phase, ...]:
    k = servers / 4
    p = Phase("prefill-heavy", secs, 11.0 * k, 1.0, LONG_PROMPT, LONG_ANSWER)
    d = Phase("decode-heavy", secs, 17.0 * k, 0.0, LONG_PROMPT, LONG_ANSWER)
    return (p, d, p, d)


def suite() -> list[Workload]:
    # six servers of other constants (a slower prefill, a cheaper step per request) and other SLOs, lognormal
    # lengths: the unseen workload, built again here
    other = replace(BASE, prefill_per_token_s=0.0003, step_s=0.03, step_per_running_s=0.005)
    chat = Kind(Lengths(600, 0.8), Lengths(24, 0.8))
    reading = Kind(Lengths(2000, 0.6), Lengths(6, 0.6))
    writing = Kind(Lengths(60, 0.8), Lengths(60, 0.7))
    drift = (Phase("mixed", 60, 9.0, 0.5, chat, writing),
             Phase("drift to decode-heavy", 60, 9.0, lambda x: 0.5 * (1 - x), chat, writing),
             Phase("prefill-heavy", 60, 6.0, 1.0, reading, writing),
             Phase("mixed again", 60, 9.0, 0.5, chat, writing))
    heavy = (Phase("prefill-heavy, heavy tails", 90, 9.0, 1.0, Kind(Lengths(900, 1.2), Lengths(4, 1.0)), LONG_ANSWER),
             Phase("decode-heavy, heavy tails", 90, 14.0, 0.0, LONG_PROMPT, Kind(Lengths(20, 1.0), Lengths(16, 1.2))))
    steady_mix = Phase("steady mix", 240, 12.0, 0.5, LONG_PROMPT, LONG_ANSWER)
    # a prefill-heavy burst of a few seconds every 40 s on a steady mix: over before a conversion would help
    burst = Phase("steady mix with bursts", 240, lambda x: 30.0 if (x * 240) % 40 < 3 else 12.0,
                  lambda x: 1.0 if (x * 240) % 40 < 3 else 0.5, LONG_PROMPT, LONG_ANSWER)
    # a day in 6 minutes: traffic rises and falls, the mix goes from chat-like to writing-heavy and back
    day = tuple(Phase(f"day {h:02d}h-{h + 4:02d}h", 60, lambda x, h=h: 8.0 + 8.0 * math.sin(math.pi * (h + 4 * x) / 24),
                      lambda x, h=h: 0.5 + 0.45 * math.cos(math.pi * (h + 4 * x) / 12), chat, writing)
                for h in range(0, 24, 4))
    slow = replace(BASE, switch_s=15.0)
    # a steady mix of summaries (long prompts) and short generations, both heavy-tailed: 2P4D serves it, 1P5D
    # saturates its prefill and 3P3D misses the TPOT target; 16 s of these prompts read their mean within a
    # third either way (held out until the sixth session: the fit read it a third low at a start, and flapped)
    tails = Phase("steady mix, heavy tails", 240, 8.0, 0.4, Kind(Lengths(1500, 0.7), Lengths(30, 0.7)),
                  Kind(Lengths(50, 0.5), Lengths(40, 0.9)))
    return [
        Workload("shift4", 4, _shift(4, 90), BASE, 2.0, 0.2, True),  # the live benchmark's (bench.rebalance_splits)
        Workload("shift8", 8, _shift(8, 120), BASE, 2.0, 0.2, True),
        Workload("shift4-slow", 4, _shift(4, 120), slow, 2.0, 0.2, True),
        Workload("drift6", 6, drift, other, 2.0, 0.125, True),
        Workload("drift6-slow", 6, drift, replace(other, switch_s=15.0), 2.0, 0.125, True),
        Workload("heavy6", 6, heavy, BASE, 2.0, 0.2, True),
        Workload("day8", 8, day, other, 2.0, 0.125, True),
        Workload("steady4", 4, (steady_mix,), BASE, 2.0, 0.2, False),
        Workload("burst4", 4, (burst,), BASE, 2.0, 0.2, False),
        Workload("steady8-slow", 8, (replace(steady_mix, rate=24.0),), slow, 2.0, 0.2, False),
        Workload("tails6", 6, (tails,), BASE, 2.0, 0.15, False),
    ]


def held_out() -> list[Workload]:
    """Workloads the rebalancer is not designed on (see the module docstring)."""
    code = Kind(Lengths(3000, 0.5), Lengths(200, 0.5))
    chat = Kind(Lengths(400, 1.0), Lengths(80, 1.0))
    quick = replace(BASE, prefill_per_token_s=0.0001, step_s=0.02, step_per_running_s=0.002)

    def alternate(count: int, secs: float, prefill_rate: float, decode_rate: float) -> tuple[Phase, ...]:
        return tuple(Phase(f"{'prefill' if i % 2 == 0 else 'decode'}-heavy {i + 1}", secs,
                           prefill_rate if i % 2 == 0 else decode_rate, 1.0 if i % 2 == 0 else 0.0,
                           LONG_PROMPT, LONG_ANSWER) for i in range(count))
    # burst4's bursts at a rate near the mix's: 3 s of 18 long prompts a second every 40 s on 12 a second of the
    # mixed kinds (the count 1.5 times the mix's, the prompt work three times); the right answer is to hold
    near_burst = Phase("steady mix with near-rate bursts", 240, lambda x: 18.0 if (x * 240) % 40 < 3 else 12.0,
                       lambda x: 1.0 if (x * 240) % 40 < 3 else 0.5, LONG_PROMPT, LONG_ANSWER)
    return [
        Workload("ramp10", 10, (Phase("rate rising threefold", 240, lambda x: 8.0 + 24.0 * x, 0.5, LONG_PROMPT,
                                      LONG_ANSWER),), BASE, 2.0, 0.2, False),
        Workload("alternate5", 5, alternate(4, 50, 9.0, 14.0), BASE, 2.0, 0.2, True),
        Workload("quick6", 6, alternate(8, 25, 15.0, 24.0), BASE, 2.0, 0.2, True),
        Workload("code-chat6", 6, (Phase("code", 80, 1.2, 1.0, code, chat), Phase("chat", 80, 14.0, 0.0, code, chat),
                                   Phase("both", 80, 6.0, 0.3, code, chat)), quick, 3.0, 0.1, True),
        Workload("shift8-30s", 8, _shift(8, 150), replace(BASE, switch_s=30.0), 2.0, 0.2, True),
        Workload("tight4", 4, _shift(4, 90), BASE, 0.8, 0.08, True),
        Workload("wave6", 6, (Phase("rate swinging", 240, lambda x: 10.0 + 8.0 * math.sin(4 * math.pi * x), 0.5,
                                    LONG_PROMPT, LONG_ANSWER),), BASE, 2.0, 0.2, False),
        Workload("nearburst4", 4, (near_burst,), BASE, 2.0, 0.2, False),
    ]


def suite_config(workload: Workload, overrides: dict[str, float] | None = None) -> RebalanceConfig:
    """The one configuration every workload runs with (`suite_config_for` its SLOs), with `overrides` (--set:
    a field changed for every workload, to see how far the figures depend on it)."""
    return replace(suite_config_for(workload.ttft_s, workload.tpot_s), **(overrides or {}))


def suite_config_for(ttft_s: float, tpot_s: float) -> RebalanceConfig:
    """The defaults, enabled, the operator's SLOs as the targets, and no warm-up: the `warmup` guard waits out
    real servers' start-up (first compilations, empty caches), which the capacity model and the simulator do not
    have; the model waits for a level of its own (`rebalance_change.unsettled_start`)."""
    return RebalanceConfig(mode=RebalanceMode.ENABLED, warmup_secs=0.0, ttft_target_secs=ttft_s,
                           itl_target_secs=tpot_s)


def live_flags(time_scale: float, ttft_s: float, tpot_s: float) -> list[str]:
    """`suite_config` as a router's flags, its durations `time_scale` times longer (bench/rebalance_splits.py)."""
    k = time_scale
    config = suite_config_for(ttft_s, tpot_s)
    return ["--rebalance", "enabled", "--rebalance-interval-secs", str(config.interval_secs * k),
            "--rebalance-window-secs", str(config.window_secs * k),
            "--rebalance-warmup-secs", str(config.warmup_secs * k),
            "--rebalance-horizon-secs", str(config.horizon_secs * k),
            "--rebalance-conversion-secs", str(config.conversion_secs * k),
            "--rebalance-ttft-target-secs", str(ttft_s), "--rebalance-itl-target-secs", str(tpot_s)]


@dataclass
class Result:
    workload: str
    statics: dict[int, list[float]]  # prefills -> [overall, per phase...]
    oracle: list[float]
    rebalancer: list[float]
    conversions: list[dict]
    flaps: int
    best_static: int

    @property
    def vs_best(self) -> float:
        best = self.statics[self.best_static][0]
        return self.rebalancer[0] / best if best > 0 else float("inf")

    @property
    def vs_oracle(self) -> float:
        return self.rebalancer[0] / self.oracle[0] if self.oracle[0] > 0 else float("inf")


def evaluate(workload: Workload, seed: int = 7, *, overrides: dict[str, float] | None = None,
             oracle_delay: float = 0.0) -> Result:
    """Every static split, the oracle (converting `oracle_delay` after each phase starts: 0 knows the future, a
    delay is what a policy that needs that long to tell a shift from a burst could reach at best) and the
    rebalancer on one draw of the workload's arrivals."""
    plan, phases = arrivals(workload, seed)
    n = workload.servers
    slo = (workload.ttft_s, workload.tpot_s)

    def scores(result: replay.Run) -> list[float]:
        return [result.goodput(*slo)] + [result.goodput(*slo, phase=i) for i in range(len(phases))]
    statics = {p: scores(replay.run(plan, phases, p, n - p, workload.capacity, seed=seed)) for p in range(1, n)}
    best_static = max(statics, key=lambda p: statics[p][0])
    per_phase_best = [oracle_split(workload, plan, phases, i, seed) for i in range(len(phases))]
    # the oracle starts where the rebalancer starts, and converts to the first phase's split at once: the fleet
    # it is given, not a head start no policy has
    start = workload.start_prefills or n // 2
    schedule = [(0.0, per_phase_best[0])] + [(begin + oracle_delay, target) for (name, begin, end), target
                                             in zip(phases[1:], per_phase_best[1:])]
    oracle = scores(replay.run(plan, phases, start, n - start, workload.capacity, schedule=schedule, seed=seed))
    config = suite_config(workload, overrides)
    driven = replay.run(plan, phases, start, n - start, workload.capacity, config=config, decide=rebalance.decide,
                        seed=seed)
    return Result(workload.name, statics, oracle, scores(driven), driven.conversions, driven.flaps(), best_static)


def evaluate_seeds(workload: Workload, seeds: list[int], **options) -> Result:
    """`evaluate` on each seed's arrivals, the goodputs averaged, the conversions and flaps added up: a rule
    that wins on one draw of the arrivals and flaps on the next is not a rule (seed 7 alone once passed a
    level-shift detector that flapped on seeds 8 and 9)."""
    runs = [evaluate(workload, seed, **options) for seed in seeds]

    def mean(rows: list[list[float]]) -> list[float]:
        return [sum(col) / len(col) for col in zip(*rows)]
    statics = {p: mean([r.statics[p] for r in runs]) for p in runs[0].statics}
    return Result(workload.name, statics, mean([r.oracle for r in runs]), mean([r.rebalancer for r in runs]),
                  [c for r in runs for c in r.conversions], sum(r.flaps for r in runs),
                  max(statics, key=lambda p: statics[p][0]))


def oracle_split(workload: Workload, plan: list[replay.Arrival], phases: list[tuple[str, float, float]], index: int,
                 seed: int) -> int:
    """The split that serves phase `index` best on its own (from an idle fleet, its arrivals only)."""
    name, start, end = phases[index]
    alone = [(at - start, prompt, answer, 0) for at, prompt, answer, phase in plan if phase == index]
    n = workload.servers
    scores = {p: replay.run(alone, [(name, 0.0, end - start)], p, n - p, workload.capacity, seed=seed).goodput(
        workload.ttft_s, workload.tpot_s) for p in range(1, n)}
    return max(scores, key=lambda p: (scores[p], -abs(p - n / 2)))


def verdict(workload: Workload, result: Result) -> tuple[bool, str]:
    """Where no static split serves the workload (the oracle is at least 1.3 / 0.85 times the best of them), the
    rebalancer must win: 1.3x the best static split and 0.85x the oracle. Elsewhere (a steady mix, or changes
    within what one split serves) it must not lose: 0.95x the best static split."""
    best = result.statics[result.best_static][0]
    needs_moves = best <= 0 or result.oracle[0] / best >= TARGETS["changing"] / TARGETS["oracle"]
    if needs_moves:
        ok = result.vs_best >= TARGETS["changing"] and result.vs_oracle >= TARGETS["oracle"]
        want = f">= {TARGETS['changing']}x best static and >= {TARGETS['oracle']}x oracle"
    else:
        ok = result.vs_best >= TARGETS["steady"]
        want = f">= {TARGETS['steady']}x best static"
    ok = ok and result.flaps == 0
    return ok, want + ", 0 flaps"


def render(results: list[tuple[Workload, Result]]) -> str:
    lines = ["| workload | servers | best static | oracle | rebalancer | vs best static | vs oracle | conversions "
             "| flaps | target met |", "|---|---|---|---|---|---|---|---|---|---|"]
    for w, r in results:
        ok, want = verdict(w, r)
        best = r.statics[r.best_static][0]
        lines.append(f"| {w.name} | {w.servers} | {r.best_static}P{w.servers - r.best_static}D {best * 100:.1f}% | "
                     f"{r.oracle[0] * 100:.1f}% | {r.rebalancer[0] * 100:.1f}% | {r.vs_best:.2f}x | "
                     f"{r.vs_oracle:.2f}x | {len(r.conversions)} | {r.flaps} | {'yes' if ok else 'no'} ({want}) |")
    return "\n".join(lines)


def chart(results: list[tuple[Workload, Result]]) -> str:
    """The suite as grouped bars: each workload's best static split, the rebalancer and the oracle."""
    return charts.grouped_bars(
        "SLO goodput per workload (replay): best static split, rebalancer, oracle",
        [w.name for w, _ in results],
        {"best static split": [r.statics[r.best_static][0] * 100 for _, r in results],
         "rebalancer": [r.rebalancer[0] * 100 for _, r in results],
         "oracle": [r.oracle[0] * 100 for _, r in results]}, y_max=100.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", help="workload names (default: all)")
    parser.add_argument("--held-out", action="store_true", help="run the held-out set (`held_out`) instead")
    parser.add_argument("--seeds", type=int, nargs="+", default=[7, 8, 9],
                        help="seeds of the arrivals: the figures are their mean, the flaps their sum")
    parser.add_argument("--out", type=Path, default=Path("out/bench"))
    parser.add_argument("--chart", type=Path, default=None,
                        help="write the SVG chart here too (docs/img/workload_suite.svg in the docs)")
    parser.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE",
                        help="change a RebalanceConfig field for every workload (e.g. window_secs=10): how far the "
                             "figures depend on a setting")
    parser.add_argument("--oracle-delay", type=float, default=0.0, metavar="SECS",
                        help="the oracle converts SECS after each phase starts, as a policy that needs SECS to "
                             "tell a shift from a burst at best could (default 0: it knows the future)")
    args = parser.parse_args(argv)
    overrides = {}
    for item in args.set:
        field, _, value = item.partition("=")
        if field not in RebalanceConfig.__dataclass_fields__:
            parser.error(f"--set {item}: {field!r} is not a RebalanceConfig field")
        kind = type(RebalanceConfig.__dataclass_fields__[field].default)
        try:
            overrides[field] = (int if kind is int else float)(value)
        except ValueError:
            parser.error(f"--set {item}: expected FIELD=NUMBER ({field} is {'an integer' if kind is int else 'a number'})")
    chosen = [w for w in (held_out() if args.held_out else suite()) if not args.only or w.name in args.only]
    results = []
    for w in chosen:
        t0 = time.monotonic()
        r = evaluate_seeds(w, args.seeds, overrides=overrides, oracle_delay=args.oracle_delay)
        results.append((w, r))
        print(f"{w.name}: {r.rebalancer[0] * 100:.1f}% vs best static {r.statics[r.best_static][0] * 100:.1f}% "
              f"({r.best_static}P), oracle {r.oracle[0] * 100:.1f}%, {len(r.conversions)} conversions, "
              f"{r.flaps} flaps ({time.monotonic() - t0:.1f} s)", file=sys.stderr)
    print(render(results))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "workload_suite.json"
    path.write_text(json.dumps([{"workload": w.name, "statics": r.statics, "oracle": r.oracle,
                                 "rebalancer": r.rebalancer, "conversions": r.conversions, "flaps": r.flaps,
                                 "verdict": verdict(w, r)[0]} for w, r in results], indent=1, default=str))
    svg = chart(results)
    for target in (args.out / "workload_suite.svg", args.chart):
        if target is not None:
            charts.write(target, svg)
    print(f"result: {path} (chart: {args.out / 'workload_suite.svg'})", file=sys.stderr)
    return 0 if all(verdict(w, r)[0] for w, r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
