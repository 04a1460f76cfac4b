"""Every metric the dashboard and the alert rules in deploy/ query exists in the /metrics of a real router, with
the labels they group and filter by: a router in front of a simulated fleet (real HTTP on loopback) serves
streams and plain requests, retries one that a worker fails, loses a client mid-stream, converts a worker
and updates the fleet's weights, so every labelled series exists before the scrape."""

from __future__ import annotations

import json

import aiohttp
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from policies.rebalance import RebalanceConfig
from router.core.config import BreakerConfig, HealthConfig, LoadMonitorConfig, RetryConfig, RouterConfig, WorkerSpec
from router.obs.metrics import METRICS
from router.server.app import create_app
from simulator.fleet import Fleet

from .deploy_support import ROOT
from .helpers import wait_for
from .promql import Reads, label_values_query, reads

DASHBOARD = json.loads((ROOT / "deploy" / "grafana" / "pd-router.json").read_text())
ALERTS = yaml.safe_load((ROOT / "deploy" / "prometheus" / "pd-router-alerts.yml").read_text())
# Series Prometheus makes itself, and the labels it adds to every scraped series (prometheus.yml's target labels
# included).
PROMETHEUS_SERIES = {"up"}
TARGET_LABELS = {"job", "instance", "namespace", "pod", "cluster"}
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
            "gauge": ("",), "summary": ("", "_sum", "_count", "_created")}
SIM = dict(health_check_s=0.0, bootstrap_retries=3, bootstrap_retry_interval_s=0.02, deferred_release_s=0.0,
           decode_step_s=0.01, api="0.5.23", enable_pd_role_switch=True)
BODY = {"text": "hello fleet", "sampling_params": {"max_new_tokens": 4}}


def queries() -> list[tuple[str, Reads]]:
    """(where, what it reads) for every query in the dashboard and the alert rules."""
    out = []
    for panel in DASHBOARD["panels"]:
        for target in panel.get("targets", []):
            out.append((f"dashboard panel {panel['title']!r}", reads(target["expr"])))
    for variable in DASHBOARD["templating"]["list"]:
        if variable["type"] == "query":
            selector, label = label_values_query(variable["query"]["query"])
            selector.labels.add(label)
            out.append((f"dashboard variable {variable['name']!r}", selector))
    for group in ALERTS["groups"]:
        for rule in group["rules"]:
            out.append((f"alert {rule['alert']}", reads(rule["expr"])))
    return out


def exposed(text: str) -> tuple[dict[str, set[str]], dict[str, str]]:
    """Every series name /metrics exposes (families without samples too) with the label names seen on it, and
    every family with its type."""
    series: dict[str, set[str]] = {}
    families: dict[str, str] = {}
    for family in text_string_to_metric_families(text):
        families[family.name] = family.type
        for suffix in SUFFIXES[family.type]:
            series.setdefault(family.name + suffix, set())
        for sample in family.samples:
            series.setdefault(sample.name, set()).update(sample.labels)
    return series, families


def sample_names(text: str) -> set[str]:
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples}


async def scrape(client) -> str:
    resp = await client.get("/metrics")
    assert resp.status == 200
    return await resp.text()


@pytest.fixture
async def busy_router(aiohttp_client):
    """A router on a 2P+2D simulated fleet after a bit of everything; yields its test client."""
    async with Fleet(2, 2, **SIM) as fleet:
        config = RouterConfig(
            prefill=tuple(WorkerSpec(h.url, h.bootstrap_port) for h in fleet.prefill),
            decode=tuple(WorkerSpec(h.url) for h in fleet.decode),
            prefill_policy="cache_aware", decode_policy="round_robin",
            health=HealthConfig(interval_secs=0.1, timeout_secs=1.0),
            breaker=BreakerConfig(failure_threshold=1, success_threshold=1, timeout_secs=0.2),
            retry=RetryConfig(initial_backoff_ms=1, max_backoff_ms=5),
            load_monitor=LoadMonitorConfig(interval_secs=0.1),
            rebalance=RebalanceConfig(interval_secs=0.1, min_samples=1),
        ).validated()
        client = await aiohttp_client(create_app(config), server_kwargs={"handler_cancellation": True})
        metrics = client.app[METRICS]
        for path, body in (("/generate", BODY), ("/generate", {**BODY, "stream": True}),
                           ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                     "max_tokens": 3, "stream": True})):
            resp = await client.post(path, json=body)
            assert resp.status == 200, await resp.text()
            await resp.read()
        # a role conversion: the second prefill becomes a decode
        workers = (await (await client.get("/workers")).json())["workers"]
        convertee = next(w for w in workers if w["url"] == fleet.prefill[1].url)
        resp = await client.post(f"/admin/workers/{convertee['id']}/convert", json={})
        assert resp.status == 200 and (await resp.json())["outcome"] == "converted"
        # a decode fails its next request: the router retries it elsewhere, the breaker opens and closes
        async with aiohttp.ClientSession() as session:
            async with session.post(fleet.decode[0].url + "/_sim/faults", json={"fail_next": 1}) as r:
                assert r.status == 200

        async def retried() -> bool:
            resp = await client.post("/generate", json=BODY)
            assert resp.status == 200
            return any(reason == "failure" for _, reason in metrics.retries.values)

        await wait_for(retried, timeout=10, message="a request retried after the injected failure")
        # a client that leaves mid-stream
        resp = await client.post("/generate", json={"text": "a long story", "stream": True,
                                                    "sampling_params": {"max_new_tokens": 400}})
        await resp.content.readline()
        resp.close()
        await wait_for(lambda: ("client_disconnect",) in metrics.aborts.values, timeout=10,
                       message="the router saw the client leave")
        resp = await client.post("/update_weights_from_disk", json={"model_path": "sim/m", "weight_version": "v2"})
        assert resp.status == 200, await resp.text()

        async def everything_labelled() -> bool:
            # traffic, so that the rebalancer's model has requests to fit (its pool load is a fitted figure)
            assert (await client.post("/generate", json=BODY)).status == 200
            names = sample_names(await scrape(client))
            return {"pd_router_pool_load", "pd_router_breaker_transitions_total",
                    "pd_router_worker_kv_usage"} <= names

        await wait_for(everything_labelled, timeout=10, message="rebalancer decision, breaker change, load reports")
        yield client


def test_the_query_reader_finds_metrics_labels_and_functions():
    found = reads('histogram_quantile(0.9, sum by (le, route) (rate(a_bucket{job=~"$job", route!="x"}'
                  '[$__rate_interval]))) / ignoring(route) b offset 5m > bool 1e3')
    assert found.metrics == {"a_bucket", "b"} and found.labels == {"le", "route", "job"}
    assert reads('max(c) by (worker) == 1 and on(worker) d{state="failed"}').metrics == {"c", "d"}
    with pytest.raises(ValueError):
        reads("rat(c[5m])")
    with pytest.raises(ValueError):
        reads("sum(rate(c[5m])")
    selector, label = label_values_query('label_values(e{job=~"$job"}, instance)')
    assert selector.metrics == {"e"} and label == "instance"


async def test_every_metric_and_label_the_artefacts_query_exists(busy_router):
    series, families = exposed(await scrape(busy_router))
    problems, queried = [], set()
    for where, query in queries():
        for metric in sorted(query.metrics - PROMETHEUS_SERIES):
            if metric not in series:
                problems.append(f"{where}: no metric {metric} in /metrics")
        labelled = set().union(*(series.get(m, set()) for m in query.metrics)) | TARGET_LABELS
        for label in sorted(query.labels - labelled):
            problems.append(f"{where}: no label {label!r} on {sorted(query.metrics)}")
        queried |= query.metrics
    assert not problems, "\n".join(problems)
    # and the other way round: each family the router exports is on some panel or in some alert (prometheus-
    # client's text format exposes counters' and histograms' `_created` as gauges of their own: not data)
    unshown = sorted(name for name, kind in families.items() if not name.endswith("_created")
                     and not any(name + suffix in queried for suffix in SUFFIXES[kind] if suffix != "_created"))
    assert not unshown, f"exported but on no panel and in no alert: {unshown}"
