"""The test tiers, and the guard that keeps each module in its own.

    unit        pure code: no network socket, no process (`pytest -m unit`: well under a minute)
    inprocess   real HTTP on loopback inside the test process: routers, simulated servers, etcd's client
                against a server the session started (`pytest -m inprocess`)
    process     starts processes: the router as a command, etcd, a browser, a load generator, mkdocs
                (`pytest -m process`)

`pytest -q` (the README's test command, CI's fast tier) runs all three. A module is in the tier `TIERS` names
(in-process when it names none); while one of its tests runs, what its tier forbids raises `TierViolation`: a
unit test that opens a socket, an in-process test that starts a process. So the tiers stay what they say
(modules and session fixtures set up before the test's own fixtures are not watched: a session-scoped etcd
serves in-process tests). The real-server tier (`tests/real`, `--real`) is apart.
"""

from __future__ import annotations

import socket
import subprocess

UNIT, INPROCESS, PROCESS = "unit", "inprocess", "process"
TIER_NAMES = (UNIT, INPROCESS, PROCESS)

# module path (from the checkout's root) -> its tier, where it is not the in-process default
TIERS: dict[str, str] = {
    "tests/test_tiers.py": UNIT,
    "tests/bench/test_bench_conversion.py": UNIT,
    "tests/bench/test_bench_report.py": UNIT,
    "tests/bench/test_charts.py": UNIT,
    "tests/cluster/test_cluster_records.py": UNIT,
    "tests/test_admission_shutdown.py": UNIT,
    "tests/test_cli.py": UNIT,
    "tests/test_cli_peers.py": UNIT,
    "tests/test_config_model.py": UNIT,
    "tests/test_deploy_grafana.py": UNIT,
    "tests/test_composition.py": UNIT,
    "tests/test_docs_autopilot.py": UNIT,
    "tests/test_docs_generated.py": UNIT,
    "tests/test_fleet_model.py": UNIT,
    "tests/test_flows_layer.py": UNIT,
    "tests/test_health_rules.py": UNIT,
    "tests/test_layout.py": UNIT,
    "tests/test_ownership.py": UNIT,
    "tests/test_loadtest_workload.py": UNIT,
    "tests/test_no_gevent_in_pytest.py": UNIT,
    "tests/test_peers_reference.py": UNIT,
    "tests/test_policies.py": UNIT,
    "tests/test_reabort.py": UNIT,
    "tests/test_readme.py": UNIT,
    "tests/test_rebalance.py": UNIT,
    "tests/test_rebalance_signals.py": UNIT,
    "tests/test_rebalancer.py": UNIT,
    "tests/test_rl_selector.py": UNIT,
    "tests/test_routability.py": UNIT,
    "tests/test_server_patches_contract.py": UNIT,
    "tests/test_server_patches_runtime.py": UNIT,
    "tests/test_simulator_tokens.py": UNIT,
    "tests/test_traffic_control.py": UNIT,
    "tests/bench/test_bench_ceiling.py": PROCESS,
    "tests/bench/test_bench_cluster.py": PROCESS,
    "tests/bench/test_bench_etcd.py": PROCESS,
    "tests/bench/test_bench_routers_smoke.py": PROCESS,
    "tests/bench/test_bench_simfleet.py": PROCESS,
    "tests/bench/test_bench_variants.py": PROCESS,
    "tests/cluster/test_discovery_etcd.py": PROCESS,
    "tests/cluster/test_discovery_etcd_routers.py": PROCESS,
    "tests/cluster/test_etcd_client.py": PROCESS,
    "tests/cluster/test_etcd_lease.py": PROCESS,
    "tests/cluster/test_etcd_process.py": PROCESS,
    "tests/cluster/test_etcd_watch.py": PROCESS,
    "tests/cluster/test_replicas.py": PROCESS,
    "tests/cluster/test_replicas_chaos.py": PROCESS,
    "tests/cluster/test_replicas_e2e.py": PROCESS,
    "tests/cluster/test_replicas_lease_loss.py": PROCESS,
    "tests/cluster/test_replicas_on_one_host.py": PROCESS,
    "tests/cluster/test_replicas_random_ops.py": PROCESS,
    "tests/cluster/test_replicas_rebalancer.py": PROCESS,
    "tests/cluster/test_replicas_removals.py": PROCESS,
    "tests/hostile/test_self_registration.py": PROCESS,
    "tests/hostile/test_wire.py": PROCESS,
    "tests/test_cli_defaults.py": PROCESS,
    "tests/test_cli_help.py": PROCESS,
    "tests/test_cli_peers_process.py": PROCESS,
    "tests/test_connection_timeouts.py": PROCESS,
    "tests/test_ctl.py": PROCESS,
    "tests/test_demo.py": PROCESS,
    "tests/test_deploy_etcd.py": PROCESS,
    "tests/test_deploy_image.py": PROCESS,
    "tests/test_deploy_kubernetes.py": PROCESS,
    "tests/test_deploy_pod_discovery.py": PROCESS,
    "tests/test_discovery_file_process.py": PROCESS,
    "tests/test_docs_site.py": PROCESS,
    "tests/test_dp_aware.py": PROCESS,
    "tests/test_e2e_router_sim.py": PROCESS,
    "tests/test_exposure.py": PROCESS,
    "tests/test_failures.py": PROCESS,
    "tests/test_harness_processes.py": PROCESS,
    "tests/test_kubernetes_pods_process.py": PROCESS,
    "tests/test_loadtest.py": PROCESS,
    "tests/test_pd_admission.py": PROCESS,
    "tests/test_policies_peers.py": PROCESS,
    "tests/test_probes.py": PROCESS,
    "tests/test_rebalancer_sim.py": PROCESS,
    "tests/test_refill_e2e.py": PROCESS,
    "tests/test_remove_unhealthy.py": PROCESS,
    "tests/test_replicas.py": PROCESS,
    "tests/test_restart_e2e.py": PROCESS,
    "tests/test_rollout_burst.py": PROCESS,
    "tests/test_serving.py": PROCESS,
    "tests/test_shutdown.py": PROCESS,
    "tests/test_simulator_faults.py": PROCESS,
    "tests/test_simulator_fleet.py": PROCESS,
    "tests/test_supervisor.py": PROCESS,
    "tests/test_tls_serving.py": PROCESS,
    "tests/test_tracing.py": PROCESS,
    "tests/test_weights_stale_cache.py": PROCESS,
    "tests/test_worker_tls.py": PROCESS,
}


class TierViolation(AssertionError):
    pass


def tier_of(module_path: str) -> str:
    return TIERS.get(module_path, INPROCESS)


class TierGuard:
    """While entered: a unit test may not open a socket (connect or bind) and an in-process test may not start
    a process; each raises `TierViolation` naming the tier and how to move the module."""

    def __init__(self, tier: str, module_path: str) -> None:
        self.tier = tier
        self.module_path = module_path
        self._undo: list = []

    def _forbid(self, owner, name: str, what: str) -> None:
        original = getattr(owner, name)
        tier, module = self.tier, self.module_path

        def forbidden(*args, **kwargs):
            raise TierViolation(f"{module} is in the {tier} tier, which may not {what}: put it in a higher tier "
                                f"(tests/tiers.py: TIERS)")
        setattr(owner, name, forbidden)
        self._undo.append((owner, name, original))

    def __enter__(self) -> TierGuard:
        if self.tier == UNIT:
            for name in ("connect", "connect_ex", "bind"):
                self._forbid(socket.socket, name, "open a network socket")
        if self.tier in (UNIT, INPROCESS):
            self._forbid(subprocess.Popen, "__init__", "start a process")
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)
        self._undo.clear()
