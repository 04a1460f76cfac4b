"""The peers' probe and fleet-reading routes: /liveness, /readiness, /get_loads, /engine_metrics (issue 23),
against a simulated 1P+1D fleet (SGLang's /metrics and /v1/loads)."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from router.api.probes import merge_metrics
from router.core.config import HealthConfig
from simulator.fleet import Fleet

from .helpers import wait_for
from .sim_support import FAST

HEALTH = HealthConfig(interval_secs=0.05, timeout_secs=0.5, failure_threshold=1, success_threshold=1)


@pytest.fixture
async def fleet():
    async with Fleet(1, 1, processes=True, enable_metrics=True, **FAST) as f:  # kill(): SIGKILL
        yield f


async def test_probes_loads_and_engine_metrics_as_workers_die(fleet, make_router):
    """One fleet for the three routes (its start is most of the cost): all up, the decode SIGKILLed, then the
    prefill too."""
    router = await make_router(fleet.prefill, fleet.decode, health=HEALTH)
    prefill, decode = fleet.prefill[0].url, fleet.decode[0].url
    resp = await router.get("/liveness")
    assert resp.status == 200 and await resp.text() == "OK"
    resp = await router.get("/readiness")
    assert resp.status == 200
    assert await resp.json() == {"status": "ready", "healthy_workers": 2, "total_workers": 2, "prefill": 1,
                                 "decode": 1}

    resp = await router.get("/get_loads")
    assert resp.status == 200
    rows = {row["worker"]: row for row in (await resp.json())["workers"]}
    assert set(rows) == {prefill, decode}
    for row in rows.values():
        assert row["load"] >= 0 and row["running"] == 0 and row["details"]["mode"] in ("prefill", "decode")
    assert rows[prefill]["role"] == "prefill" and rows[decode]["role"] == "decode"

    resp = await router.get("/engine_metrics")
    assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
    text = await resp.text()
    families = list(text_string_to_metric_families(text))  # a valid exposition
    running = next(f for f in families if f.name == "sglang:num_running_reqs")
    assert {s.labels["worker_addr"] for s in running.samples} == {prefill, decode}
    assert all("model_name" in s.labels for s in running.samples)  # the workers' own labels are kept
    assert text.count("# TYPE sglang:num_running_reqs ") == 1

    fleet.kill(fleet.decode[0])

    async def not_ready():
        resp = await router.get("/readiness")
        return resp.status == 503 and (await resp.json())["reason"] == "insufficient healthy workers"

    await wait_for(not_ready, timeout=10, message="readiness to fail without a decode")
    body = await (await router.get("/readiness")).json()
    assert body["decode"] == 0 and body["error"]["code"] == 503 and "decode" in body["error"]["message"]
    assert (await router.get("/liveness")).status == 200  # the process still runs: no restart
    rows = {row["worker"]: row for row in (await (await router.get("/get_loads")).json())["workers"]}
    assert rows[decode]["load"] == -1 and "details" not in rows[decode] and rows[prefill]["load"] >= 0
    text = await (await router.get("/engine_metrics")).text()
    assert prefill in text and decode not in text

    fleet.kill(fleet.prefill[0])
    resp = await router.get("/engine_metrics")
    assert resp.status == 503 and "no worker answered /metrics" in (await resp.json())["error"]["message"]


def test_merge_keeps_a_family_together_and_escapes_the_label():
    a = "# HELP x_seconds x\n# TYPE x_seconds histogram\nx_seconds_bucket{le=\"1\"} 1\nx_seconds_count 1\nup 1\n"
    b = "# TYPE x_seconds histogram\nx_seconds_bucket{le=\"1\"} 2\nx_seconds_count 2\nup 0\n"
    merged = merge_metrics([("http://a:1", a), ('http://b:2/"q"', b)])
    lines = merged.splitlines()
    assert lines[:2] == ["# HELP x_seconds x", "# TYPE x_seconds histogram"]
    assert lines[2:6] == ['x_seconds_bucket{worker_addr="http://a:1",le="1"} 1',
                          'x_seconds_count{worker_addr="http://a:1"} 1',
                          'x_seconds_bucket{worker_addr="http://b:2/\\"q\\"",le="1"} 2',
                          'x_seconds_count{worker_addr="http://b:2/\\"q\\""} 2']
    assert lines[6:] == ['up{worker_addr="http://a:1"} 1', 'up{worker_addr="http://b:2/\\"q\\""} 0']
    histogram = next(f for f in text_string_to_metric_families(merged) if f.name == "x_seconds")
    assert len(histogram.samples) == 4
