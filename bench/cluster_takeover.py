"""How long the other replicas take to finish a conversion whose replica was SIGKILLed:
`python -m bench.cluster_takeover`.

    python -m bench.cluster_takeover [--replicas 3] [--rounds 3] [--ttl 2] [--role-switch-s 1.5]

Starts a one-member etcd, a simulated 1P+2D fleet and N router replicas (`--etcd-endpoints`, a port each,
`--etcd-lease-ttl-secs TTL`). Each round, replica (round mod N) converts the second decode server to prefill
and is SIGKILLed mid-way, then started again for the next round:

    drain    while the conversion drains (long streams it routed keep the server busy): the taker-over puts
             the server back in its pool (nothing changed on it); done when every other replica routes it
             as decode again
    switch   while the server switches (--role-switch-s): the taker-over waits for the server's live role;
             done when every other replica routes it as prefill with the port the server reports

Timed from the kill: the dead replica's lease ending (its `replicas/` key deleted, seen through a watch: the
baseline, about the TTL, side by side), the server reporting its new role (switch), and the last surviving
replica routing the server. `takeover_ms` is what the takeover adds after the lease ended (and, for a switch,
after the server switched). Printed: one JSON line per kill, then a summary with the load average.
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

from bench.cluster_setup import RouterReplica, call, cluster_flags, fleet_flags, report, seen_by_all
from harness.processes import await_until
from router.cluster.etcd import EtcdClient
from router.cluster.etcd_process import EtcdProcess
from simulator.fleet import Fleet

SIM = dict(health_check_s=0.0, bootstrap_retries=3, bootstrap_retry_interval_s=0.02, deferred_release_s=0.0,
           decode_step_s=0.003)
LONG = {"text": "the quick brown fox", "stream": True, "sampling_params": {"max_new_tokens": 5000,
                                                                           "temperature": 0}}
CLUSTER = "bench"
POLL_S = 0.01
TIMEOUT_S = 60.0


async def wait_until(predicate, what: str, timeout: float = TIMEOUT_S) -> None:
    await await_until(predicate, timeout=timeout, what=what, interval=POLL_S)


async def replica_id(session: aiohttp.ClientSession, replica: RouterReplica) -> str:
    return (await call(session, "GET", replica.url + "/admin/cluster"))[1]["replica"]


async def operation_step(session: aiohttp.ClientSession, observer: RouterReplica, url: str) -> str | None:
    """The step of the operation running on `url`, as another replica sees it in etcd."""
    _, view = await call(session, "GET", observer.url + "/admin/cluster")
    for op in view.get("operations", []):
        if op.get("scope") == f"worker/{url}":
            return op.get("step")
    return None


class LeaseWatch:
    """The time each replica's `replicas/<id>` key is deleted (its lease ended), from a watch."""

    def __init__(self, client: EtcdClient) -> None:
        self.client = client
        self.gone: dict[str, float] = {}
        self.task: asyncio.Task | None = None

    async def start(self) -> "LeaseWatch":
        prefix = f"/pd-router/{CLUSTER}/v1/replicas/"
        revision = (await self.client.status())["revision"] + 1

        async def follow() -> None:
            async with self.client.watch_prefix(prefix, start_revision=revision) as watch:
                async for event in watch:
                    if event.type == "delete":
                        self.gone[event.key.removeprefix(prefix)] = time.monotonic()

        self.task = asyncio.ensure_future(follow())
        return self

    async def ended(self, replica: str) -> float:
        await wait_until(lambda: replica in self.gone, f"the lease of {replica} ending")
        return self.gone[replica]

    def close(self) -> None:
        if self.task is not None:
            self.task.cancel()


async def stream(session: aiohttp.ClientSession, url: str) -> None:
    """A long stream through a replica that is going to die: its end (an error) is expected."""
    try:
        async with session.post(url + "/generate", json=LONG) as resp:
            async for _ in resp.content.iter_any():
                pass
    except (aiohttp.ClientError, asyncio.TimeoutError):
        pass


async def one_kill(scenario: str, session, fleet: Fleet, replicas: list[RouterReplica], victim: RouterReplica,
                   leases: LeaseWatch) -> dict:
    target = fleet.decode[1]
    survivors = [r for r in replicas if r is not victim]
    victim_id = await replica_id(session, victim)
    streams: list[asyncio.Task] = []
    if scenario == "drain":  # long streams routed by the victim keep the server draining
        async def busy() -> bool:
            return bool((await fleet.state(target))["running_rids"])
        while not await busy():
            streams.append(asyncio.ensure_future(stream(session, victim.url)))
            await asyncio.sleep(0.2)  # a request's time to reach a decode server; then look again
    status, answer = await call(session, "POST", f"{victim.url}/admin/workers/{quote(target.url, safe='')}/convert",
                                {"mode": "drain", "new_role": "prefill", "wait": False})
    if status not in (200, 202):
        raise RuntimeError(f"convert at {victim.name}: {status} {answer}")
    wanted = "start" if scenario == "drain" else "switch"
    await wait_until(lambda: _step_is(session, survivors[0], target.url, wanted), f"the conversion at step {wanted}")
    killed = victim.kill()
    await victim.exited()
    for task in streams:
        task.cancel()
    lease_gone = await leases.ended(victim_id)
    switched = None
    if scenario == "switch":
        # The kill may land after the step was recorded but before the switch call left the victim: then the
        # server stays decode and the taker-over rolls back. Either way every survivor must route the server
        # as it reports itself.
        await wait_until(lambda: _switch_settled(fleet, target), "the server's switch settling")
        state = await fleet.state(target)
        if state["role"] == "prefill":
            switched = time.monotonic()
        done = lambda view: (view is not None and view["role"] == state["role"] and view["routable"]
                             and view["bootstrap_port"] == state["bootstrap_port"])
    else:
        done = lambda view: view is not None and view["role"] == "decode" and view["routable"]
    seen = await seen_by_all(session, survivors, target.url, done, poll_s=POLL_S, timeout=TIMEOUT_S)
    routed = max(seen.values())
    since = max(lease_gone, switched or 0.0)
    outcome = "decode" if scenario == "drain" else ("switched" if switched else "never switched")
    return {"scenario": scenario, "victim": victim.name, "server": outcome,
            "lease_gone_ms": round((lease_gone - killed) * 1e3),
            "server_switched_ms": round((switched - killed) * 1e3) if switched else None,
            "routed_by_all_ms": round((routed - killed) * 1e3), "takeover_ms": round((routed - since) * 1e3)}


async def _switch_settled(fleet: Fleet, handle) -> bool:
    """The server switched to prefill, or is not switching (the call never reached it)."""
    state = await fleet.state(handle)
    return state["role"] == "prefill" or not state.get("switching", False)


async def _step_is(session, observer, url: str, step: str) -> bool:
    return await operation_step(session, observer, url) == step


async def _role_is(fleet: Fleet, handle, role: str) -> bool:
    return (await fleet.state(handle))["role"] == role


async def restore(session, fleet: Fleet, replicas: list[RouterReplica]) -> None:
    """The server back to decode and idle for the next round, through a live replica."""
    target = fleet.decode[1]
    async with session.post(target.url + "/abort_request", json={"abort_all": True}) as resp:
        await resp.read()
    if (await fleet.state(target))["role"] != "decode":
        status, answer = await call(session, "POST", f"{replicas[0].url}/admin/workers/"
                                    f"{quote(target.url, safe='')}/convert", {"mode": "abort", "new_role": "decode"})
        if status != 200:
            raise RuntimeError(f"converting back: {status} {answer}")
    await seen_by_all(session, replicas, target.url,
                      lambda v: v is not None and v["role"] == "decode" and v["routable"], poll_s=POLL_S,
                      timeout=TIMEOUT_S)


async def run(args: argparse.Namespace) -> dict:
    # SIGTERM (a timeout's) ends the run through its clean-up: no router, fleet or etcd is left behind
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, asyncio.current_task().cancel)
    load_before = os.getloadavg()
    kills = []
    with tempfile.TemporaryDirectory(prefix="bench-takeover-") as tmp:
        workdir = Path(tmp)
        async with EtcdProcess(workdir / "etcd") as etcd, \
                Fleet(1, 2, role_switch_s=args.role_switch_s, **SIM) as fleet, \
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT_S)) as session, \
                EtcdClient(etcd.endpoints) as client:
            flags = fleet_flags(fleet.prefill, fleet.decode) + cluster_flags(etcd.client_url, CLUSTER, args.ttl)
            replicas = [RouterReplica(f"r{i}", flags, workdir) for i in range(args.replicas)]
            leases = await LeaseWatch(client).start()
            try:
                await asyncio.gather(*(r.start(session) for r in replicas))
                print(f"# {args.replicas} replicas serving, TTL {args.ttl} s; load average "
                      f"{' '.join(f'{x:.2f}' for x in load_before)}", flush=True)
                for round_no in range(args.rounds):
                    for scenario in args.scenarios:
                        index = (round_no * len(args.scenarios) + args.scenarios.index(scenario)) % len(replicas)
                        victim = replicas[index]
                        kill = await one_kill(scenario, session, fleet, replicas, victim, leases)
                        kill["round"] = round_no + 1
                        print(orjson.dumps(kill).decode(), flush=True)
                        kills.append(kill)
                        replicas[index] = RouterReplica(f"{victim.name}'", flags, workdir)
                        await replicas[index].start(session)
                        await restore(session, fleet, replicas)
            finally:
                leases.close()
                await asyncio.gather(*(r.stop() for r in replicas))
    summary = summarize(kills, args.ttl)
    summary.update(replicas=args.replicas, role_switch_s=args.role_switch_s, cores=os.cpu_count(),
                   load_avg_before=[round(x, 2) for x in load_before],
                   load_avg_after=[round(x, 2) for x in os.getloadavg()])
    return summary


def summarize(kills: list[dict], ttl: int) -> dict:
    """Per scenario: medians of the lease's end, the last replica routing, and the takeover's own part."""
    scenarios = {}
    for scenario in dict.fromkeys(k["scenario"] for k in kills):
        rows = [k for k in kills if k["scenario"] == scenario]
        routed = statistics.median(r["routed_by_all_ms"] for r in rows)
        scenarios[scenario] = {
            "kills": len(rows),
            **{f"{field}_median": statistics.median(r[field] for r in rows)
               for field in ("lease_gone_ms", "routed_by_all_ms", "takeover_ms")},
            "routed_by_all_ms_max": max(r["routed_by_all_ms"] for r in rows),
            "routed_by_all_vs_ttl": round(routed / (ttl * 1e3), 2)}
    return {"ttl_s": ttl, "scenarios": scenarios}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ttl", type=int, default=2, help="--etcd-lease-ttl-secs of the replicas")
    parser.add_argument("--role-switch-s", type=float, default=1.5, help="the simulated server's switch time")
    parser.add_argument("--scenarios", default="drain,switch")
    parser.add_argument("--out", type=Path, help="also write the summary (JSON) here")
    args = parser.parse_args(argv)
    args.scenarios = [s for s in args.scenarios.split(",") if s]
    for scenario in args.scenarios:
        if scenario not in ("drain", "switch"):
            parser.error(f"unknown scenario {scenario!r}")
    summary = asyncio.run(run(args))
    report(summary, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
