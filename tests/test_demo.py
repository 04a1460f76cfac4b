"""The README's first command: scripts/demo.sh starts a simulated 2P+2D fleet and pd-router, converts a server
and updates the weights under load with `pd-router ctl`, and prints what happened; it says so truthfully and
fails when something failed."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from simulator.fleet import Fleet

from .router_process import RouterProcess
from .sim_support import FAST

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("curl") is None, reason="scripts/demo.sh waits for the router with curl")
def test_the_demo_converts_and_updates_under_load_and_says_what_happened():
    env = {**os.environ, "DEMO_SKIP_SETUP": "1", "DEMO_PYTHON": sys.executable}  # pd-router is installed here
    proc = subprocess.run(["bash", "scripts/demo.sh"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=180)
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-2000:]
    requests = re.search(r"^requests: (\d+) ok, (\d+) failed \((\d+) ended during the conversion, (\d+) during the "
                         r"weight update\)$", out, re.M)
    assert requests is not None, out
    ok, failed, during_conversion, during_update = map(int, requests.groups())
    assert ok > 50 and failed == 0 and during_conversion > 0 and during_update > 0
    roles = re.findall(r"^  (http://\S+)\s+(prefill|decode) -> (prefill|decode)(.*)$", out, re.M)
    assert sorted((before, after) for _, before, after, _ in roles) == [
        ("decode", "decode"), ("decode", "prefill"), ("prefill", "prefill"), ("prefill", "prefill")]
    assert [note.strip() for _, before, after, note in roles if before != after] == ["(converted under load)"]
    assert "weight version: default -> step-2 on every server" in out
    after_update = re.search(r"after the update: (\d+) of (\d+) on step-2", out)
    assert after_update is not None and after_update.group(1) == after_update.group(2) != "0"
    # the operations ran through pd-router ctl, and their steps were shown
    assert "$ pd-router ctl convert" in out and "$ pd-router ctl update-weights" in out
    assert re.search(r"^  switch\s+ok", out, re.M) and re.search(r"^  quiesce\s+ok", out, re.M)
    assert "(answered by the fleet on weight version step-2)" in out
    assert out.rstrip().endswith("demo: ok")


async def test_the_demo_fails_when_an_operation_fails(tmp_path):
    async with Fleet(2, 2, **FAST) as fleet:
        await fleet.set_faults(fleet.prefill[0], update_failure=True)  # held out after it; the rest serve
        async with RouterProcess(fleet, log_path=tmp_path / "router.log") as router:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "scripts/demo.py", "--router", router.url, "--phase-secs", "0.5", cwd=REPO,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
            raw, _ = await asyncio.wait_for(proc.communicate(), 120)
    out = raw.decode()
    assert proc.returncode == 1, out
    assert re.search(r"^requests: \d+ ok, 0 failed", out, re.M)  # the failed update left the fleet serving
    verdict = out.rstrip().splitlines()[-1]
    assert verdict.startswith("demo: FAILED:") and "pd-router ctl update-weights exited with 1" in verdict
    assert "weight version: default -> default, step-2 (the servers disagree)" in out


def test_the_readme_quick_start_runs_the_demo():
    readme = (REPO / "README.md").read_text()
    quick_start = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    assert re.findall(r"```bash\n(.*?)\n```", quick_start, re.S) == [
        "scripts/demo.sh", "scripts/setup.sh && .venv/bin/python -m pytest -q"]
    assert os.access(REPO / "scripts" / "demo.sh", os.X_OK)
