"""How fast is the simulator? Requests/s of one worker process vs a trivial aiohttp endpoint, fleet start time.

    python -m bench.simulator_throughput [--duration 5] [--connections 64]

One server process (uvloop, as ``python -m simulator`` runs) hosts both a trivial aiohttp endpoint
(POST -> a small JSON answer: the baseline) and a simulated worker with zero delays; ``wrk`` loads
each in turn with the same connections and duration. Reported: requests/s of both and their ratio
(simulated / baseline), for a regular worker's ``/generate`` (8 tokens), and for PD pairs (prefill
and decode in one process, both legs sent by an asyncio client, which bounds that figure from below).
Then the time a 2 prefill + 2 decode fleet takes to answer ``/health`` on every worker, in-process
and with one process per worker.

On a shared machine wall-clock requests/s swing with other people's load, so the server's own CPU
time (user + system, from /proc) is measured too: ``*_cpu_rps`` is requests per CPU-second of the
server process, i.e. what one core sustains. Compare the ratios, which are measured in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import orjson

GENERATE = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 8}}
ROOT = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------ server side (child process)


async def _serve() -> None:
    from aiohttp import web

    from simulator import Fleet

    async def baseline(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=b'{"text":"ok","meta_info":{"id":"x"}}', content_type="application/json")

    app = web.Application()
    app.router.add_post("/generate", baseline)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, backlog=1024)
    await site.start()
    baseline_url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    async with Fleet(0, 1, decode_overrides={"role": "null", "bootstrap_port": None}, health_check_s=0.0) as single, \
            Fleet(1, 1, health_check_s=0.0) as pair:
        print(json.dumps({"pid": os.getpid(), "baseline": baseline_url, "worker": single.decode[0].url,
                          "prefill": pair.prefill[0].url, "prefill_bootstrap_port": pair.prefill[0].bootstrap_port,
                          "decode": pair.decode[0].url}), flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the parent closes stdin
    await runner.cleanup()


# ------------------------------------------------------------------ load


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wrk(url: str, body: dict, connections: int, duration: float) -> tuple[int, float]:
    """(requests, seconds) from wrk (one thread) posting ``body``; non-2xx answers are failures."""
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as script:
        script.write(
            'wrk.method = "POST"\nwrk.body = [==[' + json.dumps(body) + ']==]\n'
            'wrk.headers["Content-Type"] = "application/json"\n'
            'done = function(s, l, r) io.write(string.format("RESULT %d %d %d\\n", s.requests, s.duration,'
            ' s.errors.status + s.errors.connect + s.errors.read + s.errors.write + s.errors.timeout)) end\n')
    try:
        out = subprocess.run(["wrk", "-t1", f"-c{connections}", f"-d{max(1, round(duration))}s", "-s", script.name, url],
                             capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(script.name)
    line = next(l for l in out.splitlines() if l.startswith("RESULT "))
    requests, duration_us, errors = (int(x) for x in line.split()[1:])
    if errors:
        raise RuntimeError(f"{errors} failed requests against {url}:\n{out}")
    return requests, duration_us / 1e6


def measured(pid: int, run) -> tuple[float, float]:
    """(requests per wall second, requests per CPU second of the server) for one load run."""
    cpu0 = cpu_seconds(pid)
    requests, seconds = run()
    cpu = max(cpu_seconds(pid) - cpu0, 1e-9)
    return requests / seconds, requests / cpu


async def pd_load(ports: dict, connections: int, duration: float) -> tuple[int, float]:
    """PD requests/s: each client sends both legs (same body, fresh room) and waits for both."""
    prefill, decode = ports["prefill"] + "/generate", ports["decode"] + "/generate"
    done = 0
    stop_at = time.monotonic() + duration
    headers = {"Content-Type": "application/json"}

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal done
        while time.monotonic() < stop_at:
            body = dict(GENERATE, bootstrap_host="127.0.0.1", bootstrap_port=ports["prefill_bootstrap_port"],
                        bootstrap_room=random.getrandbits(62))
            data = orjson.dumps(body)

            async def leg(url: str) -> None:
                async with session.post(url, data=data, headers=headers) as r:
                    await r.read()
                    if r.status != 200:
                        raise RuntimeError(f"{url}: {r.status}")

            await asyncio.gather(leg(prefill), leg(decode))
            done += 1

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        started = time.monotonic()
        await asyncio.gather(*(client(session) for _ in range(connections)))
        return done, time.monotonic() - started


async def fleet_start_s(processes: bool) -> float:
    """Seconds until a fresh 2P+2D fleet answers /health on every worker."""
    from simulator import Fleet

    started = time.perf_counter()
    async with Fleet(2, 2, processes=processes, health_check_s=0.0) as fleet:
        async with aiohttp.ClientSession() as session:
            for url in fleet.prefill_urls + fleet.decode_urls:
                async with session.get(url + "/health") as r:
                    assert r.status == 200
        return time.perf_counter() - started


# ------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        import uvloop

        uvloop.install()
        asyncio.run(_serve())
        return
    if shutil.which("wrk") is None:
        sys.exit("wrk is not installed (apt-get install wrk)")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    server = subprocess.Popen([sys.executable, "-m", "bench.simulator_throughput", "--serve"], cwd=ROOT, env=env,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        urls = json.loads(server.stdout.readline())  # type: ignore[union-attr]
        pid, d, c = urls["pid"], args.duration, args.connections
        wrk(urls["baseline"] + "/generate", GENERATE, c, 1.0)  # warm-up
        wrk(urls["worker"] + "/generate", GENERATE, c, 1.0)
        baseline, baseline_cpu = measured(pid, lambda: wrk(urls["baseline"] + "/generate", GENERATE, c, d))
        simulated, simulated_cpu = measured(pid, lambda: wrk(urls["worker"] + "/generate", GENERATE, c, d))
        pd, pd_cpu = measured(pid, lambda: asyncio.run(pd_load(urls, c, d)))
        trivial_pd = {"prefill": urls["baseline"], "decode": urls["baseline"], "prefill_bootstrap_port": 0}
        pd_baseline, pd_baseline_cpu = measured(pid, lambda: asyncio.run(pd_load(trivial_pd, c, d)))
    finally:
        server.stdin.close()  # type: ignore[union-attr]
        server.wait(timeout=10)
        server.stdout.close()  # type: ignore[union-attr]
    start_local = asyncio.run(fleet_start_s(False))
    start_procs = asyncio.run(fleet_start_s(True))
    report = {
        "generate_rps": round(simulated), "baseline_rps": round(baseline),
        "generate_vs_baseline": round(simulated / baseline, 3),
        "generate_cpu_rps": round(simulated_cpu), "baseline_cpu_rps": round(baseline_cpu),
        "generate_vs_baseline_cpu": round(simulated_cpu / baseline_cpu, 3),
        "pd_rps": round(pd), "pd_baseline_rps": round(pd_baseline), "pd_vs_baseline": round(pd / pd_baseline, 3),
        "pd_cpu_rps": round(pd_cpu), "pd_baseline_cpu_rps": round(pd_baseline_cpu),
        "fleet_2p2d_start_s": round(start_local, 3), "fleet_2p2d_processes_start_s": round(start_procs, 3),
        "connections": c, "duration_s": d, "load_average_1m": os.getloadavg()[0],
    }
    print(json.dumps(report))
    print(f"simulated /generate: {simulated:.0f} req/s = {simulated / baseline:.2f} x trivial aiohttp "
          f"({baseline:.0f} req/s), one process, wrk -c{c}")
    print(f"  per server CPU-second: {simulated_cpu:.0f} vs {baseline_cpu:.0f} "
          f"(= {simulated_cpu / baseline_cpu:.2f} x; what one core sustains)")
    print(f"simulated PD pairs (prefill + decode + KV pull in one process): {pd:.0f} req/s = "
          f"{pd / pd_baseline:.2f} x the same client on the trivial endpoint ({pd_baseline:.0f} pairs/s); "
          f"{pd_cpu:.0f} pairs per server CPU-second")
    print(f"2P+2D fleet healthy in {start_local:.3f} s in-process, {start_procs:.3f} s as 4 processes "
          f"(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)")


if __name__ == "__main__":
    main()
