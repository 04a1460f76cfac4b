"""Soak run: minutes of mixed load (streaming and not) through pd-router on a simulated process fleet, with
faults injected on a schedule, reporting lost requests, the router's memory and leftover in-flight counts.

    python -m bench.soak [--duration 180] [--concurrency 16] [--out soak.json]

Fleet: 2 prefill + 2 decode simulator processes; pd-router in its own process (JSON logs). Schedule, as
fractions of the run:
    0.15-0.30  decode 0 answers 30 % of requests with 503          (retried: nothing lost)
    0.35-0.50  prefill 1 hangs: no progress, /health stalls        (probes evict it, its requests re-routed)
    0.60       decode 1 is SIGKILLed; 0.70 restarted on its port  (only streams already running on it lost)
    0.75-0.85  prefill 0 answers 20 % of requests with 500          (retried)
Every request is checked: unary answers carry all their tokens; streams end with [DONE] and no error event.
A failed request is attributed to the killed decode when the router's access line (matched by X-Request-Id)
names that decode and it happened while the decode was down. Everything else counts as lost.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import orjson

from bench import procs
from harness import processes
from harness.processes import rss_kib
from simulator.config import Timing
from simulator.fleet import Fleet, WorkerHandle

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Outcome:
    request_id: str
    stream: bool
    started: float
    ok: bool
    kind: str = "ok"  # ok | status_NNN | stream_error | no_done | short | transport
    detail: str = ""


@dataclass
class Run:
    outcomes: list[Outcome] = field(default_factory=list)
    rss_kb: list[tuple[float, int]] = field(default_factory=list)
    events: list[tuple[float, str]] = field(default_factory=list)
    t0: float = 0.0

    def mark(self, what: str) -> None:
        self.events.append((round(time.monotonic() - self.t0, 2), what))
        print(f"[{time.monotonic() - self.t0:7.1f}s] {what}", flush=True)


# ---- one client loop ----------------------------------------------------------------------------------------
async def one_request(session: aiohttp.ClientSession, url: str, rid: str, rng: random.Random, run: Run) -> None:
    stream = rng.random() < 0.5
    tokens = rng.randint(8, 48)
    body = {"text": f"soak {rid} " + "lorem ipsum " * rng.randint(1, 20),
            "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True, "temperature": 0.7},
            "stream": stream}
    started = time.monotonic()
    outcome = Outcome(rid, stream, started - run.t0, ok=False)
    try:
        async with session.post(url + "/generate", data=orjson.dumps(body), headers={
                "Content-Type": "application/json", "X-Request-Id": rid}) as resp:
            raw = await resp.read()
            if resp.status != 200:
                outcome.kind, outcome.detail = f"status_{resp.status}", raw[:300].decode(errors="replace")
            elif stream:
                events = [block[6:] for block in raw.split(b"\n\n") if block.startswith(b"data: ")]
                if not events or events[-1] != b"[DONE]":
                    outcome.kind = "no_done"
                elif any(b'"error"' in e for e in events[:-1]):
                    outcome.kind, outcome.detail = "stream_error", events[-2][:300].decode(errors="replace")
                else:
                    last = orjson.loads(events[-2])
                    got = last.get("meta_info", {}).get("completion_tokens")
                    outcome.ok = got == tokens
                    outcome.kind = "ok" if outcome.ok else "short"
                    outcome.detail = "" if outcome.ok else f"{got} of {tokens} tokens"
            else:
                answer = orjson.loads(raw)
                got = answer.get("meta_info", {}).get("completion_tokens")
                outcome.ok = got == tokens
                outcome.kind = "ok" if outcome.ok else "short"
                outcome.detail = "" if outcome.ok else f"{got} of {tokens} tokens"
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        outcome.kind, outcome.detail = "transport", repr(exc)[:300]
    run.outcomes.append(outcome)


async def client_loop(index: int, url: str, until: float, run: Run) -> None:
    rng = random.Random(index)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        n = 0
        while time.monotonic() < until:
            n += 1
            await one_request(session, url, f"soak-{index}-{n}", rng, run)


# ---- fleet control ------------------------------------------------------------------------------------------
async def set_faults(session: aiohttp.ClientSession, handle: WorkerHandle, **faults) -> None:
    async with session.post(handle.url + "/_sim/faults", data=orjson.dumps(faults),
                            headers={"Content-Type": "application/json"}) as resp:
        if resp.status != 200:
            raise RuntimeError(f"faults on {handle.url}: {resp.status} {await resp.text()}")


async def workers(session: aiohttp.ClientSession, router: str) -> list[dict]:
    async with session.get(router + "/workers") as resp:
        return (await resp.json())["workers"]


async def wait_healthy(session, router: str, url: str, deadline_s: float) -> float | None:
    start = time.monotonic()
    while time.monotonic() - start < deadline_s:
        if any(w["url"] == url and w["is_healthy"] and w["routable"] for w in await workers(session, router)):
            return time.monotonic() - start
        await asyncio.sleep(0.2)
    return None


async def schedule(fleet: Fleet, router: str, duration: float, run: Run, facts: dict) -> None:
    at = lambda fraction: run.t0 + fraction * duration  # noqa: E731

    async def until(fraction: float) -> None:
        await asyncio.sleep(max(at(fraction) - time.monotonic(), 0))

    d0, d1 = fleet.decode
    p0, p1 = fleet.prefill
    async with aiohttp.ClientSession() as session:
        await until(0.15)
        await set_faults(session, d0, error_rate=0.3, error_status=503)
        run.mark(f"decode {d0.url}: 30% 503s")
        await until(0.30)
        await set_faults(session, d0, reset=True)
        run.mark("decode 0 repaired")
        await until(0.35)
        await set_faults(session, p1, hang=True)
        run.mark(f"prefill {p1.url}: hangs")
        await until(0.50)
        await set_faults(session, p1, reset=True)
        run.mark("prefill 1 repaired")
        facts["hung_prefill_rejoined_s"] = await wait_healthy(session, router, p1.url, 30)
        await until(0.60)
        fleet.kill(d1)
        facts["killed"] = {"url": d1.url, "at": round(time.monotonic() - run.t0, 2)}
        run.mark(f"decode {d1.url}: SIGKILL")
        await until(0.70)
        await fleet.restart(d1)  # on its ports, as launched (the fleet's one way to start a worker again)
        facts["killed"]["restarted_at"] = round(time.monotonic() - run.t0, 2)
        run.mark("decode 1 restarted on its port")
        facts["killed_decode_rejoined_s"] = await wait_healthy(session, router, d1.url, 30)
        run.mark(f"decode 1 rejoined after {facts['killed_decode_rejoined_s']} s")
        await until(0.75)
        await set_faults(session, p0, error_rate=0.2, error_status=500)
        run.mark(f"prefill {p0.url}: 20% 500s")
        await until(0.85)
        await set_faults(session, p0, reset=True)
        run.mark("prefill 0 repaired")


async def sample_rss(pid: int, run: Run, until: float) -> None:
    while time.monotonic() < until:
        if (kb := rss_kib(pid)) is not None:
            run.rss_kb.append((round(time.monotonic() - run.t0, 1), kb))
        await asyncio.sleep(5)


# ---- analysis -----------------------------------------------------------------------------------------------
def access_lines(log_path: Path) -> dict[str, dict]:
    lines = {}
    for raw in log_path.read_text(errors="replace").splitlines():
        if not raw.startswith("{"):
            continue
        try:
            entry = orjson.loads(raw)
        except orjson.JSONDecodeError:
            continue
        if entry.get("logger") == "router.access":
            lines[entry.get("request_id")] = entry
    return lines


def analyse(run: Run, facts: dict, log_path: Path) -> dict:
    access = access_lines(log_path)
    killed = facts.get("killed", {})
    down_from, down_to = killed.get("at", -1), killed.get("restarted_at", -1)
    failed = [o for o in run.outcomes if not o.ok]
    on_killed, lost = [], []
    for o in failed:
        line = access.get(o.request_id, {})
        if (line.get("decode") == killed.get("url") or line.get("prefill") == killed.get("url")) \
                and o.started <= down_to and o.started + 120 >= down_from:
            on_killed.append(o)
        else:
            lost.append(o)
    warm = [kb for t, kb in run.rss_kb if t >= 0.1 * facts["duration_s"]]
    return {
        "requests": len(run.outcomes),
        "succeeded": len(run.outcomes) - len(failed),
        "streams": sum(o.stream for o in run.outcomes),
        "failed": len(failed),
        "failed_by_kind": dict(Counter(o.kind for o in failed)),
        "failed_on_killed_decode": len(on_killed),
        "lost_other": len(lost),
        "lost_examples": [o.__dict__ for o in lost[:10]],
        "router_rss_mb": {
            "first": round(run.rss_kb[0][1] / 1024, 1) if run.rss_kb else None,
            "after_warmup": round(warm[0] / 1024, 1) if warm else None,
            "end": round(run.rss_kb[-1][1] / 1024, 1) if run.rss_kb else None,
            "max": round(max(kb for _, kb in run.rss_kb) / 1024, 1) if run.rss_kb else None,
            "samples": len(run.rss_kb),
            "series": [[t, round(kb / 1024, 1)] for t, kb in run.rss_kb[::3]],
        },
    }


async def leftovers(router: str) -> dict:
    async with aiohttp.ClientSession() as session:
        listing = await workers(session, router)
        async with session.get(router + "/metrics") as resp:
            metrics = await resp.text()
    wanted = ("pd_router_requests_in_flight ", "pd_router_queue_length ", "pd_router_retries_total{",
              "pd_router_aborts_total{", "pd_router_breaker_transitions_total{", "pd_router_worker_health_changes_total{")
    return {
        "worker_inflight": {w["url"]: w["inflight"] for w in listing},
        "worker_healthy": {w["url"]: w["is_healthy"] for w in listing},
        "metrics": [line for line in metrics.splitlines() if line.startswith(wanted)],
    }


# ---- main ---------------------------------------------------------------------------------------------------
async def soak(duration: float, concurrency: int, workdir: Path) -> dict:
    fleet = Fleet(2, 2, processes=True,
                  timing=Timing(prefill_overhead_s=0.005, prefill_per_token_s=0.0001, decode_step_s=0.01),
                  health_check_s=0.2, kv_wait_timeout_s=15.0, bootstrap_timeout_s=15.0, deferred_release_s=2.0)
    await fleet.start()
    router_port = procs.free_port()
    router = f"http://127.0.0.1:{router_port}"
    argv = [sys.executable, "-m", "router", "--host", "127.0.0.1", "--port", str(router_port),
            "--timeout", "30", "--health-check-interval-secs", "1", "--health-check-timeout-secs", "2",
            "--health-failure-threshold", "2", "--health-success-threshold", "2",
            "--cb-failure-threshold", "5", "--cb-timeout-duration-secs", "5",
            "--retry-max-retries", "3", "--retry-initial-backoff-ms", "20",
            "--max-concurrent-requests", "256", "--queue-size", "1024", "--log-json", "--log-level", "info"]
    for handle in fleet.prefill:
        argv += ["--prefill", handle.url, str(handle.bootstrap_port)]
    for handle in fleet.decode:
        argv += ["--decode", handle.url]
    child = procs.start("router", argv, workdir, cwd=str(REPO), env=processes.child_env())
    run, facts = Run(), {"duration_s": duration, "concurrency": concurrency}
    try:
        procs.wait_until(lambda: procs.http_status(router + "/health") == 200, timeout=30, what="router",
                         child=child)
        run.t0 = time.monotonic()
        until = run.t0 + duration
        run.mark(f"load: {concurrency} clients for {duration:g} s on {router}")
        await asyncio.gather(
            schedule(fleet, router, duration, run, facts),
            sample_rss(child.pid, run, until + 3),
            *(client_loop(i, router, until, run) for i in range(concurrency)),
        )
        run.mark("load stopped")
        # Let lingering prefill legs and aborts finish, then read what is left in flight.
        deadline = time.monotonic() + 30
        while True:
            left = await leftovers(router)
            if not any(left["worker_inflight"].values()) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
        if (kb := rss_kib(child.pid)) is not None:
            run.rss_kb.append((round(time.monotonic() - run.t0, 1), kb))
        report = {"facts": facts, "events": run.events, **analyse(run, facts, child.log_path), "after": left}
        return report
    finally:
        procs.stop(child)
        await fleet.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=180.0, help="seconds of load")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--out", type=Path, default=None, help="write the report as JSON here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="pd-soak-") as tmp:
        report = asyncio.run(soak(args.duration, args.concurrency, Path(tmp)))
    text = json.dumps(report, indent=2)
    if args.out:
        args.out.write_text(text)
    print(text)
    ok = report["lost_other"] == 0 and not any(report["after"]["worker_inflight"].values())
    print("SOAK", "PASSED" if ok else "FAILED", f"({report['requests']} requests, {report['lost_other']} lost, "
          f"{report['failed_on_killed_decode']} on the killed decode, RSS {report['router_rss_mb']})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
