"""Load from `wrk` (one thread, N keep-alive connections) posting a fixed /generate body; results as a dict."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import orjson

from bench.workload import GENERATE_REQUEST

RESULT_MARKER = "BENCH_RESULT "

# done() runs once after the run: print one JSON line the harness can parse (latency in microseconds).
LUA_TEMPLATE = """
wrk.method = "POST"
wrk.body = {body}
wrk.headers["Content-Type"] = "application/json"

done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    '{marker}{{"requests":%d,"duration_us":%d,"bytes":%d,"connect":%d,"read":%d,"write":%d,' ..
    '"status":%d,"timeout":%d,"p50_us":%d,"p90_us":%d,"p99_us":%d,"max_us":%d,"mean_us":%f}}\\n',
    summary.requests, summary.duration, summary.bytes, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.max, latency.mean))
end
"""


def _lua_string(text: str) -> str:
    return "[==[" + text + "]==]"


def write_script(path: Path, body: dict | None = None) -> Path:
    payload = orjson.dumps(body if body is not None else GENERATE_REQUEST).decode()
    path.write_text(LUA_TEMPLATE.format(body=_lua_string(payload), marker=RESULT_MARKER))
    return path


def parse_output(stdout: str) -> dict:
    """The BENCH_RESULT line of a wrk run, turned into the harness's result fields."""
    for line in stdout.splitlines():
        if line.startswith(RESULT_MARKER):
            raw = orjson.loads(line[len(RESULT_MARKER):])
            break
    else:
        raise ValueError(f"wrk printed no result line:\n{stdout[-2000:]}")
    seconds = raw["duration_us"] / 1e6
    errors = raw["connect"] + raw["read"] + raw["write"] + raw["status"] + raw["timeout"]
    return {
        "requests": raw["requests"],
        "errors": errors,
        "error_kinds": {k: raw[k] for k in ("connect", "read", "write", "status", "timeout") if raw[k]},
        "seconds": seconds,
        "rps": (raw["requests"] - raw["status"]) / seconds if seconds else 0.0,
        "p50_ms": raw["p50_us"] / 1000,
        "p90_ms": raw["p90_us"] / 1000,
        "p99_ms": raw["p99_us"] / 1000,
        "max_ms": raw["max_us"] / 1000,
        "mean_ms": raw["mean_us"] / 1000,
    }


def run(url: str, *, script: Path, connections: int, duration: float, timeout_s: float = 10.0,
        threads: int = 1) -> dict:
    """Run wrk against url (the full /generate URL) and return its parsed result."""
    wrk = shutil.which("wrk")
    if wrk is None:
        raise RuntimeError("wrk is not installed: run `python -m bench.setup`")
    argv = [wrk, "-t", str(threads), "-c", str(connections), "-d", f"{max(1, round(duration))}s",
            "--timeout", f"{timeout_s:g}s", "-s", str(script), url]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=duration + timeout_s + 30)
    if done.returncode != 0:
        raise RuntimeError(f"wrk failed ({done.returncode}): {done.stderr[-2000:]}")
    return parse_output(done.stdout)
