"""`python -m bench.routers --variant NAME=ARGS`: pd-router with flags of its own, measured beside plain
pd-router in one run and compared with it (`--replicas 2`, a replica in a cluster with `{etcd}`)."""

import shutil
import subprocess
import sys

import orjson
import pytest

from bench import report
from bench.contenders import REPO_ROOT, contender, parse_variant, with_etcd
from bench.fleet import Fleet



def row(router, rps, p50, p99, *, cpu=None):
    return {"router": router, "mode": "non-stream", "concurrency": 64, "round": 1, "rps": rps, "p50_ms": p50,
            "p99_ms": p99, "errors": 0, "router_cpu_ms_per_req": cpu, "foreign_cores": 0.0, "load1_at_start": 0.0}


def test_a_variant_is_pd_router_with_its_flags_last():
    name, extra = parse_variant("x2=--replicas 2 --etcd-endpoints {etcd}")
    assert name == "x2" and extra == ("--replicas", "2", "--etcd-endpoints", "{etcd}")
    spec = contender("x2", variants={"x2": with_etcd(extra, "http://127.0.0.1:2379")})
    argv = spec.argv(Fleet(prefill=[("http://p:1", 9)], decode=["http://d:2"]), 8000, "random")
    assert argv[1:3] == ["-m", "router"]
    assert argv[-4:] == ["--replicas", "2", "--etcd-endpoints", "http://127.0.0.1:2379"]
    assert spec.replicas == 2 and contender("pd-router").replicas == 1
    for bad in ("x2", "=--replicas 2", "sgl-router=--x", "direct=--x"):
        with pytest.raises(ValueError):
            parse_variant(bad)


def test_a_variant_is_compared_with_plain_pd_router_and_the_peers():
    best = report.best_rows([row("pd-router", 1000, 10, 40, cpu=0.30), row("x2", 1500, 9, 44, cpu=0.33),
                             row("sgl-router", 1200, 8, 30, cpu=0.25)])
    got = {(r["router"], r["vs"]): r for r in report.ratios(best, variants=("x2",))}
    assert got[("x2", "pd-router")]["rps"] == 1.5 and got[("x2", "pd-router")]["cpu_per_req"] == 1.1
    assert got[("x2", "sgl-router")]["rps"] == 1.25
    assert ("sgl-router", "pd-router") not in got  # plain pd-router is a baseline of its variants only
    lines = report._summary(report.ratios(best, variants=("x2",)), "ceiling", ("x2",))
    assert any(line.startswith("x2 vs pd-router: req/s x1.5") for line in lines), lines


@pytest.mark.skipif(shutil.which("wrk") is None or shutil.which("nginx", path="/usr/sbin:/usr/bin") is None,
                    reason="nginx and wrk not installed (python -m bench.setup)")
def test_ceiling_run_with_a_two_replica_variant_and_a_cluster_variant(tmp_path):
    out = tmp_path / "result.json"
    done = subprocess.run(
        [sys.executable, "-m", "bench.routers", "--setup", "ceiling", "--routers", "pd-router",
         "--variant", "x2=--replicas 2", "--variant", "cluster=--etcd-endpoints {etcd} --cluster-name bench",
         "--concurrency", "8", "--duration", "1", "--warmup", "0",
         "--interleave", "--out", str(out)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = orjson.loads(out.read_text())
    best = {r["router"]: r for r in result["best"]}
    assert set(best) == {"direct", "pd-router", "x2", "cluster"}
    for name in ("x2", "cluster"):
        assert best[name]["errors"] == 0 and best[name]["rps"] > 0
        assert best[name]["router_cpu_ms_per_req"] > 0  # x2: the supervisor's whole tree is metered
        assert any(r["router"] == name and r["vs"] == "pd-router" for r in result["ratios"])
        assert f"{name} vs pd-router" in done.stdout
    assert result["variants"]["x2"] == ["--replicas", "2"]
    (etcd_flag, endpoint, *_) = result["variants"]["cluster"]  # {etcd}: the etcd this run started
    assert etcd_flag == "--etcd-endpoints" and endpoint.startswith("http://127.0.0.1:")
    assert "# etcd " in done.stdout
