"""pd-router against mini_lb and sgl-router (sglang-router 0.3.2), same backends, same run.

    python -m bench.routers --setup ceiling --concurrency 16,64,256 --duration 10
    python -m bench.routers --setup sim --concurrency 16,64,256 --duration 8 --stream
    python -m bench.routers --setup ceiling --routers pd-router,sgl-router --variant 'x2=--replicas 2'
    python -m bench.routers --setup ceiling --routers pd-router --variant 'cluster=--etcd-endpoints {etcd}'

ceiling: four nginx servers answer instantly, wrk posts /generate: the router is the bottleneck.
sim: the simulated 2P+2D fleet, the async load generator; --stream adds a streaming pass (with TTFT).
Each router is started on a free port, waited for until it serves, warmed up, loaded at each concurrency
and stopped. A "direct" baseline (no router) is measured on the same backends, so every router's added
latency and every ratio comes from this run. Results: a table on stdout and a JSON file under out/bench/.

A variant (`--variant NAME=ARGS`, repeatable) is pd-router from the same checkout with ARGS added, measured
as one more router and compared with plain pd-router: `--replicas 2` (two processes on one port), or a
replica in a cluster (`{etcd}` in ARGS: the URL of an etcd the benchmark starts for the run).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import orjson

from bench import procs, profile, report, wrk
from bench.ceiling import CeilingFleet
from bench.contenders import (ETCD_PLACEHOLDER, PD_ROUTER_BASE, PEERS_VENV, REPO_ROOT, ROUTER_NAMES, contender,
                              parse_variant, peers_python, with_etcd)
from bench.fleet import Fleet
from bench.simfleet import DEFAULT_TIMING_ARGS, SimFleet
from bench.workload import generate_request

DIRECT = "direct"
# Keep the peers from reaching a model hub for a tokenizer (sgl-router tries when model_path is no local dir).
HUB_GUARD_ENV = {"HF_HUB_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9", "TRANSFORMERS_OFFLINE": "1"}


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _tree_cpu(pids: list[int]) -> float:
    return sum(procs.cpu_seconds(pid) for pid in pids)


class Meter:
    """CPU accounting around one load run: the router's, the backends', the load's and everyone else's."""

    def __init__(self, router_pids: list[int], fleet_pids: list[int]):
        self.router_pids, self.fleet_pids = router_pids, fleet_pids

    def __enter__(self):
        self.load1 = procs.load_average()[0]
        self.t0 = time.monotonic()
        self.machine0 = procs.machine_cpu()[0]
        self.router0 = _tree_cpu(self.router_pids)
        self.fleet0 = _tree_cpu(self.fleet_pids)
        self.load_gen0 = _children_cpu()
        return self

    def __exit__(self, *exc):
        self.seconds = time.monotonic() - self.t0
        self.router_s = _tree_cpu(self.router_pids) - self.router0
        self.fleet_s = _tree_cpu(self.fleet_pids) - self.fleet0
        self.load_gen_s = _children_cpu() - self.load_gen0
        machine_s = procs.machine_cpu()[0] - self.machine0
        self.foreign_s = max(0.0, machine_s - self.router_s - self.fleet_s - self.load_gen_s)

    def fields(self, completed: int) -> dict:
        return {
            "router_cpu_ms_per_req": round(1000 * self.router_s / completed, 4) if completed else None,
            "router_cores": round(self.router_s / self.seconds, 3),
            "backend_cores": round(self.fleet_s / self.seconds, 3),
            "load_gen_cores": round(self.load_gen_s / self.seconds, 3),
            "foreign_cores": round(self.foreign_s / self.seconds, 3),
            "load1_at_start": round(self.load1, 2),
        }


class LoadDriver:
    """Runs one measured load against a URL (or, for the baseline, straight at the backends)."""

    def __init__(self, setup: str, fleet: Fleet, workdir: Path, warmup: float, duration: float):
        self.setup, self.fleet, self.warmup, self.duration = setup, fleet, warmup, duration
        self.wrk_script = wrk.write_script(workdir / "generate.lua") if setup == "ceiling" else None

    def run(self, base_url: str | None, concurrency: int, stream: bool) -> dict:
        if self.setup == "ceiling":
            # The baseline is one instant backend hit directly: one leg, no router.
            url = f"{base_url or self.fleet.decode[0]}/generate"
            if self.warmup > 0:
                wrk.run(url, script=self.wrk_script, connections=concurrency, duration=self.warmup)
            return wrk.run(url, script=self.wrk_script, connections=concurrency, duration=self.duration)
        argv = [sys.executable, "-m", "bench.loadgen", "--concurrency", str(concurrency),
                "--duration", str(self.duration), "--warmup", str(self.warmup)]
        if base_url is not None:
            argv += ["--url", base_url]
        else:
            argv += ["--direct-pd", ",".join(f"{u}={p if p is not None else 'none'}" for u, p in self.fleet.prefill),
                     "--direct-decode", ",".join(self.fleet.decode)]
        if stream:
            argv.append("--stream")
        done = subprocess.run(argv, capture_output=True, text=True, cwd=REPO_ROOT,
                              timeout=self.warmup + self.duration + 120)
        if done.returncode != 0:
            raise RuntimeError(f"load generator failed ({done.returncode}): {done.stderr[-2000:]}")
        return orjson.loads(done.stdout.strip().splitlines()[-1])


def _replicas_serving(base_url: str) -> int:
    """How many processes answer on the port: GET /admin/replica a few times (each a new connection)."""
    seen = set()
    for _ in range(16):
        try:
            with urllib.request.urlopen(f"{base_url}/admin/replica", timeout=5) as response:
                seen.add(orjson.loads(response.read())["index"])
        except (OSError, ValueError, KeyError):
            pass
    return len(seen)


def _serves(base_url: str) -> bool:
    request = urllib.request.Request(f"{base_url}/generate", data=orjson.dumps(generate_request(False)),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status == 200 and bool(response.read())
    except (OSError, ValueError):
        return False


def _modes(setup: str, stream: bool) -> list[bool]:
    if setup == "ceiling":
        return [False]  # nginx answers one fixed body; streaming is measured in the sim setup
    return [False, True] if stream else [False]


def measure_point(name: str, driver: LoadDriver, fleet: Fleet, stream: bool, concurrency: int, round_no: int,
                  base_url: str | None, router_pids: list[int]) -> dict:
    with Meter(router_pids, fleet.pids) as meter:
        result = driver.run(base_url, concurrency, stream)
    completed = result["requests"] - result["errors"]
    row = {"router": name, "mode": "stream" if stream else "non-stream", "concurrency": concurrency,
           "round": round_no, **result, **meter.fields(completed)}
    print(report.progress_line(row), flush=True)
    return row


def profile_router(name: str, driver: LoadDriver, fleet: Fleet, router: "RunningRouter", concurrency: int,
                   collapsed_path: Path) -> dict:
    """One more (unrecorded) load point with py-spy sampling the router: where its CPU time goes."""
    sampler = profile.start(router.pid, driver.warmup + driver.duration, collapsed_path)
    try:
        with Meter([router.pid], fleet.pids) as meter:
            result = driver.run(router.base_url, concurrency, False)
    finally:
        profile.finish(sampler)
    summary = profile.summarize(collapsed_path.read_text())
    summary.update(concurrency=concurrency, collapsed_stacks=str(collapsed_path), rps_while_sampled=result["rps"],
                   **meter.fields(result["requests"] - result["errors"]))
    print(f"# profile of {name} at c={concurrency} ({result['rps']:.0f} req/s while sampled)\n"
          f"{profile.render(summary)}", flush=True)
    return summary


class RunningRouter:
    """A router process on a free port, serving /generate once entered; stopped on exit."""

    def __init__(self, name: str, fleet: Fleet, workdir: Path, *, policy: str | None, start_timeout: float,
                 pd_router_checkout: Path, baseline_checkout: Path | None = None, tag: str = "",
                 variants: dict[str, tuple[str, ...]] | None = None):
        spec = contender(name, pd_router_checkout=pd_router_checkout, baseline_checkout=baseline_checkout,
                         variants=variants)
        self.name, self.spec, self.workdir, self.start_timeout, self.tag = name, spec, workdir, start_timeout, tag
        self.port = procs.free_port()
        self.argv = spec.argv(fleet, self.port, policy)
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.child: procs.Child | None = None

    @property
    def pid(self) -> int:
        return self.child.pid

    def __enter__(self) -> "RunningRouter":
        self.child = procs.start(f"{self.name}{self.tag}", self.argv, self.workdir, cwd=str(self.spec.cwd),
                                 env={**os.environ, **HUB_GUARD_ENV})
        try:
            started = time.monotonic()
            procs.wait_until(lambda: _serves(self.base_url), timeout=self.start_timeout,
                             what=f"{self.name} serving /generate", child=self.child, interval=0.2)
            if self.spec.replicas > 1:
                procs.wait_until(lambda: _replicas_serving(self.base_url) == self.spec.replicas,
                                 timeout=self.start_timeout, what=f"{self.name}'s {self.spec.replicas} replicas serving",
                                 child=self.child, interval=0.2)
        except BaseException:
            procs.stop(self.child)
            raise
        print(f"# {self.name} serving after {time.monotonic() - started:.1f} s: {' '.join(self.argv)}", flush=True)
        return self

    def __exit__(self, *exc) -> None:
        procs.stop(self.child)


def _wait_for_quiet(args, before: str) -> None:
    if args.quiet_wait > 0:
        busy, waited = procs.wait_for_quiet(args.quiet_below, args.quiet_wait)
        print(f"# machine: {busy:.2f} cores busy before {before} (waited {waited:.0f} s for < "
              f"{args.quiet_below:g})", flush=True)


def run_sequential(args, setup: str, fleet: Fleet, driver: LoadDriver, routers: list[str], workdir: Path,
                   out: Path, profiles: dict) -> list[dict]:
    """Each router in turn: start, load at every point, stop (order reversed on even rounds)."""
    points = [(stream, c) for stream in _modes(setup, args.stream) for c in args.concurrency]
    rows = []
    for round_no in range(1, args.rounds + 1):
        rows += [measure_point(DIRECT, driver, fleet, stream, c, round_no, None, []) for stream, c in points]
        for name in (routers if round_no % 2 else list(reversed(routers))):
            _wait_for_quiet(args, name)
            with RunningRouter(name, fleet, workdir, policy=args.policy, start_timeout=args.start_timeout,
                               pd_router_checkout=args.pd_router_checkout, baseline_checkout=args.baseline_checkout,
                               tag=f"-r{round_no}", variants=args.variants) as router:
                rows += [measure_point(name, driver, fleet, stream, c, round_no, router.base_url, [router.pid])
                         for stream, c in points]
                if round_no == 1 and name in args.profile:
                    profiles[name] = profile_router(name, driver, fleet, router, max(args.concurrency),
                                                    out.with_name(f"{out.stem}.{setup}.{name}.collapsed.txt"))
    return rows


def run_interleaved(args, setup: str, fleet: Fleet, driver: LoadDriver, routers: list[str], workdir: Path,
                    out: Path, profiles: dict) -> list[dict]:
    """All routers up at once (idle ones cost nothing); at each point every router is loaded in turn, the
    order rotating, so that a change in the machine's other load falls on all of them alike."""
    points = [(stream, c) for stream in _modes(setup, args.stream) for c in args.concurrency]
    rows = []
    with contextlib.ExitStack() as stack:
        running = {name: stack.enter_context(
            RunningRouter(name, fleet, workdir, policy=args.policy, start_timeout=args.start_timeout,
                          pd_router_checkout=args.pd_router_checkout, baseline_checkout=args.baseline_checkout,
                          variants=args.variants))
            for name in routers}
        targets = [DIRECT, *routers]
        for round_no in range(1, args.rounds + 1):
            for index, (stream, c) in enumerate(points):
                _wait_for_quiet(args, f"c={c}")
                # Each point's order moves on by one each round (a count of turns across points would give one
                # point the same order every round when the points are a multiple of the targets).
                turn = (index + round_no - 1) % len(targets)
                for name in targets[turn:] + targets[:turn]:
                    router = running.get(name)
                    rows.append(measure_point(name, driver, fleet, stream, c, round_no,
                                              router.base_url if router else None, [router.pid] if router else []))
        for name in args.profile:
            if name in running:
                profiles[name] = profile_router(name, driver, fleet, running[name], max(args.concurrency),
                                                out.with_name(f"{out.stem}.{setup}.{name}.collapsed.txt"))
    return rows


def available_routers(requested: list[str], pd_router_checkout: Path) -> tuple[list[str], list[str]]:
    """(routers that can run here, reasons for the ones that cannot)."""
    ok, missing = [], []
    for name in requested:
        if name == "pd-router" and not (pd_router_checkout / "router" / "__main__.py").exists():
            missing.append(f"pd-router: router/__main__.py is not in {pd_router_checkout} yet")
        elif name != "pd-router" and not Path(peers_python()).exists():
            missing.append(f"{name}: {PEERS_VENV} is missing (run `python -m bench.setup`)")
        else:
            ok.append(name)
    return ok, missing


def _command_output(argv: list[str]) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"unavailable ({err})"
    return (done.stdout + done.stderr).strip().splitlines()[0] if (done.stdout + done.stderr).strip() else ""


def _git_rev(checkout: Path) -> str:
    rev = _command_output(["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"])
    dirty = _command_output(["git", "-C", str(checkout), "status", "--porcelain", "--untracked-files=no"])
    return f"{checkout}@{rev}{' (uncommitted changes)' if dirty else ''}"


def environment(pd_router_checkout: Path, sim_checkout: Path) -> dict:
    cpu_model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("model name")), platform.processor())
    return {
        "cores": os.cpu_count(),
        "cpu": cpu_model,
        "python": platform.python_version(),
        "bench_rev": _git_rev(REPO_ROOT),
        "pd_router_rev": _git_rev(pd_router_checkout),
        "simulator_rev": _git_rev(sim_checkout),
        "sglang_router": _command_output([peers_python(), "-c",
                                          "import importlib.metadata as m; print(m.version('sglang-router'))"]),
        "nginx": _command_output(["nginx", "-v"]),
        "wrk": _command_output(["wrk", "--version"]),
    }


def run_setup(setup: str, args, routers: list[str], workdir: Path, out: Path) -> dict:
    concurrencies = args.concurrency
    env = {**environment(args.pd_router_checkout, args.sim_checkout), "load_avg_before": procs.load_average()}
    print(f"# setup {setup}: {env['cores']} cores ({env['cpu']}), load average {env['load_avg_before']}, "
          f"routers {', '.join(routers)}, concurrency {concurrencies}, {args.duration:g} s each", flush=True)
    fleet_ctx = (CeilingFleet(workdir / "nginx") if setup == "ceiling"
                 else SimFleet(workdir / "sim", extra_args=args.sim_args.split(), checkout=args.sim_checkout))
    profiles: dict[str, dict] = {}
    with fleet_ctx as fleet:
        driver = LoadDriver(setup, fleet, workdir, args.warmup, args.duration)
        run = run_interleaved if args.interleave else run_sequential
        rows = run(args, setup, fleet, driver, routers, workdir, out, profiles)
    env["load_avg_after"] = procs.load_average()
    best = report.best_rows(rows)
    return {"setup": setup, "environment": env, "policy": args.policy, "interleaved": args.interleave, "duration_s": args.duration,
            "warmup_s": args.warmup, "rows": rows, "best": best,
            "ratios": report.ratios(best, variants=tuple(args.variants)),
            "variants": {name: list(extra) for name, extra in args.variants.items()}, "profiles": profiles}


@contextlib.contextmanager
def run_etcd(variants: dict[str, tuple[str, ...]], workdir: Path):
    """An etcd for the run when a variant's arguments name one ({etcd}); yields its client URL, else None."""
    if not any(ETCD_PLACEHOLDER in arg for extra in variants.values() for arg in extra):
        yield None
        return
    import asyncio

    from router.cluster.etcd_process import EtcdProcess

    etcd = EtcdProcess(workdir / "etcd")
    asyncio.run(etcd.start())
    print(f"# etcd {etcd.binary} on {etcd.client_url}", flush=True)
    try:
        yield etcd.client_url
    finally:
        etcd.close_now()


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setup", default="ceiling", help="ceiling, sim, or both as 'ceiling,sim'")
    parser.add_argument("--routers", default=",".join(ROUTER_NAMES))
    parser.add_argument("--concurrency", type=_int_list, default=[16, 64, 256])
    parser.add_argument("--duration", type=float, default=10.0, help="measured seconds per point")
    parser.add_argument("--warmup", type=float, default=2.0, help="unmeasured seconds before each point")
    parser.add_argument("--stream", action="store_true", help="sim: also measure streaming (TTFT)")
    parser.add_argument("--rounds", type=int, default=1, help="repeat, alternating router order; best kept")
    parser.add_argument("--interleave", action="store_true",
                        help="start every router at once and load them in turn at each point (fairer on a "
                             "machine whose other load changes); default: one router after the other")
    parser.add_argument("--policy", default="random",
                        help="--policy given to every router (mini_lb only does random); 'none' for defaults")
    parser.add_argument("--sim-args", default=" ".join(DEFAULT_TIMING_ARGS),
                        help="worker flags for `python -m simulator.fleet` (timing model; default %(default)s)")
    parser.add_argument("--quiet-below", type=float, default=0.5,
                        help="before each router, wait until other processes keep fewer cores busy than this")
    parser.add_argument("--quiet-wait", type=float, default=0.0,
                        help="...for at most this many seconds (0: do not wait); the run goes on either way")
    parser.add_argument("--start-timeout", type=float, default=60.0)
    parser.add_argument("--profile", default="", help="Python routers to sample with py-spy for one extra "
                        "point at the highest concurrency, e.g. 'pd-router' (the sampling slows them)")
    parser.add_argument("--pd-router-checkout", type=Path, default=REPO_ROOT,
                        help="run pd-router from this checkout (default: this one), e.g. /work/main")
    parser.add_argument("--baseline-checkout", type=Path,
                        help=f"also run pd-router from this checkout as {PD_ROUTER_BASE!r} (before/after a change, "
                             "in one run; ratios of pd-router against it are reported)")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=ARGS",
                        help="also run pd-router with ARGS added, as router NAME (repeatable), e.g. 'x2=--replicas 2'; "
                             f"{ETCD_PLACEHOLDER} in ARGS is the URL of an etcd started for the run")
    parser.add_argument("--sim-checkout", type=Path, default=REPO_ROOT,
                        help="run the simulated fleet from this checkout (default: this one)")
    parser.add_argument("--out", type=Path, help="JSON result file (default out/bench/routers-SETUP-TIME.json)")
    args = parser.parse_args(argv)
    args.policy = None if args.policy in ("", "none", "default") else args.policy
    args.profile = [r for r in args.profile.split(",") if r]
    for name in args.profile:
        if name not in ("pd-router", "mini_lb"):
            parser.error(f"--profile takes Python routers (pd-router, mini_lb), not {name!r}")

    requested = [r for r in args.routers.split(",") if r]
    for name in requested:
        if name not in ROUTER_NAMES:
            parser.error(f"unknown router {name!r}; choose from {', '.join(ROUTER_NAMES)}")
    args.pd_router_checkout = args.pd_router_checkout.resolve()
    args.sim_checkout = args.sim_checkout.resolve()
    routers, missing = available_routers(requested, args.pd_router_checkout)
    if args.baseline_checkout is not None:
        args.baseline_checkout = args.baseline_checkout.resolve()
        if not (args.baseline_checkout / "router" / "__main__.py").exists():
            parser.error(f"--baseline-checkout: no router/__main__.py in {args.baseline_checkout}")
        routers.append(PD_ROUTER_BASE)
    args.variants = {}
    for text in args.variant:
        try:
            name, extra = parse_variant(text)
        except ValueError as exc:
            parser.error(str(exc))
        args.variants[name] = extra
        routers.append(name)
    for reason in missing:
        print(f"# skipped {reason}", flush=True)
    setups = [s for s in args.setup.split(",") if s]
    for setup in setups:
        if setup not in ("ceiling", "sim"):
            parser.error(f"unknown setup {setup!r}")

    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = args.out or REPO_ROOT / "out" / "bench" / f"routers-{'-'.join(setups)}-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-routers-") as tmp, run_etcd(args.variants, Path(tmp)) as endpoints:
        if endpoints is not None:
            args.variants = {name: with_etcd(extra, endpoints) for name, extra in args.variants.items()}
        for setup in setups:
            workdir = Path(tmp) / setup
            workdir.mkdir()
            result = run_setup(setup, args, routers, workdir, out)
            result["skipped"] = missing
            results.append(result)
            print(report.render(result), flush=True)
    out.write_text(json.dumps(results if len(results) > 1 else results[0], indent=2))
    print(f"# results written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
