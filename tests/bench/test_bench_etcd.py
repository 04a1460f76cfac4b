"""bench.etcd_client: its summary arithmetic, and one tiny run against a real etcd."""

from bench.etcd_client import main, summarize

from tests.cluster.conftest import require_etcd_binary


def test_summary_gives_percentiles_cpu_and_the_ratio_to_the_health_baseline():
    samples = {"health_get": [0.001, 0.002, 0.003], "put": [0.004, 0.006, 0.100]}
    rows = {row["op"]: row for row in summarize(samples, {"health_get": 0.0003, "put": 0.0006})}
    assert rows["health_get"]["p50_vs_health"] == 1.0 and rows["health_get"]["p50_ms"] == 2.0
    assert rows["put"]["p50_ms"] == 6.0 and rows["put"]["p99_ms"] == 100.0 and rows["put"]["p50_vs_health"] == 3.0
    assert rows["put"]["cpu_us_per_call"] == 200.0 and rows["put"]["calls"] == 3


def test_a_tiny_run_measures_every_operation(capsys):
    require_etcd_binary()
    assert main(["--ops", "8", "--rounds", "2", "--concurrency", "2", "--no-fsync"]) == 0
    printed = capsys.readouterr().out
    for op in ("health_get", "raw_range", "get", "put", "create", "replace", "keep_alive", "watch_delivery"):
        assert f'"op":"{op}"' in printed
    assert "2 callers: put" in printed
