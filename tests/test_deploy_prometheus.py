"""deploy/prometheus/: the scrape config parses, names the path a router serves its metrics on and the ports it
serves them on (its --port, and --prometheus-port as the Kubernetes manifests set it), and its Kubernetes
relabelling, applied to the pods the manifests describe, keeps exactly the routers' metrics ports. The alert
rules have the shape Prometheus loads (their metric names are checked against a router in
test_deploy_metrics.py)."""

from __future__ import annotations

import re
from urllib.parse import urlsplit

import aiohttp
import pytest
import yaml

from router.core.config import RouterConfig
from router.server.cli import build_parser

from .helpers import free_port
from .deploy_support import DOCS, ROOT, flag_values, router_args

CONFIG_PATH = ROOT / "deploy" / "prometheus" / "prometheus.yml"
CONFIG = yaml.safe_load(CONFIG_PATH.read_text())
RULE_FILES = [CONFIG_PATH.parent / name for name in CONFIG["rule_files"]]
DURATION = re.compile(r"^([0-9]+(ms|s|m|h|d|w|y))+$")
KEPT_INTERNAL = {"__address__", "__metrics_path__", "__scheme__"}


def job(name: str) -> dict:
    (found,) = [j for j in CONFIG["scrape_configs"] if j["job_name"] == name]
    return found


def metrics_path(j: dict) -> str:
    return j.get("metrics_path", "/metrics")  # Prometheus' default


def relabel(labels: dict[str, str], rules: list[dict]) -> dict[str, str] | None:
    """Prometheus' relabelling (replace, keep, drop, labelmap); None when the target is dropped."""
    labels = dict(labels)
    for rule in rules:
        action = rule.get("action", "replace")
        value = rule.get("separator", ";").join(labels.get(name, "") for name in rule.get("source_labels", []))
        regex = re.compile(rule.get("regex", "(.*)"))
        replacement = re.sub(r"\$\{?(\w+)\}?", r"\\g<\1>", rule.get("replacement", "$1"))
        match = regex.fullmatch(value)
        if action == "keep" and match is None or action == "drop" and match is not None:
            return None
        if action == "replace" and match is not None:
            result = match.expand(replacement)
            if result:
                labels[rule["target_label"]] = result
            else:
                labels.pop(rule["target_label"], None)
        elif action == "labelmap":
            for name in list(labels):
                if (m := regex.fullmatch(name)) is not None:
                    labels[m.expand(replacement)] = labels[name]
        elif action not in ("replace", "keep", "drop"):
            raise NotImplementedError(action)
    labels.setdefault("instance", labels["__address__"])
    return {k: v for k, v in labels.items() if not k.startswith("__") or k in KEPT_INTERNAL}


def pod_targets(j: dict) -> list[dict[str, str]]:
    """What kubernetes_sd (role: pod) discovers for the manifests' workloads: one target per container port."""
    targets = []
    for doc in DOCS:
        if doc["kind"] not in ("Deployment", "StatefulSet"):
            continue
        template = doc["spec"]["template"]
        pod = {"__meta_kubernetes_namespace": "default",
               "__meta_kubernetes_pod_name": f"{doc['metadata']['name']}-0",
               "__metrics_path__": metrics_path(j), "__scheme__": "http", "job": j["job_name"]}
        for key, value in template["metadata"].get("labels", {}).items():
            pod["__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)] = value
        for c in template["spec"]["containers"]:
            for port in c.get("ports", []):
                targets.append({**pod, "__address__": f"10.0.0.7:{port['containerPort']}",
                                "__meta_kubernetes_pod_container_name": c["name"],
                                "__meta_kubernetes_pod_container_port_name": port.get("name", ""),
                                "__meta_kubernetes_pod_container_port_number": str(port["containerPort"])})
    return targets


def test_the_config_parses_and_its_rule_files_exist():
    assert DURATION.match(CONFIG["global"]["scrape_interval"])
    assert RULE_FILES and all(path.exists() for path in RULE_FILES)
    names = [j["job_name"] for j in CONFIG["scrape_configs"]]
    assert len(names) == len(set(names))


def test_static_targets_are_routers_on_their_serving_port():
    static = job("pd-router")
    assert metrics_path(static) == "/metrics"
    port = build_parser().get_default("port")
    for group in static["static_configs"]:
        for target in group["targets"]:
            assert urlsplit(f"//{target}").port == port, f"{target}: the router serves /metrics on --port"


def test_kubernetes_relabelling_keeps_exactly_the_routers_metrics_ports():
    k8s = job("pd-router-kubernetes")
    assert [sd["role"] for sd in k8s["kubernetes_sd_configs"]] == ["pod"]
    discovered = pod_targets(k8s)
    assert len(discovered) >= 4, "the router's two ports and etcd's two"
    kept = [t for t in (relabel(d, k8s["relabel_configs"]) for d in discovered) if t is not None]
    metrics_port = int(flag_values(router_args(), "--prometheus-port")[0])
    assert [t["__address__"] for t in kept] == [f"10.0.0.7:{metrics_port}"]
    (target,) = kept
    assert target["__metrics_path__"] == "/metrics"
    assert target["instance"] == "pd-router-0" and target["pod"] == "pd-router-0"
    assert target["namespace"] == "default" and target["job"] == "pd-router-kubernetes"


def test_relabel_follows_prometheus_rules():
    rules = [{"source_labels": ["a", "b"], "regex": "x;(.*)", "target_label": "c", "replacement": "got-${1}"},
             {"source_labels": ["c"], "regex": "got-.*", "action": "keep"},
             {"regex": "__meta_(.+)", "action": "labelmap"}]
    assert relabel({"__address__": "h:1", "a": "x", "b": "y", "__meta_z": "1"}, rules) == \
        {"__address__": "h:1", "a": "x", "b": "y", "c": "got-y", "z": "1", "instance": "h:1"}
    assert relabel({"__address__": "h:1", "a": "no"}, rules) is None


async def test_the_router_serves_metrics_where_the_config_scrapes(sim_workers, make_router):
    exporter_port = free_port()
    p, d = await sim_workers(1, 1)
    router = await make_router([p], [d], prometheus_port=exporter_port, prometheus_host="127.0.0.1")
    for name in ("pd-router", "pd-router-kubernetes"):
        resp = await router.get(metrics_path(job(name)))
        assert resp.status == 200 and "pd_router_requests_total" in await resp.text()
    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://127.0.0.1:{exporter_port}{metrics_path(job('pd-router-kubernetes'))}") as r:
            assert r.status == 200 and "pd_router_worker_state" in await r.text()
    assert RouterConfig().prometheus_port is None, "without the flag, metrics are on the serving port only"


def rules() -> list[dict]:
    out = []
    for path in RULE_FILES:
        for group in yaml.safe_load(path.read_text())["groups"]:
            assert group["name"] and group["rules"]
            out.extend(group["rules"])
    return out


@pytest.mark.parametrize("rule", rules(), ids=lambda r: r["alert"])
def test_alert_rule_has_what_prometheus_and_alertmanager_need(rule):
    assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}
    assert re.fullmatch(r"PdRouter[A-Z][A-Za-z]+", rule["alert"])
    assert rule["expr"].strip()
    assert "for" not in rule or DURATION.match(rule["for"])
    assert rule["labels"]["severity"] in ("critical", "warning", "info")
    assert rule["annotations"]["summary"] and rule["annotations"]["description"]
    # template variables refer to labels the expression keeps (by (...)) or to $value
    kept = set(re.findall(r"\b(?:by)\s*\(([^)]*)\)", rule["expr"]))
    kept_labels = {label.strip() for group in kept for label in group.split(",")} | {"instance", "job"}
    for text in rule["annotations"].values():
        for label in re.findall(r"\$labels\.(\w+)", text):
            assert label in kept_labels, f"{rule['alert']}: $labels.{label} is aggregated away"


def test_alert_names_are_unique():
    names = [r["alert"] for r in rules()]
    assert len(names) == len(set(names)) >= 5
