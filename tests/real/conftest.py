"""The real-server tier: real SGLang servers (CPU) started through server_patches, and pd-router in front of
them. Skipped unless `--real` (or env PDR_REAL=1; the switch is in tests/conftest.py). Needs the stack:
`python -m server_patches.install` (`.ci/real` does both).

One fleet per session (tests/real/fleet.py): a prefill+decode pair with the prefix cache on (the leak fix is
exercised on it), a spare decode server, and a regular server the reference answers come from, all started
at once. Tests that change roles put them back before they return; the fixtures below repair what a failed
test left. PDR_REAL_FLEET=RUN_DIR attaches to a fleet started with `python -m tests.real.fleet start`.

Every process started here is in its own process group, killed in teardown, and dies with pytest even if
pytest is killed (PR_SET_PDEATHSIG); a SIGTERM (CI's timeout) runs the teardown first.
"""

from __future__ import annotations

import os
import signal

import pytest

from server_patches.stack import is_installed, resolve_paths

from .fleet import RealFleet
from .real_client import convert, get_json, is_idle, live_role, post_json, wait_until
from .router_process import RouterProcess

# The router's flags in this tier: defaults, except a quieter health check (each 0.5.23 /health probe runs a
# one-token generation on every server) and no rebalancer (it would convert servers on its own).
ROUTER_ARGS = ("--health-check-interval-secs", "10", "--rebalance", "off")


# Run order: traces and attention DP first (servers of their own, stopped before the session fleet starts; attention
# DP is a skip on CPU), then the server-level tests, then the router's, cheapest and least disturbing first. Conversions come
# before aborts: after an aborted PD request a 0.5.23 decode server refuses to switch role for ~30 s.
# The refill test kills the prefill server: last, after any module this list does not name (one that ran
# after it found the prefill dead).
MODULE_ORDER = ("test_router_traces", "test_dp_attention", "test_pair", "test_convert_pd_role", "test_prefix_cache_leak",
                "test_router_generation", "test_router_conversion", "test_router_rebalancer", "test_router_control",
                "test_loads_vs_real", "test_bench_serving", "test_simulator_vs_real", "test_router_hostile")
RUNS_LAST = "test_router_refill"


# Per test, its fixtures included: the first test of the session waits for the fleet's servers to start.
REAL_TEST_TIMEOUT_S = 900


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(REAL_TEST_TIMEOUT_S))

    def rank(item):
        name = item.module.__name__.rsplit(".", 1)[-1] if item.module else ""
        if name == RUNS_LAST:
            return len(MODULE_ORDER) + 1
        return MODULE_ORDER.index(name) if name in MODULE_ORDER else len(MODULE_ORDER)

    items.sort(key=rank)  # stable: the order within a module is kept


def pytest_configure(config):
    # A SIGTERM (e.g. `timeout` in .ci/real) must tear the fixtures down, i.e. stop the servers, like Ctrl-C.
    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)


@pytest.fixture(scope="session")
def stack_paths():
    paths = resolve_paths()
    if not is_installed(paths):
        pytest.fail(f"no real-server stack at {paths.venv}: run `python -m server_patches.install`")
    return paths


@pytest.fixture(scope="session")
def fleet(stack_paths, tmp_path_factory):
    attach_to = os.environ.get("PDR_REAL_FLEET")
    if attach_to:
        yield RealFleet.attach(attach_to)
        return
    started = RealFleet.launch(paths=stack_paths, run_dir=tmp_path_factory.mktemp("fleet"))
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture(scope="session")
def pair(fleet):
    return fleet.pair()


def restore_launch_roles(servers_and_roles) -> None:
    for server, role in servers_and_roles:
        assert server.alive(), f"{role} server {server.url} died; log tail:\n{server.log_tail()}"
        if live_role(server.url) != role:
            status, answer = convert(server.url, {"check_idle": False, "idle_timeout_s": 120})
            assert status == 200 and live_role(server.url) == role, answer


@pytest.fixture
def pd_pair(pair):
    """The session pair as launched (prefill, decode): a role a failed test left converted is converted back."""
    restore_launch_roles(((pair.prefill, "prefill"), (pair.decode, "decode")))
    return pair


class RouterHolder:
    """The session's router process, restarted when a test left it out of line with the servers."""

    def __init__(self, fleet: RealFleet, log_dir) -> None:
        self.fleet = fleet
        self.log_dir = log_dir
        self.current: RouterProcess | None = None
        self.starts = 0

    def start(self) -> RouterProcess:
        self.stop()
        self.starts += 1
        f = self.fleet
        self.current = RouterProcess.start(
            prefill=[(f.prefill.url, f.prefill.bootstrap_port)], decode=[f.decode.url, f.spare.url],
            log_path=self.log_dir / f"router-{self.starts}.log", extra_args=ROUTER_ARGS)
        return self.current

    def in_line(self) -> bool:
        """Alive, every worker active, healthy and in its launch pool, and no fleet operation in force."""
        router = self.current
        if router is None or not router.alive():
            return False
        expected = {self.fleet.prefill.url: "prefill", self.fleet.decode.url: "decode",
                    self.fleet.spare.url: "decode"}
        workers = router.workers()
        ok = {w["url"]: w["role"] for w in workers if w["state"] == "active" and w["is_healthy"]} == expected
        state = get_json(f"{router.url}/weight_updates")
        return ok and not state["paused"] and not state["current"] and not state["left_out"]

    def stop(self) -> None:
        if self.current is not None:
            self.current.stop()
            self.current = None


@pytest.fixture(scope="session")
def router_holder(fleet, tmp_path_factory):
    holder = RouterHolder(fleet, tmp_path_factory.mktemp("router"))
    try:
        yield holder
    finally:
        holder.stop()


@pytest.fixture
def router(fleet, router_holder) -> RouterProcess:
    """pd-router in front of prefill, decode and spare (1P+2D), every server in its launch role and idle."""
    restore_launch_roles(((fleet.prefill, "prefill"), (fleet.decode, "decode"), (fleet.spare, "decode")))
    for server in fleet.pd_servers:
        wait_until(lambda: is_idle(server.url), timeout=60, what=f"{server.url} is idle")
    if not router_holder.in_line():
        for server in fleet.pd_servers:  # a failed pause test may have left servers paused
            assert post_json(server.url + "/continue_generation", {})[0] == 200
        router_holder.start()
    return router_holder.current
