"""What a fleet-wide weight update costs the clients: the stall new requests see, and the time to a quiet fleet.

    python -m bench.weight_update [--inflight 100,1000] [--modes direct,abort,drain] [--update-s 0.5]
                                  [--decode-step-s 1.0] [--max-new-tokens 4] [--prefill 2] [--decode 2]

Starts a simulated fleet (one process per worker; loading weights takes `--update-s`) and pd-router in its
own process, then, for each number of requests in flight, keeps that many closed-loop streaming clients
sending `/generate` through the router and updates the weights three ways while they run:

- `direct`: the baseline, what a trainer does without pd-router's flow: `update_weights_from_disk` with
  `abort_all_requests: true` sent to every server at once. SGLang aborts asynchronously, then takes its
  weight lock; new requests queue in the servers behind it; a server that still has requests when it
  flushes answers 400 "Weights were updated, but the cache was not flushed".
- `abort`: the same call through the router: hold new requests, abort everything, wait until every server
  is idle, update, verify the versions, release.
- `drain`: through the router without aborting: hold, wait for the requests in flight to finish, update.

Per run: the time from the update call to a quiet fleet (`quiet_ms`; router: its `quiesce_s`; direct: until
every server's update returned), how long the router held new requests (`hold_ms`), the whole call
(`update_call_ms`), and the stall clients saw: the time to first token of the streams sent while the update
ran, against the median one before it (same run, same load). Also how every request ended (complete, abort,
error). Printed: one JSON line per run, then a summary with ratios (router abort vs direct, drain vs abort,
time to first token during the update vs steady). Timings share the machine with whatever else runs.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import orjson

from bench import procs

REPO_ROOT = Path(__file__).resolve().parents[1]


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000, 1)


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def outcome_of(status: int, last_event: bytes) -> tuple[str, tuple[str, ...]]:
    """complete, abort (SGLang's abort answer), or what went wrong; and the weight versions that produced
    the answer's tokens (`meta_info.weight_versions` spans, else `weight_version`)."""
    if status != 200:
        return f"http_{status}", ()
    try:
        answer = orjson.loads(last_event)
    except orjson.JSONDecodeError:
        return "bad_stream", ()
    if "error" in answer:
        return "stream_error", ()
    meta = answer.get("meta_info") or {}
    spans = meta.get("weight_versions")
    versions = tuple(dict.fromkeys(str(s.get("version")) for s in spans if isinstance(s, dict))) \
        if isinstance(spans, list) and spans else ((str(meta["weight_version"]),) if "weight_version" in meta else ())
    reason = (meta.get("finish_reason") or {}).get("type")
    return {"length": "complete", "stop": "complete", "abort": "abort"}.get(reason, f"finish_{reason}"), versions


@dataclass
class Sample:
    sent: float
    first: float | None  # first event (time to first token)
    ended: float
    outcome: str
    versions: tuple[str, ...] = ()

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.sent


@dataclass
class Clients:
    """`concurrency` closed-loop clients through the router; every request's timing and outcome kept."""

    url: str
    concurrency: int
    body: dict
    samples: list[Sample] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    async def _user(self, session: aiohttp.ClientSession) -> None:
        while not self._stop.is_set():
            sent, first, versions = time.monotonic(), None, ()
            try:
                async with session.post(self.url + "/generate", json=self.body) as resp:
                    events = []
                    async for line in resp.content:
                        if line.startswith(b"data: "):
                            first = first or time.monotonic()
                            events.append(line[6:].strip())
                    if resp.status != 200:
                        outcome = f"http_{resp.status}"
                    elif len(events) < 2 or events[-1] != b"[DONE]":
                        outcome = "stream_without_done"
                    else:
                        outcome, versions = outcome_of(resp.status, events[-2])
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                outcome = type(exc).__name__
            self.samples.append(Sample(sent, first, time.monotonic(), outcome, versions))

    def start(self, session: aiohttp.ClientSession) -> None:
        self._tasks = [asyncio.ensure_future(self._user(session)) for _ in range(self.concurrency)]

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)


async def admitted(session: aiohttp.ClientSession, router: str) -> int:
    async with session.get(router + "/weight_updates") as resp:
        return (await resp.json())["admission"]["active"]


async def update_direct(session: aiohttp.ClientSession, urls: list[str], version: str) -> dict:
    """The baseline: every server updated at once, SGLang's own abort_all_requests, no router flow."""
    body = {"model_path": "sim/tiny-llama", "weight_version": version, "abort_all_requests": True}

    async def one(url: str) -> tuple[int, dict]:
        async with session.post(url + "/update_weights_from_disk", json=body) as resp:
            return resp.status, await resp.json()

    started = time.monotonic()
    answers = await asyncio.gather(*(one(url) for url in urls))
    quiet = time.monotonic() - started
    failed = [a["message"][:80] for status, a in answers if status != 200]
    return {"quiet_s": quiet, "hold_s": None, "servers_failed": len(failed), "failures": failed}


async def update_routed(session: aiohttp.ClientSession, router: str, version: str, abort: bool) -> dict:
    body = {"model_path": "sim/tiny-llama", "weight_version": version, "abort_all_requests": abort}
    async with session.post(router + "/update_weights_from_disk", json=body) as resp:
        answer = await resp.json()
        status = resp.status
    if status != 200:
        raise RuntimeError(f"the routed update failed: {answer}")
    async with session.get(f"{router}/weight_updates/{answer['update_id']}") as resp:
        record = await resp.json()
    steps = {s["name"]: s["duration_s"] for s in record["steps"]}
    return {"quiet_s": record["quiesce_s"], "hold_s": record["hold_s"], "held_requests": record["held_requests"],
            "aborted_requests": record["aborted_requests"], "servers_failed": sum(
                not w["success"] for w in answer["workers"]), "update_step_s": steps.get("update"),
            "verify_step_s": steps.get("verify")}


async def one_run(session: aiohttp.ClientSession, router: str, urls: list[str], mode: str, inflight: int,
                  version: str, args: argparse.Namespace) -> dict:
    body = {"text": "the quick brown fox jumps over the lazy dog", "stream": True,
            "sampling_params": {"max_new_tokens": args.max_new_tokens, "temperature": 0}}
    clients = Clients(router, inflight, body)
    clients.start(session)
    try:
        deadline = time.monotonic() + 120
        while await admitted(session, router) < inflight * 0.95 or len(clients.samples) < inflight:
            if time.monotonic() > deadline:
                raise RuntimeError(f"load never reached {inflight} requests in flight")
            await asyncio.sleep(0.1)
        in_flight = await admitted(session, router)
        started = time.monotonic()
        if mode == "direct":
            result = await update_direct(session, urls, version)
        else:
            result = await update_routed(session, router, version, abort=mode == "abort")
        ended = time.monotonic()
        # let the requests sent during the update finish before stopping the load
        while not any(s.sent > ended for s in clients.samples):
            await asyncio.sleep(0.05)
    finally:
        await clients.stop()
    steady = median([s.ttft for s in clients.samples if s.ended < started and s.outcome == "complete"])
    during = [s for s in clients.samples if started <= s.sent <= ended]
    # The stall: time to first token of the requests sent while the update ran, beyond the usual one.
    ttft_during = [s.ttft for s in during if s.ttft is not None]
    caught = Counter(s.outcome for s in clients.samples if s.sent < started < s.ended)
    complete = [s for s in clients.samples if s.outcome == "complete"]
    return {
        "mode": mode, "inflight": in_flight, "version": version,
        "update_call_ms": ms(ended - started),
        "quiet_ms": ms(result["quiet_s"]),
        "hold_ms": ms(result["hold_s"]),
        "ttft_steady_ms": ms(steady),
        "ttft_during_ms_median": ms(median(ttft_during)),
        "ttft_during_ms_max": ms(max(ttft_during) if ttft_during else None),
        "stall_ms_median": ms(median(ttft_during) - steady if ttft_during and steady is not None else None),
        "requests_sent_during": len(during),
        "caught_in_flight": dict(caught),
        "outcomes": dict(Counter(s.outcome for s in clients.samples)),
        # answers whose tokens came from two weight versions, and answers finished after the update
        # returned that were still (partly) made by the old weights: what the flow exists to prevent
        "mixed_version_answers": sum(len(s.versions) > 1 for s in complete),
        "old_weights_after_update": sum(s.ended > ended and s.versions and s.versions[0] != version
                                        for s in complete),
        **{k: v for k, v in result.items() if k not in ("quiet_s", "hold_s")},
    }


def summarize(runs: list[dict]) -> dict:
    summary = {}
    for inflight in sorted({r["inflight_target"] for r in runs}):
        by_mode = {r["mode"]: r for r in runs if r["inflight_target"] == inflight}
        direct, abort, drain = by_mode.get("direct"), by_mode.get("abort"), by_mode.get("drain")
        row = {mode: {k: r[k] for k in ("update_call_ms", "quiet_ms", "hold_ms", "ttft_steady_ms",
                                         "ttft_during_ms_median", "ttft_during_ms_max", "stall_ms_median")}
               for mode, r in by_mode.items()}
        row["errors"] = {mode: sum(v for k, v in r["outcomes"].items() if k not in ("complete", "abort"))
                         for mode, r in by_mode.items()}
        row["servers_failed"] = {mode: r.get("servers_failed") for mode, r in by_mode.items()}
        row["mixed_version_answers"] = {mode: r["mixed_version_answers"] for mode, r in by_mode.items()}
        row["old_weights_after_update"] = {mode: r["old_weights_after_update"] for mode, r in by_mode.items()}
        if direct and abort:
            # the whole call, and what clients waited for a first token, through the router vs direct
            row["abort_call_vs_direct"] = ratio(abort["update_call_ms"], direct["update_call_ms"])
            row["abort_ttft_during_vs_direct"] = ratio(abort["ttft_during_ms_median"],
                                                       direct["ttft_during_ms_median"])
        if drain and abort:
            row["drain_quiet_vs_abort"] = ratio(drain["quiet_ms"], abort["quiet_ms"])
        for mode, r in by_mode.items():
            row[f"{mode}_ttft_during_vs_steady"] = ratio(r["ttft_during_ms_median"], r["ttft_steady_ms"])
        summary[str(inflight)] = row
    return summary


async def run(args: argparse.Namespace, workdir: Path) -> list[dict]:
    from simulator.fleet import Fleet  # noqa: PLC0415 (the simulator is only needed when this runs)

    # A decode that reaches its prefill before the room exists retries the handshake: every 20 ms, not
    # SGLang's 1 s, so that time to first token measures the router rather than that back-off.
    settings = dict(decode_step_s=args.decode_step_s, health_check_s=0.0, deferred_release_s=0.0,
                    bootstrap_retries=500, bootstrap_retry_interval_s=0.02,
                    max_running_requests=4096, max_total_tokens=1 << 24)
    async with Fleet(args.prefill, args.decode, processes=True, **settings) as fleet:
        port = procs.free_port()
        router_url = f"http://127.0.0.1:{port}"
        # No health probes and no reconciler rounds: the direct baseline changes versions behind the router.
        argv = [sys.executable, "-m", "router", "--host", "127.0.0.1", "--port", str(port), "--log-level",
                "warning", "--disable-health-check", "--health-check-interval-secs", "3600",
                "--queue-size", "100000", "--queue-timeout-secs", "300", "--request-timeout-secs", "300"]
        for handle in fleet.prefill:
            argv += ["--prefill", handle.url, str(handle.bootstrap_port)]
        for handle in fleet.decode:
            argv += ["--decode", handle.url]
        router = procs.start("pd-router", argv, workdir, cwd=str(REPO_ROOT))
        for handle in fleet.workers:  # loading new weights takes time on a real server
            await fleet.set_faults(handle, update_delay_s=args.update_s)
        runs = []
        try:
            procs.wait_until(lambda: procs.http_status(router_url + "/health") == 200, timeout=30,
                             what="pd-router serving", child=router)
            connector = aiohttp.TCPConnector(limit=0)
            async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=300)) as s:
                urls = [h.url for h in fleet.workers]
                n = 0
                for inflight in args.inflight:
                    for mode in args.modes:
                        n += 1
                        result = await one_run(s, router_url, urls, mode, inflight, f"v{n}", args)
                        result["inflight_target"] = inflight
                        runs.append(result)
                        print(orjson.dumps(result).decode(), flush=True)
        finally:
            procs.stop(router)
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.weight_update", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--inflight", default="100,1000", help="requests in flight, comma-separated")
    parser.add_argument("--modes", default="direct,abort,drain")
    parser.add_argument("--decode-step-s", type=float, default=1.0, help="the simulated decode step")
    parser.add_argument("--max-new-tokens", type=int, default=4)
    parser.add_argument("--update-s", type=float, default=0.5, help="how long a server takes to load weights")
    parser.add_argument("--prefill", type=int, default=2)
    parser.add_argument("--decode", type=int, default=2)
    args = parser.parse_args(argv)
    args.inflight = [int(x) for x in args.inflight.split(",") if x]
    args.modes = [m for m in args.modes.split(",") if m]
    if not set(args.modes) <= {"direct", "abort", "drain"} or not args.inflight or min(args.inflight) < 1:
        parser.error("--modes takes direct, abort and drain; --inflight positive numbers")
    with tempfile.TemporaryDirectory(prefix="weight-update-bench-") as tmp:
        runs = asyncio.run(run(args, Path(tmp)))
    summary = summarize(runs)
    summary["load_average"] = [round(x, 2) for x in os.getloadavg()]
    print(orjson.dumps({"summary": summary}, option=orjson.OPT_INDENT_2).decode())
    routed_errors = sum(row["errors"].get(mode, 0) + row["mixed_version_answers"].get(mode, 0)
                        + row["old_weights_after_update"].get(mode, 0)
                        for key, row in summary.items() if key != "load_average" for mode in ("abort", "drain"))
    return 0 if routed_errors == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
