"""Router-side overhead of live role conversions under load, and the client requests they failed.

    python -m bench.conversion_overhead [--conversions 4] [--modes drain,abort] [--api 0.5.23|convert]
                                        [--concurrency 12] [--role-switch-s 0.3] [--decode-step-s 0.01]
                                        [--chart docs/img/conversion.svg]

Starts a simulated fleet (2 prefill + 2 decode, one process each, plus one spare worker the router does not
know), pd-router in its own process, and closed-loop clients sending a mix of streaming and non-streaming
requests. While they run, one worker is converted back and forth (decode → prefill → decode ...) through
`POST /admin/workers/{id}/convert`.

Each conversion's record splits its time: emptying the worker (the drain/abort step), the server's own switch
(the answering switch call, timed by the router), and the rest — the router-side overhead (state changes,
idle polls, probing the switch API, reading the live role back, moving the worker). The baseline measured in
the same run: the same switch called directly on the idle spare worker, no router in between. Printed: one
JSON line per conversion, then a summary line with medians, the overhead as a ratio of the direct switch,
and the number of failed client requests (target 0). `--chart PATH` also draws each conversion's parts as an
SVG (bench/charts.py), beside the direct switch.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import aiohttp
import orjson

from bench import charts, procs

REPO_ROOT = Path(__file__).resolve().parents[1]
BODY = {"text": "the quick brown fox jumps over the lazy dog", "sampling_params": {"max_new_tokens": 16,
                                                                                 "temperature": 0}}


def answer_problem(status: int, raw: bytes, stream: bool) -> str | None:
    """Why a client would count this answer as failed (None: a normal, complete answer)."""
    if status != 200:
        return f"http_{status}"
    try:
        if stream:
            events = [b[6:] for b in raw.split(b"\n\n") if b.startswith(b"data: ")]
            if len(events) < 2 or events[-1] != b"[DONE]":
                return "stream_without_done"
            last = orjson.loads(events[-2])
        else:
            last = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return "bad_json"
    if "error" in last:
        return "stream_error"
    reason = (last.get("meta_info") or {}).get("finish_reason") or {}
    if reason.get("type") not in ("length", "stop"):
        return f"finish_{reason.get('type')}"
    return None


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize(records: list[dict], direct_switch_s: list[float], problems: Counter, completed: int) -> dict:
    """One summary from the conversion records and the direct (router-less) switch timings."""
    converted = [r for r in records if r.get("outcome") == "converted"]
    overhead = [r["overhead_s"] for r in converted]
    baseline = median(direct_switch_s)

    def ms(value: float | None) -> float | None:
        return None if value is None else round(value * 1000, 2)

    summary = {
        "conversions": len(records),
        "converted": len(converted),
        "total_ms_median": ms(median([r["duration_s"] for r in converted])),
        "empty_ms_median": ms(median([r["empty_s"] for r in converted])),
        "server_switch_ms_median": ms(median([r["server_switch_s"] for r in converted])),
        "overhead_ms_median": ms(median(overhead)),
        "overhead_ms_max": ms(max(overhead) if overhead else None),
        "direct_switch_ms_median": ms(baseline),
        # the router-side overhead relative to what the switch itself costs (same server, same run)
        "overhead_vs_direct_switch": round(median(overhead) / baseline, 3) if overhead and baseline else None,
        "client_requests": completed,
        "failed_requests": sum(problems.values()),
        "failure_kinds": dict(problems),
        # each conversion's parts, for the chart
        "steps_ms": [{"label": f"{r.get('mode')} {str(r.get('old_role', ''))[:1].upper()}>"
                               f"{str(r.get('new_role', ''))[:1].upper()}",
                      "empty": ms(r["empty_s"]), "switch": ms(r["server_switch_s"]), "router": ms(r["overhead_s"])}
                     for r in converted],
    }
    return summary


def chart(summary: dict) -> str:
    """Each conversion split into emptying the worker, the server's own switch and the router's part, in ms,
    beside the same switch called directly (no router): the router's part is the one to keep small."""
    steps = summary["steps_ms"]
    tallest = max([summary["direct_switch_ms_median"] or 0.0] + [v or 0.0 for step in steps for v in
                                                                 (step["empty"], step["switch"], step["router"])])
    return charts.grouped_bars(
        f"Live conversions under load: where the time goes (router-side median {summary['overhead_ms_median']} ms,"
        f" {summary['failed_requests']} failed requests)",
        [step["label"] for step in steps],
        {"emptying the worker": [step["empty"] for step in steps],
         "the server's switch": [step["switch"] for step in steps],
         "router-side": [step["router"] for step in steps],
         "direct switch, no router": [summary["direct_switch_ms_median"]] * len(steps)},
        unit=" ms", y_max=100.0 * max(1, math.ceil(tallest / 100)))  # round gridlines


class Clients:
    """Closed-loop clients until stopped; every answer is checked."""

    def __init__(self, url: str, concurrency: int) -> None:
        self.url = url
        self.concurrency = concurrency
        self.completed = 0
        self.problems: Counter = Counter()
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    async def _user(self, session: aiohttp.ClientSession, index: int) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            stream = (index + n) % 2 == 0
            try:
                async with session.post(self.url + "/generate", json={**BODY, "stream": stream}) as resp:
                    raw = await resp.read()
                    problem = answer_problem(resp.status, raw, stream)
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                problem = type(exc).__name__
            if problem:
                self.problems[problem] += 1
            self.completed += 1

    def start(self, session: aiohttp.ClientSession) -> None:
        self._tasks = [asyncio.ensure_future(self._user(session, i)) for i in range(self.concurrency)]

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)


async def direct_switches(session: aiohttp.ClientSession, url: str, api: str, count: int) -> list[float]:
    """Time the server's own switch: alternate the spare worker's role with direct calls."""
    timings = []
    role = "decode"
    for _ in range(count):
        if api == "0.5.23":
            path, body = "/pd_role_switch", {"new_role": role, "decode_cuda_graph_memory_gb": 0}
        else:
            path, body = "/convert_pd_role", {"server_url": url}
        started = time.perf_counter()
        async with session.post(url + path, json=body) as resp:
            answer = await resp.json()
        timings.append(time.perf_counter() - started)
        if resp.status != 200:
            raise RuntimeError(f"direct switch failed: {answer}")
        role = "prefill" if role == "decode" else "decode"
    return timings


async def worker_id(session: aiohttp.ClientSession, router: str, url: str) -> str:
    async with session.get(router + "/workers") as resp:
        listing = await resp.json()
    return next(w["id"] for w in listing["workers"] if w["url"] == url)


async def run(args: argparse.Namespace, workdir: Path) -> dict:
    from simulator.fleet import Fleet  # noqa: PLC0415 (the simulator is only needed when this runs)

    settings = dict(api=args.api, enable_pd_role_switch=True, role_switch_s=args.role_switch_s,
                    decode_step_s=args.decode_step_s, health_check_s=0.0, deferred_release_s=0.0)
    async with Fleet(2, 2, processes=True, **settings) as fleet, \
            Fleet(1, 0, processes=True, **settings) as spare:
        port = procs.free_port()
        router_url = f"http://127.0.0.1:{port}"
        argv = [sys.executable, "-m", "router", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
        for handle in fleet.prefill:
            argv += ["--prefill", handle.url, str(handle.bootstrap_port)]
        for handle in fleet.decode:
            argv += ["--decode", handle.url]
        router = procs.start("pd-router", argv, workdir, cwd=str(REPO_ROOT))
        try:
            procs.wait_until(lambda: procs.http_status(router_url + "/health") == 200, timeout=30,
                             what="pd-router serving", child=router)
            timeout = aiohttp.ClientTimeout(total=120)
            async with aiohttp.ClientSession(timeout=timeout) as session:
                direct = await direct_switches(session, spare.prefill[0].url, args.api, args.conversions * 2)
                target = fleet.decode[1]
                wid = await worker_id(session, router_url, target.url)
                clients = Clients(router_url, args.concurrency)
                clients.start(session)
                records = []
                try:
                    await asyncio.sleep(args.warmup)  # the fleet reaches its steady state under load
                    for mode in args.modes:
                        for _ in range(args.conversions):
                            async with session.post(f"{router_url}/admin/workers/{wid}/convert",
                                                    json={"mode": mode, "timeout_s": 60}) as resp:
                                record = await resp.json()
                            records.append(record)
                            print(orjson.dumps({k: record.get(k) for k in (
                                "id", "mode", "old_role", "new_role", "outcome", "duration_s", "empty_s",
                                "server_switch_s", "overhead_s", "message")}).decode(), flush=True)
                            if record.get("outcome") != "converted":
                                break
                finally:
                    await clients.stop()
        finally:
            procs.stop(router)
    return summarize(records, direct, clients.problems, clients.completed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.conversion_overhead", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversions", type=int, default=4, help="per mode (back and forth)")
    parser.add_argument("--modes", default="drain,abort")
    parser.add_argument("--api", choices=("0.5.23", "convert"), default="0.5.23")
    parser.add_argument("--concurrency", type=int, default=12)
    parser.add_argument("--role-switch-s", type=float, default=0.3, help="the simulated server's switch time")
    parser.add_argument("--decode-step-s", type=float, default=0.01)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--chart", type=Path, help="also write the conversions' parts as an SVG chart here")
    args = parser.parse_args(argv)
    args.modes = [m for m in args.modes.split(",") if m]
    if not set(args.modes) <= {"drain", "abort"} or args.conversions < 1:
        parser.error("--modes takes drain and/or abort; --conversions must be at least 1")
    with tempfile.TemporaryDirectory(prefix="conversion-bench-") as tmp:
        summary = asyncio.run(run(args, Path(tmp)))
    print(orjson.dumps({"summary": summary}).decode())
    if args.chart is not None:
        print(f"chart: {charts.write(args.chart, chart(summary))}")
    return 0 if summary["failed_requests"] == 0 and summary["converted"] == summary["conversions"] else 1


if __name__ == "__main__":
    sys.exit(main())
