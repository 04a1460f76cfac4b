"""`python -m loadtest SCENARIO`: a simulated fleet, pd-router in front of it, locust headless against the
router while the scenario acts on the fleet; prints a pass/fail summary and exits 0 (pass) or 1 (fail).

    python -m loadtest steady  --duration 30 --users 16
    python -m loadtest convert --duration 40            # P -> D and back through /pd_role_switch
    python -m loadtest weights --duration 40            # two fleet-wide weight updates through the router
    python -m loadtest kill    --duration 40            # SIGKILL a decode server, start it again
    python -m loadtest steady --rate 20 --users 32 --prompt-tokens 512:128 --output-tokens 64:16
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import sys
import tempfile
import time
from pathlib import Path

import orjson

from .load import LoadOptions
from .scenarios import SCENARIOS, RunOptions, run
from .stack import DEFAULT_WORKER_ARGS
from .workload import Lengths, parse_route_weights


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtest", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("scenario", choices=sorted(SCENARIOS),
                   help="; ".join(f"{name}: {cls.help}" for name, cls in sorted(SCENARIOS.items())))
    p.add_argument("--duration", type=float, default=None, help="seconds of load (default: per scenario)")
    p.add_argument("--users", type=int, default=16, help="concurrent locust users (default 16)")
    p.add_argument("--rate", type=float, default=0.0, help="fixed arrival rate, requests/s (default: closed loop)")
    p.add_argument("--prompt-tokens", default="128:32", help="prompt length MEAN[:STD[:LOW:HIGH]] (default 128:32)")
    p.add_argument("--output-tokens", default="32:8", help="answer length MEAN[:STD[:LOW:HIGH]] (default 32:8)")
    p.add_argument("--routes", default="generate,completions,chat", help="routes and weights, e.g. generate=2,chat=1")
    p.add_argument("--stream-fraction", type=float, default=0.5, help="share of streaming requests (default 0.5)")
    p.add_argument("--request-timeout", type=float, default=60.0, help="seconds per request (default 60)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--prefill", type=int, default=None, help="prefill servers (default: per scenario)")
    p.add_argument("--decode", type=int, default=None, help="decode servers (default: per scenario)")
    p.add_argument("--worker-args", default=" ".join(DEFAULT_WORKER_ARGS),
                   help=f"simulator flags for every worker (default: {' '.join(DEFAULT_WORKER_ARGS)!r})")
    p.add_argument("--router-args", default="", help="extra pd-router flags")
    p.add_argument("--faults", default="", help='faults set on every worker once up (POST /_sim/faults), e.g. '
                                                '\'{"error_rate": 0.1, "error_status": 500}\'')
    p.add_argument("--convert-mode", choices=("drain", "abort"), default="drain", help="convert: how to empty the server")
    p.add_argument("--update-mode", choices=("drain", "abort", "abort-retry"), default="drain",
                   help="weights: let in-flight requests finish, abort them (abort_all_requests: clients get "
                        "finish_reason abort), or abort them with retry_aborted (the router re-sends those "
                        "without a token out)")
    p.add_argument("--out", type=Path, default=None, help="run directory (default: a new temporary one)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    scenario_cls = SCENARIOS[args.scenario]
    duration = args.duration if args.duration is not None else scenario_cls.default_duration_s
    problems = []
    for flag, text in (("--prompt-tokens", args.prompt_tokens), ("--output-tokens", args.output_tokens)):
        try:
            Lengths.parse(text)
        except ValueError as exc:
            problems.append(f"{flag}: {exc}")
    try:
        parse_route_weights(args.routes)
    except ValueError as exc:
        problems.append(f"--routes: {exc}")
    faults = {}
    if args.faults:
        try:
            faults = orjson.loads(args.faults)
            if not isinstance(faults, dict):
                raise ValueError("not a JSON object")
        except ValueError as exc:
            problems.append(f"--faults must be a JSON object: {exc}")
    if duration < scenario_cls.min_duration_s:
        problems.append(f"--duration: {args.scenario} needs at least {scenario_cls.min_duration_s:g} s")
    for role, given, needed in (("prefill", args.prefill, scenario_cls.min_prefill),
                                ("decode", args.decode, scenario_cls.min_decode)):
        if given is not None and given < needed:
            problems.append(f"--{role}: {args.scenario} needs at least {needed} {role} server(s)")
    if args.users < 1:
        problems.append("--users must be at least 1")
    if problems:
        for problem in problems:
            print(f"python -m loadtest: error: {problem}", file=sys.stderr)
        return 2
    workdir = args.out or Path(tempfile.mkdtemp(prefix=f"loadtest-{args.scenario}-{time.strftime('%H%M%S')}-"))
    workdir.mkdir(parents=True, exist_ok=True)
    load = LoadOptions(duration_s=duration, users=args.users, rate=args.rate, prompt_tokens=args.prompt_tokens,
                       output_tokens=args.output_tokens, routes=args.routes, stream_fraction=args.stream_fraction,
                       request_timeout_s=args.request_timeout, seed=args.seed)
    options = RunOptions(load=load, workdir=workdir, prefill=args.prefill, decode=args.decode,
                         worker_args=tuple(shlex.split(args.worker_args)),
                         extra_router_args=tuple(shlex.split(args.router_args)), faults=faults)
    scenario = scenario_cls(convert_mode=args.convert_mode, update_mode=args.update_mode)
    try:
        import uvloop  # noqa: PLC0415

        uvloop.install()
    except ImportError:
        pass
    summary = asyncio.run(run(scenario, options))
    print(orjson.dumps(summary.to_dict(), option=orjson.OPT_INDENT_2).decode() if args.json else summary.render())
    return 0 if summary.passed else 1


if __name__ == "__main__":
    sys.exit(main())
