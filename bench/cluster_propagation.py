"""How long a change made at one router replica takes to reach every replica: `python -m bench.cluster_propagation`.

    python -m bench.cluster_propagation [--replicas 3] [--rounds 5] [--poll-ms 5]

Starts a one-member etcd, a simulated 2P+3D fleet (its third decode server known to no replica at first) and
N router replicas (`--etcd-endpoints`, a port each). Each round, at replica (round mod N), one change after
another:

    add       POST /workers (the spare decode server): until every replica routes it
    convert   POST /admin/workers/{decode 2}/convert (to prefill, drain, nothing in flight): until every
              replica routes it as a prefill server with the bootstrap port the server reports
    back      the same server converted back to decode
    remove    DELETE /workers/{spare}: until no replica has it

Each is timed from the call's answer (the change is in etcd by then: an API call answers after its change is
published) to the last replica seeing it, and from the call's send. Baseline in the same run: etcd's own
put → watch delivery through the router's etcd client (bench.etcd_client), what bounds a replica. Printed:
one JSON line per change, then a summary per kind (median and max, and the median as a multiple of the
baseline's), with the load average. The polls (every --poll-ms on every replica) bound the resolution.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import quote

import aiohttp
import orjson

from bench.cluster_setup import RouterReplica, call, cluster_flags, fleet_flags, report, seen_by_all, worker_view
from bench.etcd_client import watch_delivery
from router.cluster.etcd import EtcdClient
from router.cluster.etcd_process import EtcdProcess
from simulator.fleet import Fleet

SIM = dict(health_check_s=0.0, bootstrap_retries=3, bootstrap_retry_interval_s=0.02, deferred_release_s=0.0,
           decode_step_s=0.003, role_switch_s=0.05)
TIMEOUT_S = 30.0


def routed_as(role: str, port=None):
    def holds(view: dict | None) -> bool:
        return (view is not None and view["role"] == role and view["routable"]
                and (port is None or view["bootstrap_port"] == port))
    return holds


def absent(view: dict | None) -> bool:
    return view is None


async def timed_change(session, replicas, at: RouterReplica, kind: str, method: str, path: str, body: dict | None,
                       url: str, predicate, poll_s: float) -> dict:
    """Make one change at `at` while every replica is polled; the timings of its spread."""
    watching = asyncio.ensure_future(seen_by_all(session, replicas, url, predicate, poll_s=poll_s, timeout=TIMEOUT_S))
    await asyncio.sleep(0)  # the polls are running before the call is sent
    sent = time.monotonic()
    status, answer = await call(session, method, at.url + path, body)
    answered = time.monotonic()
    if status not in (200, 201, 202):
        watching.cancel()
        raise RuntimeError(f"{kind} at {at.name}: {status} {answer}")
    seen = await watching
    others = [t for name, t in seen.items() if name != at.name]
    return {"kind": kind, "at": at.name, "call_ms": round((answered - sent) * 1e3, 2),
            "answer_to_all_ms": round((max(seen.values()) - answered) * 1e3, 2),
            "answer_to_others_ms": round((max(others) - answered) * 1e3, 2) if others else None,
            "send_to_all_ms": round((max(seen.values()) - sent) * 1e3, 2)}


def summarize(changes: list[dict], baseline_s: list[float]) -> dict:
    base_ms = statistics.median(baseline_s) * 1e3
    kinds = {}
    for kind in dict.fromkeys(c["kind"] for c in changes):
        spread = [c["answer_to_all_ms"] for c in changes if c["kind"] == kind]
        kinds[kind] = {"changes": len(spread), "answer_to_all_ms_median": round(statistics.median(spread), 2),
                       "answer_to_all_ms_max": round(max(spread), 2),
                       "send_to_all_ms_median": round(statistics.median(
                           [c["send_to_all_ms"] for c in changes if c["kind"] == kind]), 2),
                       "median_vs_etcd_watch": round(statistics.median(spread) / base_ms, 1) if base_ms else None}
    return {"etcd_put_to_watch_ms_median": round(base_ms, 3),
            "etcd_put_to_watch_ms_p99": round(sorted(baseline_s)[int(0.99 * (len(baseline_s) - 1))] * 1e3, 3),
            "kinds": kinds}


async def run(args: argparse.Namespace) -> dict:
    # SIGTERM (a timeout's) ends the run through its clean-up: no router, fleet or etcd is left behind
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, asyncio.current_task().cancel)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-propagation-") as tmp:
        workdir = Path(tmp)
        async with EtcdProcess(workdir / "etcd") as etcd, Fleet(2, 3, **SIM) as fleet, \
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            flags = fleet_flags(fleet.prefill, fleet.decode[:2]) + cluster_flags(etcd.client_url, "bench", args.ttl)
            replicas = [RouterReplica(f"r{i}", flags, workdir) for i in range(args.replicas)]
            try:
                await asyncio.gather(*(r.start(session) for r in replicas))
                print(f"# {args.replicas} replicas serving; etcd {etcd.client_url}; load average "
                      f"{' '.join(f'{x:.2f}' for x in load_before)}", flush=True)
                async with EtcdClient(etcd.endpoints) as client:
                    baseline, _ = await watch_delivery(client, args.baseline_puts)
                spare, target = fleet.decode[2], fleet.decode[1]
                poll_s = args.poll_ms / 1000
                changes = []
                for round_no in range(args.rounds):
                    at = replicas[round_no % len(replicas)]
                    target_path = quote(target.url, safe="")
                    steps = [
                        ("add", "POST", "/workers", {"url": spare.url, "worker_type": "decode"}, spare.url,
                         routed_as("decode")),
                        ("convert", "POST", f"/admin/workers/{target_path}/convert",
                         {"mode": "drain", "new_role": "prefill"}, target.url, routed_as("prefill")),
                        ("back", "POST", f"/admin/workers/{target_path}/convert",
                         {"mode": "drain", "new_role": "decode"}, target.url, routed_as("decode")),
                        ("remove", "DELETE", f"/workers/{quote(spare.url, safe='')}", None, spare.url, absent),
                    ]
                    for kind, method, path, body, url, predicate in steps:
                        change = await timed_change(session, replicas, at, kind, method, path, body, url,
                                                    predicate, poll_s)
                        change["round"] = round_no + 1
                        if kind == "convert":  # every replica has the bootstrap port the server reports
                            port = (await fleet.state(target))["bootstrap_port"]
                            ports = {r.name: (await worker_view(session, r, target.url))["bootstrap_port"]
                                     for r in replicas}
                            if set(ports.values()) != {port}:
                                raise RuntimeError(f"bootstrap ports {ports}, the server reports {port}")
                        print(orjson.dumps(change).decode(), flush=True)
                        changes.append(change)
            except BaseException:
                for replica in replicas:  # what each replica logged, for the failure's cause
                    print(f"# ---- {replica.name} log tail\n{replica.log_tail(6000)}", file=sys.stderr)
                raise
            finally:
                await asyncio.gather(*(r.stop() for r in replicas))
    summary = summarize(changes, baseline)
    summary.update(replicas=args.replicas, rounds=args.rounds, poll_ms=args.poll_ms, cores=os.cpu_count(),
                   load_avg_before=[round(x, 2) for x in load_before],
                   load_avg_after=[round(x, 2) for x in os.getloadavg()])
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5, help="each round: add, convert, back, remove")
    parser.add_argument("--poll-ms", type=float, default=5.0, help="how often each replica is asked")
    parser.add_argument("--ttl", type=int, default=5, help="--etcd-lease-ttl-secs of the replicas")
    parser.add_argument("--baseline-puts", type=int, default=200)
    parser.add_argument("--out", type=Path, help="also write the summary (JSON) here")
    args = parser.parse_args(argv)
    summary = asyncio.run(run(args))
    report(summary, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
