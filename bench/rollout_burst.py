"""Rollout bursts through pd-router, sgl-router and SMG, same simulated fleet, same run (issue 35).

    python -m bench.rollout_burst                                   # 1k, 4k, 16k; the machine's limit and soft 1,024
    python -m bench.rollout_burst --bursts 4096 --limits machine --routers pd-router,smg --rounds 3

An RL trainer sends a rollout as one burst: every request at once, each sample counted lost unless answered in
full. For each open-files limit (`machine`: soft = the machine's hard limit; `N`: soft N, hard the machine's),
each burst size and each router (a fresh process per burst, started under that limit with util-linux's prlimit,
the order rotating from one burst to the next): a warm-up request, then the burst from a client process of its
own (one connection per sample, all opened at once, a quarter streamed, 32-token answers), on the simulated
2P+2D fleet (`python -m simulator.fleet`, one process per server). Per run: samples answered in full, errors by
kind, the burst's wall time, the router's CPU seconds (its process tree) and peak RSS (VmHWM). Ratios against
SMG are of the same run. Results: a table on stdout and a JSON file under out/bench/.

Peers come from `.bench-venv` (`python -m bench.setup`): sglang-router 0.3.2 and SMG 1.13.0.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import resource
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import orjson

from bench import procs, profile
from bench.contenders import REPO_ROOT, contender
from bench.fleet import Fleet
from bench.routers import HUB_GUARD_ENV, _serves, environment
from bench.simfleet import DEFAULT_TIMING_ARGS, SimFleet
from harness.processes import process_tree, rss_kib

PROMPT = "The quick brown fox is a classic English pangram. Write one more sentence about the fox and the dog:"
ROUTERS = ("pd-router", "sgl-router", "smg")
BASELINE = "smg"


# ---- the client: one burst, every sample on its own connection -------------------------------------------------
def _outcome(status: int, raw: bytes, stream: bool, tokens: int) -> str | None:
    """None when the sample came back in full; otherwise its error kind."""
    if status != 200:
        return f"http {status}"
    try:
        if stream:
            events = [block[6:] for block in raw.split(b"\n\n") if block.startswith(b"data: ")]
            if not events or events[-1] != b"[DONE]":
                return "stream without [DONE]"
            last = orjson.loads(events[-2])
            if "error" in last:
                return "stream error event"
        else:
            last = orjson.loads(raw)
        meta = last["meta_info"]
    except (ValueError, KeyError, IndexError, TypeError):
        return "unreadable answer"
    if meta.get("finish_reason", {}).get("type") != "length" or meta.get("completion_tokens") != tokens:
        return "incomplete answer"
    return None


async def _sample(session, url: str, body: bytes, stream: bool, tokens: int) -> str | None:
    import aiohttp

    try:
        async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as resp:
            return _outcome(resp.status, await resp.read(), stream, tokens)
    except aiohttp.ClientConnectorError:
        return "connect error"
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError, aiohttp.ClientOSError):
        return "connection cut"
    except asyncio.TimeoutError:
        return "client timeout"


async def burst(url: str, size: int, tokens: int, stream_every: int, timeout: float) -> dict:
    import aiohttp

    bodies = {stream: orjson.dumps({"text": PROMPT, "stream": stream,
                                    "sampling_params": {"max_new_tokens": tokens, "temperature": 0.0}})
              for stream in (False, True)}
    connector = aiohttp.TCPConnector(limit=0, force_close=True)  # one connection per sample, all at once
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        started = time.perf_counter()
        outcomes = await asyncio.gather(*(_sample(session, url + "/generate", bodies[i % stream_every == 0],
                                                  i % stream_every == 0, tokens) for i in range(size)))
        wall = time.perf_counter() - started
    errors: dict[str, int] = {}
    for outcome in outcomes:
        if outcome is not None:
            errors[outcome] = errors.get(outcome, 0) + 1
    return {"burst": size, "answered": size - sum(errors.values()), "errors": errors, "wall_s": round(wall, 3)}


def client_main(args) -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # the client is not what is measured
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    print(json.dumps(asyncio.run(burst(args.url, args.size, args.tokens, args.stream_every, args.timeout))))
    return 0


# ---- the driver -----------------------------------------------------------------------------------------------
def fleet_idle(fleet: Fleet) -> bool:
    """Every simulated server reports nothing running or waiting (what a failed burst left there is gone)."""
    for url in fleet.all_urls():
        try:
            with urllib.request.urlopen(f"{url}/v1/loads", timeout=5) as resp:
                loads = orjson.loads(resp.read())
        except (OSError, ValueError):
            return False
        rows = loads.get("loads", loads) if isinstance(loads, dict) else loads
        for row in rows if isinstance(rows, list) else [rows]:
            if isinstance(row, dict) and (row.get("num_running_reqs") or row.get("num_waiting_reqs")):
                return False
    return True


def pd_router_health(base_url: str, child: procs.Child) -> dict:
    """pd-router's own account of the burst: legs counted against workers, breakers opened (its log), workers
    routable now, and its local resource errors by kind."""
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    failures = routable = 0
    local: dict[str, int] = {}
    for line in text.splitlines():
        if line.startswith("pd_router_worker_failures_total{"):
            failures += int(float(line.rsplit(" ", 1)[1]))
        elif line.startswith("pd_router_worker_routable{"):
            routable += int(float(line.rsplit(" ", 1)[1]))
        elif line.startswith("pd_router_local_resource_errors_total{") and float(line.rsplit(" ", 1)[1]):
            local[line.split('kind="', 1)[1].split('"', 1)[0]] = int(float(line.rsplit(" ", 1)[1]))
    return {"worker_failures": failures, "breakers_opened": child.log().count("circuit breaker closed -> open"),
            "workers_routable": routable, "local_resource_errors": local}


def tree_peak_rss_mib(pid: int) -> float:
    return round(sum(rss_kib(p, "VmHWM") or 0 for p in process_tree(pid)) / 1024, 1)


def run_one(name: str, fleet: Fleet, limit: tuple[int, int], size: int, args, workdir: Path) -> dict:
    spec = contender(name)
    port = procs.free_port()
    argv = ["prlimit", f"--nofile={limit[0]}:{limit[1]}", "--", *spec.argv(fleet, port, None), *args.router_args]
    base_url = f"http://127.0.0.1:{port}"
    child = procs.start(f"{name}-{limit[0]}-{size}", argv, workdir, cwd=str(spec.cwd),
                        env={**__import__("os").environ, **HUB_GUARD_ENV})
    try:
        procs.wait_until(lambda: _serves(base_url), timeout=args.start_timeout, what=f"{name} serving /generate",
                         child=child, interval=0.2)
        sampler = None
        if name in args.profile:  # py-spy over the burst: where the router's CPU goes (accept, parse, legs, JSON)
            stacks = workdir / f"{name}-{limit[0]}-{size}.collapsed.txt"
            sampler = profile.start(child.pid, args.profile_seconds, stacks)
        cpu0 = procs.cpu_seconds(child.pid)
        done = subprocess.run([sys.executable, "-m", "bench.rollout_burst", "--client", "--url", base_url,
                               "--size", str(size), "--tokens", str(args.tokens), "--stream-every",
                               str(args.stream_every), "--timeout", str(args.timeout)],
                              capture_output=True, text=True, cwd=REPO_ROOT, timeout=args.timeout + 120)
        if done.returncode != 0:
            raise RuntimeError(f"the burst client failed ({done.returncode}): {done.stderr[-2000:]}")
        result = orjson.loads(done.stdout.strip().splitlines()[-1])
        if sampler is not None:
            profile.finish(sampler, timeout=args.profile_seconds + 60)
            print(f"# profile of {name}, soft {limit[0]}, burst {size} ({stacks}):\n"
                  f"{profile.render(profile.summarize(stacks.read_text()), top=25)}", flush=True)
        result.update(router=name, soft_limit=limit[0], hard_limit=limit[1],
                      router_cpu_s=round(procs.cpu_seconds(child.pid) - cpu0, 2),
                      peak_rss_mib=tree_peak_rss_mib(child.pid))
        if name == "pd-router":  # the servers' side of the ledger: nothing blamed on them, no breaker opened
            result.update(pd_router_health(base_url, child))
    finally:
        procs.stop(child)
    procs.wait_until(lambda: fleet_idle(fleet), timeout=120, what="the fleet idle again", interval=0.5)
    errors = ", ".join(f"{k} x{v}" for k, v in sorted(result["errors"].items())) or "none"
    health = (f"; worker failures {result['worker_failures']}, breakers opened {result['breakers_opened']}, "
              f"{result['workers_routable']} routable, local errors {result['local_resource_errors'] or 'none'}"
              if "worker_failures" in result else "")
    print(f"# {name} soft {limit[0]} burst {size}: {result['answered']}/{size} in {result['wall_s']:.1f} s, "
          f"CPU {result['router_cpu_s']:.1f} s, RSS {result['peak_rss_mib']:.0f} MiB; errors: {errors}{health}",
          flush=True)
    return result


def table(rows: list[dict]) -> str:
    """One line per (limit, burst, router), with wall and CPU as ratios to the baseline's of the same round (only
    where both answered every sample: a router that refuses most of a burst finishes it fast)."""
    lines = ["| soft limit | burst | router | answered in full | errors by kind | wall s | router CPU s | "
             f"peak RSS MiB | wall / {BASELINE} | CPU / {BASELINE} |", "|" + "---|" * 10]
    base = {(r["soft_limit"], r["burst"], r["round"]): r for r in rows if r["router"] == BASELINE}
    for r in sorted(rows, key=lambda r: (-r["soft_limit"], r["burst"], r["round"], ROUTERS.index(r["router"])
                                         if r["router"] in ROUTERS else 9)):
        b = base.get((r["soft_limit"], r["burst"], r["round"]))
        whole = b is not None and b["answered"] == b["burst"] and r["answered"] == r["burst"]
        ratio = (lambda key: f"{r[key] / b[key]:.2f}x" if whole and b[key] else "n/a")
        errors = ", ".join(f"{k} x{v}" for k, v in sorted(r["errors"].items())) or "none"
        lines.append(f"| {r['soft_limit']:,} | {r['burst']:,} | {r['router']} | {r['answered']:,}/{r['burst']:,} | "
                     f"{errors} | {r['wall_s']:.1f} | {r['router_cpu_s']:.1f} | {r['peak_rss_mib']:.0f} | "
                     f"{ratio('wall_s')} | {ratio('router_cpu_s')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--client", action="store_true", help=argparse.SUPPRESS)  # the burst's own process
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--bursts", default="1024,4096,16384", help="burst sizes, comma-separated")
    parser.add_argument("--limits", default="machine,1024",
                        help="soft open-files limits the routers start with (machine: the hard limit)")
    parser.add_argument("--routers", default=",".join(ROUTERS))
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=32, help="max_new_tokens of every sample")
    parser.add_argument("--stream-every", type=int, default=4, help="one sample in N streams")
    parser.add_argument("--timeout", type=float, default=180.0, help="the burst client's deadline per sample")
    parser.add_argument("--start-timeout", type=float, default=90.0)
    parser.add_argument("--sim-args", default=" ".join(DEFAULT_TIMING_ARGS), help="the simulated fleet's flags")
    parser.add_argument("--router-args", default="", help="flags added to every router's command line")
    parser.add_argument("--profile", default="", help="routers to sample with py-spy during each burst (comma-separated)")
    parser.add_argument("--profile-seconds", type=float, default=20.0, help="how long py-spy samples from the burst's start")
    parser.add_argument("--out", default=None, help="the JSON results (default out/bench/rollout_burst-<time>.json)")
    args = parser.parse_args(argv)
    if args.client:
        return client_main(args)
    args.router_args = args.router_args.split()
    args.profile = [name for name in args.profile.split(",") if name]
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    limits = [(hard, hard) if x == "machine" else (int(x), hard) for x in args.limits.split(",")]
    bursts = [int(x) for x in args.bursts.split(",")]
    routers = args.routers.split(",")
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out = Path(args.out) if args.out else REPO_ROOT / "out" / "bench" / f"rollout_burst-{stamp}.json"
    workdir = out.parent / f"rollout_burst-{stamp}"
    workdir.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    turn = 0
    with SimFleet(workdir / "fleet", 2, 2, extra_args=args.sim_args.split()) as fleet:
        for round_no in range(1, args.rounds + 1):
            for limit in limits:
                for size in bursts:
                    for name in routers[turn % len(routers):] + routers[:turn % len(routers)]:
                        rows.append({**run_one(name, fleet, limit, size, args, workdir), "round": round_no})
                    turn += 1
    report = table(rows)
    print(report)
    out.write_text(json.dumps({"command": " ".join(sys.argv), "environment": environment(REPO_ROOT, REPO_ROOT),
                               "rows": rows, "table": report}, indent=1))
    print(f"# results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
