"""`python -m loadtest`: one short steady run end to end (fleet, router and locust as real processes), and a
run against failing servers that must fail."""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# Looked up, never imported: importing locust monkey-patches this whole pytest process with gevent (threads,
# sockets, locks), and a later test's threads then wait on gevent's hub for ever (tests/test_tracing's OTLP
# receiver hung the suite). locust runs in the processes `python -m loadtest` starts.
if importlib.util.find_spec("locust") is None:
    pytest.skip("the loadtest extra is not installed", allow_module_level=True)


def run_loadtest(out: Path, *args: str, timeout: float = 90) -> tuple[int, dict, str]:
    proc = subprocess.run([sys.executable, "-m", "loadtest", *args, "--out", str(out), "--json"], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
    return proc.returncode, summary, proc.stdout + proc.stderr


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_steady_scenario_passes_and_reports_locust_metrics(tmp_path):
    code, summary, output = run_loadtest(tmp_path, "steady", "--duration", "8", "--users", "4",
                                         "--prompt-tokens", "64:16", "--output-tokens", "16:4")
    assert code == 0, output
    assert summary["passed"] is True
    stats = summary["stats"]
    assert stats["ok"] > 10 and stats["errors"] == 0 and stats["aborted"] == 0
    assert stats["ttft_ms"]["p50"] is not None and stats["e2e_ms"]["p99"] >= stats["e2e_ms"]["p50"] > 0
    assert stats["requests_per_s"] > 0
    assert {c["name"] for c in summary["checks"] if c["passed"]} >= {"load flowed", "no failed requests"}
    records = (tmp_path / "records.jsonl").read_text().splitlines()
    assert len(records) == stats["requests"]
    # locust's own stats carry the custom request types, per route, with percentiles
    with open(tmp_path / "locust_stats.csv") as f:
        rows = {(r["Type"], r["Name"]): r for r in csv.DictReader(f)}
    for kind in ("POST", "TTFT", "ITL"):
        assert int(rows[(kind, "/generate stream")]["Request Count"]) > 0, rows.keys()
    assert int(rows[("POST", "/v1/chat/completions")]["Request Count"]) > 0
    assert rows[("TTFT", "/generate stream")]["99%"] != "N/A"
    # everything it started is gone
    stack = json.loads((tmp_path / "stack.json").read_text())
    pids = [stack["router"]["pid"], stack["fleet_pid"], *(w["pid"] for w in stack["workers"])]
    assert len(pids) == 6 and all(pids) and not any(pid_alive(pid) for pid in pids)


def test_failed_requests_fail_the_scenario(tmp_path):
    # every server refuses a third of its requests with a 400 that the router relays (not retryable)
    code, summary, output = run_loadtest(tmp_path, "steady", "--duration", "4", "--users", "4",
                                         "--output-tokens", "8", "--routes", "generate",
                                         "--faults", '{"error_rate": 0.3, "error_status": 400}')
    assert code == 1, output
    assert summary["passed"] is False
    assert summary["stats"]["errors"] > 0 and summary["stats"]["ok"] > 0
    failed = [c for c in summary["checks"] if not c["passed"]]
    assert [c["name"] for c in failed] == ["no failed requests"]
    assert "HTTP 400" in failed[0]["detail"]


def test_bad_arguments_are_refused_before_starting_anything(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "loadtest", "kill", "--prompt-tokens", "x", "--routes", "nope",
                           "--decode", "1", "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                          timeout=30, env={**os.environ})
    assert proc.returncode == 2
    assert "--prompt-tokens" in proc.stderr and "--routes" in proc.stderr
    assert "kill needs at least 2 decode" in proc.stderr
    assert not (tmp_path / "fleet.json").exists()
