"""`pd-router ctl` end to end: the command line as a real process against a running router (in this process,
on a loopback port, or as its own `pd-router` process) in front of a simulated fleet."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from router.flows.conversion import CONVERSIONS
from router.core.config import DpRanksConfig, LoadMonitorConfig, RouterConfig, WorkerSpec
from router.core.keys import REGISTRY
from router.dataplane.admission import ADMISSION
from router.core.registry import Role, WorkerState
from router.server.app import create_app
from simulator.fleet import Fleet

from .helpers import free_port, wait_for
from .sim_support import FAST

REPO = Path(__file__).resolve().parent.parent
KEY = "ctl-test-key"
BODY = {"text": "the quick brown fox", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
CTL_TIMEOUT_S = 60


@dataclass
class Result:
    rc: int
    out: str
    err: str

    def rows(self) -> list[list[str]]:
        """A table's rows, header first (cells hold no spaces in the tables these tests read)."""
        return [line.split() for line in self.out.splitlines() if line.strip()]

    def json(self):
        return json.loads(self.out)


def ctl_env(key: str | None = KEY, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PD_ROUTER_URL", "PD_ROUTER_ADMIN_API_KEY", "PD_ROUTER_API_KEY")}
    if key is not None:
        env["PD_ROUTER_ADMIN_API_KEY"] = key
    env.update(extra)
    return env


async def start_ctl(url: str, *args: str, env: dict | None = None,
                    command: tuple[str, ...] = (sys.executable, "-m", "router")) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        *command, "ctl", "--url", url, *args, cwd=REPO, env=ctl_env() if env is None else env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)


async def ctl(url: str, *args: str, **kw) -> Result:
    proc = await start_ctl(url, *args, **kw)
    out, err = await asyncio.wait_for(proc.communicate(), CTL_TIMEOUT_S)
    return Result(proc.returncode, out.decode(), err.decode())


async def read_until(proc: asyncio.subprocess.Process, seen: list[str], predicate) -> str:
    """Read the command's output line by line (kept in `seen`) until a line satisfies `predicate`."""
    while True:
        line = (await asyncio.wait_for(proc.stdout.readline(), CTL_TIMEOUT_S)).decode()
        assert line, f"the command ended first; its output: {''.join(seen)}"
        seen.append(line)
        if predicate(line):
            return line


@dataclass
class Stack:
    http: object  # the router's test client (its app is the router)
    fleet: Fleet
    url: str

    @property
    def registry(self):
        return self.http.app[REGISTRY]

    def worker(self, handle):
        return self.registry.get(handle.url)

    async def hold_request_on(self, handle) -> list[asyncio.Task]:
        """Requests through the router until one stays in flight on `handle` (its server stalls after a
        token); the others complete. Cancel the tasks to release it (the router then aborts its legs)."""
        await self.fleet.set_faults(handle, hang_after_tokens=1)
        tasks: list[asyncio.Task] = []
        while self.worker(handle).inflight == 0:
            tasks.append(asyncio.ensure_future(self.http.post("/generate", json=BODY)))
            await wait_for(lambda: self.worker(handle).inflight > 0 or tasks[-1].done(), timeout=10)
        return tasks


@pytest.fixture
async def stack(aiohttp_client):
    """`s = await stack(prefill=2, decode=2, **router_config)`: a simulated fleet and a router with KEY."""
    fleets: list[Fleet] = []

    async def build(prefill: int = 2, decode: int = 2, *, sim: dict | None = None, **router) -> Stack:
        fleet = await Fleet(prefill, decode, **{**FAST, **(sim or {})}).start()
        fleets.append(fleet)
        config = RouterConfig(prefill=tuple(WorkerSpec(h.url, h.bootstrap_port) for h in fleet.prefill),
                              decode=tuple(WorkerSpec(h.url) for h in fleet.decode),
                              **{"admin_api_key": KEY, **router}).validated()
        http = await aiohttp_client(create_app(config), server_kwargs={"handler_cancellation": True})
        return Stack(http, fleet, str(http.server.make_url("")).rstrip("/"))

    yield build
    for fleet in fleets:
        await fleet.stop()


# ---- seeing the fleet ---------------------------------------------------------------------------------------
async def test_workers_table_and_json(stack):
    s = await stack(2, 2)
    result = await ctl(s.url, "workers")
    assert result.rc == 0, result.err
    header, *rows = result.rows()[:5]
    assert header == ["ID", "URL", "ROLE", "STATE", "ROUTABLE", "HEALTHY", "BREAKER", "INFLIGHT", "BOOTSTRAP",
                      "VERSION", "RANKS"]
    shown = {row[1]: row for row in rows}
    for handle in s.fleet.prefill + s.fleet.decode:
        worker = s.worker(handle)
        port = str(handle.bootstrap_port) if handle.role == "prefill" else "-"
        assert shown[handle.url] == [worker.id, handle.url, handle.role, "active", "yes", "yes", "closed", "0",
                                     port, worker.weight_version, "-"]
    assert "4 workers: 2 prefill, 2 decode; 4 routable" in result.out
    # --json: the router's own listing, for scripts (the flag is accepted after the subcommand as well)
    listing = (await ctl(s.url, "workers", "--json")).json()
    assert sorted(w["url"] for w in listing["workers"]) == sorted(h.url for h in s.fleet.prefill + s.fleet.decode)


async def test_workers_shows_each_data_parallel_rank(stack):
    s = await stack(1, 1, sim={"dp_size": 2, "enable_dp_attention": True},
                    dp_ranks=DpRanksConfig(aware=True), load_monitor=LoadMonitorConfig(interval_secs=0.05))
    await wait_for(lambda: all(w.server_load is not None for w in s.http.app[REGISTRY].workers()))
    result = await ctl(s.url, "workers")
    assert result.rc == 0, result.err
    header, *rows = result.rows()[:3]
    assert all(row[header.index("RANKS")] == "0:0/0,1:0/0" for row in rows), result.out  # in flight / reported
    listing = (await ctl(s.url, "workers", "--json")).json()
    assert all(w["dp_ranks"] == 2 and [r["dp_rank"] for r in w["ranks"]] == [0, 1] for w in listing["workers"])


async def test_health_and_cluster_on_a_single_router(stack):
    s = await stack(1, 2)
    result = await ctl(s.url, "health")
    assert result.rc == 0, result.err
    assert result.out.startswith("router: ok")
    assert [row[:3] for row in result.rows()[1:4]] == [["POOL", "ROUTABLE", "TOTAL"], ["prefill", "1", "1"],
                                                        ["decode", "2", "2"]]
    cluster = await ctl(s.url, "cluster")
    assert (cluster.rc, cluster.out.strip()) == (0, "not a cluster: this router runs alone (no /admin/cluster)")
    assert (await ctl(s.url, "--json", "cluster")).json()["cluster"] is None


async def test_remove_and_add_a_worker_and_health_says_when_a_pool_is_empty(stack):
    s = await stack(1, 1)
    decode = s.fleet.decode[0]
    removed = await ctl(s.url, "remove", decode.url)
    assert removed.rc == 0, removed.err
    assert s.registry.find(decode.url) is None
    health = await ctl(s.url, "health")
    assert health.rc == 1
    assert health.out.startswith("router: unavailable")
    assert "no routable worker in pool(s): decode" in health.err
    added = await ctl(s.url, "add", decode.url, "--role", "decode")
    assert added.rc == 0, added.err
    worker = s.registry.get(decode.url)
    assert worker.role is Role.DECODE
    await wait_for(lambda: worker.routable)
    assert (await ctl(s.url, "health")).rc == 0
    again = await ctl(s.url, "add", decode.url, "--role", "decode")
    assert again.rc == 1 and "already registered" in again.err


# ---- role conversion, followed step by step -----------------------------------------------------------------
async def test_convert_shows_each_step_while_it_runs_then_the_outcome(stack):
    s = await stack(2, 2)
    target = s.fleet.decode[1]
    held = await s.hold_request_on(target)
    proc = await start_ctl(s.url, "convert", target.url, "--to", "prefill")
    seen: list[str] = []
    await read_until(proc, seen, lambda line: line.split()[:2] == ["drain", "running"])
    # The drain cannot end while the request is held: the line came while the conversion was running.
    (conversion,) = s.http.app[CONVERSIONS].running()
    assert conversion.state == "drain" and s.worker(target).state is WorkerState.DRAINING
    for task in held:
        task.cancel()
    out, err = await asyncio.wait_for(proc.communicate(), CTL_TIMEOUT_S)
    assert proc.returncode == 0, err.decode()
    lines = [line.split() for line in seen + out.decode().splitlines(keepends=True)]
    assert lines[0][:2] == ["converting", s.worker(target).id]
    assert "decode -> prefill" in seen[0] and f"conversion {conversion.id}" in seen[0]
    ended = [line[:2] for line in lines[1:] if len(line) > 1 and line[1] != "running"]
    assert ended[:3] == [["drain", "ok"], ["switch", "ok"], ["verify", "ok"]]
    assert lines[-1][:2] == ["converted:", target.url]
    worker = s.worker(target)
    assert (worker.role, worker.state, worker.bootstrap_port) == (Role.PREFILL, WorkerState.ACTIVE,
                                                                    target.bootstrap_port)
    # The same conversion again: nothing to do, exit 0; its record is in the history
    again = await ctl(s.url, "convert", worker.id, "--to", "prefill")
    assert again.rc == 0 and "already a prefill worker" in again.out
    history = await ctl(s.url, "operations")
    assert [conversion.id, "convert", "decode->prefill", target.url, "converted"] in [row[:5] for row in history.rows()]
    record = (await ctl(s.url, "--json", "operations", conversion.id)).json()
    assert [step["step"] for step in record["steps"]] == ["drain", "switch", "verify"]


async def test_a_refused_conversion_exits_1_with_the_routers_message(stack):
    s = await stack(1, 1)
    result = await ctl(s.url, "convert", s.fleet.decode[0].url, "--to", "prefill", "--mode", "abort")
    assert result.rc == 1
    assert "is the last routable decode worker" in result.err and "HTTP 409" in result.err
    unknown = await ctl(s.url, "convert", "http://127.0.0.1:1", "--to", "prefill")
    assert unknown.rc == 1 and "no worker 'http://127.0.0.1:1' is registered" in unknown.err


# ---- fleet-wide operations --------------------------------------------------------------------------------
async def test_update_weights_shows_its_steps_and_the_fleet_takes_the_version(stack):
    s = await stack(2, 2)
    held = await s.hold_request_on(s.fleet.decode[0])
    proc = await start_ctl(s.url, "update-weights", "--path", "sim/tiny-llama-v2", "--version", "v2")
    seen: list[str] = []
    await read_until(proc, seen, lambda line: line.split()[:2] == ["quiesce", "running"])
    assert not s.http.app[ADMISSION].is_open  # held while it waits for the request to end
    assert ["hold", "ok"] in [line.split()[:2] for line in seen]
    for task in held:
        task.cancel()
    out, err = await asyncio.wait_for(proc.communicate(), CTL_TIMEOUT_S)
    assert proc.returncode == 0, err.decode()
    lines = [line.split() for line in seen + out.decode().splitlines(keepends=True)]
    ended = [line[:2] for line in lines[1:] if len(line) > 1 and line[1] in ("ok", "failed", "timeout")]
    assert ended == [["hold", "ok"], ["quiesce", "ok"], ["update", "ok"], ["verify", "ok"]]
    assert lines[-1][:8] == ["updated:", "the", "fleet", "serves", "weight", "version", "v2", "(op1,"]
    assert {w.weight_version for w in s.registry.workers()} == {"v2"}
    assert s.http.app[ADMISSION].is_open
    # --json: SGLang's answer with each server's outcome
    answer = (await ctl(s.url, "--json", "update-weights", "--path", "sim/m", "--version", "v3", "--abort")).json()
    assert answer["success"] is True and answer["weight_version"] == "v3" and answer["update_id"] == "op2"
    assert sorted(w["url"] for w in answer["workers"]) == sorted(h.url for h in s.fleet.prefill + s.fleet.decode)


async def test_a_failed_update_exits_1_and_shows_which_server_failed(stack):
    s = await stack(1, 1)
    await s.fleet.set_faults(s.fleet.decode[0], update_failure=True)
    result = await ctl(s.url, "update-weights", "--path", "sim/m", "--version", "v2")
    assert result.rc == 1
    assert "update_weights_from_disk failed (HTTP 400)" in result.err
    outcomes = {row[0]: row[:4] for row in result.rows() if row[0].startswith("http")}
    assert outcomes[s.fleet.decode[0].url][2:4] == ["no", "400"]
    assert outcomes[s.fleet.prefill[0].url][2:4] == ["yes", "200"]


async def test_pause_and_continue(stack):
    s = await stack(1, 1)
    paused = await ctl(s.url, "pause", "--mode", "retract")
    assert paused.rc == 0, paused.err
    assert ["pause", "ok"] in [row[:2] for row in paused.rows()]
    assert paused.out.splitlines()[-1].startswith("paused (op1,")
    assert not s.http.app[ADMISSION].is_open
    history = await ctl(s.url, "operations")
    assert history.rows()[1] == ["paused:", "retract"]
    resumed = await ctl(s.url, "continue")
    assert resumed.rc == 0, resumed.err
    assert resumed.out.splitlines()[-1].startswith("continued (op2,")
    assert s.http.app[ADMISSION].is_open
    kinds = [row[:4] for row in (await ctl(s.url, "operations")).rows() if row[0].startswith("op")]
    assert kinds == [["op2", "continue_generation", "fleet", "succeeded"],
                     ["op1", "pause_generation", "fleet", "succeeded"]]
    aborted = await ctl(s.url, "abort", "--all")
    assert aborted.rc == 0 and "aborted every request" in aborted.out


# ---- exit codes -------------------------------------------------------------------------------------------
async def test_exit_codes_for_a_wrong_key_an_unreachable_router_and_bad_usage(stack):
    s = await stack(1, 1)
    wrong = await ctl(s.url, "workers", "--admin-key", "not-the-key")
    assert wrong.rc == 4 and "needs an admin API key" in wrong.err and wrong.out == ""
    missing = await ctl(s.url, "workers", env=ctl_env(key=None))
    assert missing.rc == 4
    nobody = f"http://127.0.0.1:{free_port()}"
    unreachable = await ctl(nobody, "workers")
    assert unreachable.rc == 3 and f"cannot reach the router at {nobody}" in unreachable.err
    assert (await ctl(s.url, "convert", s.fleet.decode[0].url)).rc == 2  # --to is required
    assert (await ctl(s.url, "no-such-command")).rc == 2
    assert (await ctl(s.url, "abort")).rc == 2  # --rid or --all


async def test_the_api_key_opens_admin_routes_when_the_router_has_no_admin_key(stack):
    s = await stack(1, 1, admin_api_key=None, api_key="general-key")
    result = await ctl(s.url, "workers", env=ctl_env(key=None, PD_ROUTER_API_KEY="general-key"))
    assert result.rc == 0, result.err
    # env PD_ROUTER_URL stands in for --url
    env = ctl_env(key=None, PD_ROUTER_API_KEY="general-key", PD_ROUTER_URL=s.url)
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "router", "ctl", "--json", "workers", cwd=REPO,
                                                env=env, stdout=asyncio.subprocess.PIPE)
    out, _ = await proc.communicate()
    assert proc.returncode == 0 and json.loads(out)["total"] == 2


# ---- the console script: serving and ctl -------------------------------------------------------------------
async def test_pd_router_serves_as_before_and_its_ctl_reads_it():
    """`pd-router` with launch flags serves (ctl is only a first-argument subcommand); `pd-router ctl` on the
    same console script talks to it."""
    script = Path(sys.executable).with_name("pd-router")
    if not script.exists():
        pytest.skip("the pd-router console script is not installed next to this Python")
    async with Fleet(1, 1, **FAST) as fleet:
        port = free_port()
        flags = ["--pd-disaggregation", "--prefill", fleet.prefill[0].url, str(fleet.prefill[0].bootstrap_port),
                 "--decode", fleet.decode[0].url, "--host", "127.0.0.1", "--port", str(port)]
        router = await asyncio.create_subprocess_exec(
            str(script), *flags, env={**ctl_env(key=None), "PD_ROUTER_ADMIN_API_KEY": KEY},
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        try:
            async def ready() -> bool:
                return (await ctl(url, "health", command=(str(script),))).rc == 0

            await wait_for(ready, timeout=30, interval=0.2, message="the router to serve")
            result = await ctl(url, "workers", command=(str(script),))
            assert result.rc == 0, result.err
            assert {row[1] for row in result.rows()[1:3]} == {fleet.prefill[0].url, fleet.decode[0].url}
            assert (await ctl(url, "workers", "--admin-key", "wrong", command=(str(script),))).rc == 4
        finally:
            router.send_signal(signal.SIGINT)  # Ctrl-C: the router shuts down cleanly
            assert await asyncio.wait_for(router.wait(), 30) == 0


def test_ctl_help_does_not_load_the_server():
    """`pd-router ctl` imports nothing of the server (aiohttp, the app), so it answers fast; `pd-router --help`
    points to it."""
    probe = ("import sys\nfrom router.__main__ import main\ntry:\n    main(['ctl', '--help'])\nexcept SystemExit as e:\n"
             "    assert e.code == 0\nloaded = sorted(m for m in sys.modules if m.split('.')[0] == 'aiohttp'"
             " or m.startswith('router.server'))\nprint('LOADED', loaded)")
    proc = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "Exit codes: 0 ok; 1 the operation failed" in proc.stdout
    assert proc.stdout.splitlines()[-1] == "LOADED []"
    server_help = subprocess.run([sys.executable, "-m", "router", "--help"], cwd=REPO, capture_output=True, text=True,
                                 timeout=60)
    assert server_help.returncode == 0 and "pd-router ctl --help" in server_help.stdout
