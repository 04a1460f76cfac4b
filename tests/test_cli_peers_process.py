"""The peers' PD command lines start pd-router unchanged (only the command's name and the address differ) and
serve; a flag of a feature pd-router lacks ends the process with status 2 and one line. Real router processes
in front of one simulated 3P+2D fleet, shared: every command line of a test runs at once."""

from __future__ import annotations

import asyncio
import os
import sys

import aiohttp
import pytest

from simulator.fleet import Fleet

from .helpers import free_port, wait_for
from .router_process import REPO
from .sim_support import FAST

# sglang_router/launch_router.py's and smg/launch_router.py's --help examples (identical in both), PD ones.
EXAMPLES = {
    "same policy for both": "--pd-disaggregation --prefill http://prefill1:8000 9000 --prefill http://prefill2:8000 "
                            "--decode http://decode1:8001 --decode http://decode2:8001 --policy cache_aware",
    "optional bootstrap ports": "--pd-disaggregation --prefill http://prefill1:8000 9000 --prefill "
                                "http://prefill2:8000 none --prefill http://prefill3:8000 --decode http://decode1:8001 "
                                "--decode http://decode2:8001",
    "different policies": "--pd-disaggregation --prefill http://prefill1:8000 --prefill http://prefill2:8000 "
                          "--decode http://decode1:8001 --decode http://decode2:8001 "
                          "--prefill-policy cache_aware --decode-policy power_of_two",
    # an SMG operator's line: the peers' spellings of pd-router's settings, their values, parts pd-router
    # does not need (accepted, one warning line)
    "SMG spellings": "--pd-disaggregation --prefill http://prefill1:8000 9000 --decode http://decode1:8001 "
                     "--policy least_load --log-level warn --max-concurrent-requests -1 --queue-size 100 "
                     "--shutdown-grace-period-secs 180 --load-monitor-interval 10 --cache-match-threshold 0.3 "
                     "--spill-abs-threshold 64 --spill-rel-threshold 1.5 --worker-warmup-secs 60 --upstream-http2 "
                     "--backend sglang --history-backend memory --enable-rl",
}


@pytest.fixture
async def fleet():
    async with Fleet(3, 2, **FAST) as f:
        yield f


def _on(fleet: Fleet, line: str) -> list[str]:
    """The example with its hosts replaced by the fleet's servers (and 9000 by prefill1's bootstrap port)."""
    names = {f"http://prefill{i + 1}:8000": h.url for i, h in enumerate(fleet.prefill)}
    names |= {f"http://decode{i + 1}:8001": h.url for i, h in enumerate(fleet.decode)}
    argv = [names.get(token, token) for token in line.split()]
    return [str(fleet.prefill[0].bootstrap_port) if token == "9000" else token for token in argv]


async def _serves(argv: list[str], log_path) -> str:
    """Start `python -m router ARGV` on a free port, wait until it serves, send a few PD requests; its log."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "wb") as log:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "router", *argv, "--host", "127.0.0.1", "--port", str(port), cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=log, stderr=asyncio.subprocess.STDOUT)
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
                async def ready() -> bool:
                    assert proc.returncode is None, log_path.read_text()
                    try:
                        async with session.get(url + "/readiness") as resp:
                            return resp.status == 200
                    except aiohttp.ClientError:
                        return False

                # four routers start at once: a loaded machine takes its time (the deadline, not a sleep)
                await wait_for(ready, timeout=90, interval=0.1, message=f"{argv} to serve")
                if "none" in argv:
                    # "explicitly no bootstrap port": decode then uses its own default port, where this fleet's
                    # prefill listens not; what the example means is each prefill's port as the router holds it
                    async with session.get(url + "/workers") as resp:
                        ports = {w["url"]: w["bootstrap_port"] for w in (await resp.json())["workers"]
                                 if w["role"] == "prefill"}
                    given = [argv[i + 1] for i, token in enumerate(argv) if token == "--prefill"]
                    assert ports[given[0]] == int(argv[argv.index(given[0]) + 1])  # the port given
                    assert ports[given[1]] is None  # none
                    assert ports[given[2]] is not None  # no port: the server's own, read from it
                    return log_path.read_text()
                for i in range(6):  # random and power_of_two spread these over every pool member
                    async with session.post(url + "/generate", json={
                            "text": f"hello {i}", "sampling_params": {"max_new_tokens": 2}}) as resp:
                        body = await resp.json()
                        assert resp.status == 200, (argv, body)
                        assert body["meta_info"]["completion_tokens"] == 2
        finally:
            if proc.returncode is None:
                proc.terminate()
                await proc.wait()
    return log_path.read_text()


async def test_the_peers_pd_examples_start_unchanged_and_serve(fleet, tmp_path):
    lines = [_on(fleet, line) for line in EXAMPLES.values()]
    lines[-1] += ["--log-dir", str(tmp_path / "logs")]
    logs = await asyncio.gather(*(_serves(argv, tmp_path / f"{i}.log") for i, argv in enumerate(lines)))
    for log in logs:
        assert "Traceback" not in log and " ERROR " not in log, log
    smg = logs[-1]
    warnings = [line for line in smg.splitlines() if "accepted for compatibility, no effect" in line]
    assert len(warnings) == 1 and "--worker-warmup-secs" in warnings[0] and "--upstream-http2" in warnings[0]
    assert " INFO " not in smg.split("pd-router on", 1)[-1], "--log-level warn still logs INFO"
    assert warnings[0] in (tmp_path / "logs" / "pd-router.log").read_text()  # --log-dir: the same lines


def test_a_log_dir_that_cannot_be_written_exits_2(tmp_path, capsys):
    from router.__main__ import serve

    blocker = tmp_path / "file"
    blocker.write_text("")
    assert serve(["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2",
                  "--log-dir", str(blocker / "logs")]) == 2
    assert capsys.readouterr().err.startswith(f"pd-router: error: --log-dir {blocker / 'logs'}: ")


async def test_a_feature_pd_router_lacks_exits_2_with_one_line():
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "router", "--pd-disaggregation", "--prefill", "http://127.0.0.1:1", "--decode",
        "http://127.0.0.1:2", "--model-path", "/models/llama", cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 2 and out == b""
    assert err.decode().splitlines() == ["pd-router: error: --model-path: not supported: pd-router does not tokenize: "
                                         "the SGLang servers apply their own tokenizer and chat template"]
