"""deploy/kubernetes/: every manifest validated offline against Kubernetes' own JSON schemas (strict: unknown
fields fail), and the references between them and to the router held against the real thing: Service
selectors and ports, probe ports, the router's flags (`pd-router --help` and its parser), the grace period
against the router's shutdown grace, the image's port and user, etcd's member list."""

from __future__ import annotations

import copy
import functools
import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import dockerfile
import kubernetes_validate
import pytest

from router.server.cli import build_parser, config_from_args

from .deploy_support import (DOCS, MANIFESTS, ROOT, container, find, flag_values, matches, port_number,
                             router_args, router_container, router_deployment)

# The oldest Kubernetes the manifests claim to work on (every field they use exists there), and the newest
# the schema package knows.
KUBERNETES_VERSIONS = ("1.27", kubernetes_validate.latest_version())
# Flags of features being built now (replicas over etcd): checked like any other flag
# once `pd-router --help` lists them; until then their own test skips and says so.
PENDING_FLAGS = {"--etcd-endpoints", "--cluster-name"}
ROUTER_KEY_ENV = {"PD_ROUTER_ADMIN_API_KEY", "PD_ROUTER_API_KEY", "PD_ROUTER_WORKER_API_KEY"}


def without_flags(args: list[str], flags: set[str]) -> list[str]:
    out, skipping = [], False
    for token in args:
        if token.startswith("--"):
            skipping = token in flags
        if not skipping:
            out.append(token)
    return out


@functools.cache
def router_help() -> tuple[frozenset[str], str]:
    """The flags `pd-router --help` lists, and its text (run through the console script the image names)."""
    script = Path(sys.executable).with_name("pd-router")
    text = subprocess.run([str(script), "--help"], capture_output=True, text=True, check=True, timeout=60).stdout
    return frozenset(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", text)), text


# ---- schemas ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("doc", DOCS, ids=[f"{d['kind']}/{d['metadata']['name']}" for d in DOCS])
def test_manifest_is_valid_against_the_kubernetes_schema(doc, version):
    kubernetes_validate.validate(doc, version, strict=True)


def test_the_schema_check_catches_a_misspelt_field_and_a_wrong_type():
    broken = copy.deepcopy(router_deployment())
    spec = broken["spec"]["template"]["spec"]["containers"][0]
    spec["readinesProbe"] = spec.pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSIONS[-1], strict=True)
    broken = copy.deepcopy(router_deployment())
    broken["spec"]["replicas"] = "three"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSIONS[-1], strict=True)


def test_every_file_holds_manifests_and_names_are_unique():
    assert {p.name for p in MANIFESTS} >= {"router.yaml", "etcd.yaml", "secret.yaml"}
    keys = [(d["kind"], d["metadata"]["name"]) for d in DOCS]
    assert len(keys) == len(set(keys))


# ---- the router Deployment ----------------------------------------------------------------------------------
def test_router_runs_several_replicas_and_rolls_without_losing_one():
    spec = router_deployment()["spec"]
    assert spec["replicas"] >= 2
    assert spec["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    assert matches(spec["selector"]["matchLabels"], spec["template"]["metadata"]["labels"])


def test_router_args_parse_with_the_router_cli():
    args = router_args()
    config = config_from_args(without_flags(args, PENDING_FLAGS), env={})
    assert config.prefill and config.decode, "mini_lb's form: the workers on the command line"
    assert config.host == "0.0.0.0"
    flags = {t for t in args if t.startswith("--")}
    known, _ = router_help()
    unknown = flags - known - PENDING_FLAGS
    assert not unknown, f"flags pd-router --help does not list: {sorted(unknown)}"


def test_flags_of_features_being_built_are_known_to_the_router():
    known, _ = router_help()
    missing = sorted(f for f in PENDING_FLAGS if f in router_args() and f not in known)
    if missing:
        pytest.skip(f"not in pd-router --help yet (features being built): {', '.join(missing)}")
    build_parser().parse_args(router_args())  # now every flag parses, values included


def test_etcd_endpoints_name_the_etcd_client_service():
    endpoints = flag_values(router_args(), "--etcd-endpoints")
    assert endpoints, "the replicas share their control plane through etcd"
    assert flag_values(router_args(), "--cluster-name")
    statefulset = find("StatefulSet", "etcd")
    for endpoint in endpoints:
        url = urlsplit(endpoint)
        service = find("Service", url.hostname)
        assert service["spec"].get("clusterIP") != "None", "clients go through the load-balanced Service"
        assert matches(service["spec"]["selector"], statefulset["spec"]["template"]["metadata"]["labels"])
        port = next(p for p in service["spec"]["ports"] if p["port"] == url.port)
        assert port_number(container(statefulset, "etcd"), port["targetPort"]) == url.port


def test_probes_use_the_peers_probe_routes_on_the_router_port():
    """/readiness (each pool routable) takes a replica out of the Service; /liveness (the process serves, the
    fleet behind it up or not) restarts it: the routes sgl-router's and SMG's manifests probe."""
    c = router_container()
    port = int(flag_values(router_args(), "--port")[0])
    paths = {probe: c[probe]["httpGet"]["path"] for probe in ("readinessProbe", "livenessProbe", "startupProbe")}
    assert paths == {"readinessProbe": "/readiness", "livenessProbe": "/liveness", "startupProbe": "/liveness"}
    for probe in paths:
        assert port_number(c, c[probe]["httpGet"]["port"]) == port
    from router.api.access import PUBLIC_ROUTES  # a probe sends no key
    assert set(paths.values()) <= PUBLIC_ROUTES


def test_grace_period_outlasts_the_pre_stop_wait_and_the_router_shutdown_grace():
    spec = router_deployment()["spec"]["template"]["spec"]
    shutdown_grace = float(flag_values(router_args(), "--shutdown-grace-secs")[0])
    pre_stop = router_container()["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    assert spec["terminationGracePeriodSeconds"] > float(pre_stop[1]) + shutdown_grace
    assert shutdown_grace >= build_parser().get_default("shutdown_grace_secs"), \
        "below the router's default shutdown grace: lower it on purpose, not by accident"


def test_keys_come_from_the_secret_under_the_names_the_router_reads():
    _, text = router_help()
    secret = find("Secret", "pd-router-keys")
    env = {e["name"]: e for e in router_container()["env"]}
    assert ROUTER_KEY_ENV <= set(env)
    for name in ROUTER_KEY_ENV:
        assert name in text, f"pd-router --help does not mention {name}"
        ref = env[name]["valueFrom"]["secretKeyRef"]
        assert ref["name"] == secret["metadata"]["name"] and ref["key"] == name
    assert not env["PD_ROUTER_ADMIN_API_KEY"]["valueFrom"]["secretKeyRef"].get("optional", False), \
        "a missing admin key must stop the pod, not open the admin routes"
    assert {"PD_ROUTER_ADMIN_API_KEY", "PD_ROUTER_API_KEY"} <= set(secret["stringData"])


def test_the_service_selects_the_router_pods_on_their_port():
    deployment, service = router_deployment(), find("Service", "pd-router")
    assert matches(service["spec"]["selector"], deployment["spec"]["template"]["metadata"]["labels"])
    port = int(flag_values(router_args(), "--port")[0])
    (http,) = service["spec"]["ports"]
    assert port_number(router_container(), http["targetPort"]) == port


def test_disruption_budgets_select_their_workloads():
    for name, kind in (("pd-router", "Deployment"), ("etcd", "StatefulSet")):
        budget, workload = find("PodDisruptionBudget", name), find(kind, name)
        assert budget["spec"]["selector"]["matchLabels"] == workload["spec"]["selector"]["matchLabels"]
        assert budget["spec"]["maxUnavailable"] == 1


def test_metrics_port_and_scrape_annotations_match_the_prometheus_port():
    c = router_container()
    metrics_port = int(flag_values(router_args(), "--prometheus-port")[0])
    assert port_number(c, "metrics") == metrics_port
    annotations = router_deployment()["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(metrics_port)
    assert annotations["prometheus.io/path"] == "/metrics"


def test_the_pods_match_the_image_port_and_user():
    commands = dockerfile.parse_file(str(ROOT / "deploy" / "Dockerfile"))
    final = commands[max(i for i, c in enumerate(commands) if c.cmd == "FROM"):]
    exposed = {int(p) for c in final if c.cmd == "EXPOSE" for p in c.value}
    user = next(c for c in final if c.cmd == "USER").value[0]
    assert port_number(router_container(), "http") in exposed
    security = router_deployment()["spec"]["template"]["spec"]["securityContext"]
    assert f"{security['runAsUser']}:{security['runAsGroup']}" == user
    assert security["runAsNonRoot"] is True


# ---- etcd ---------------------------------------------------------------------------------------------------
def test_etcd_members_find_each_other_through_the_headless_service():
    statefulset = find("StatefulSet", "etcd")
    spec = statefulset["spec"]
    peers = find("Service", spec["serviceName"])
    assert peers["spec"]["clusterIP"] == "None" and peers["spec"]["publishNotReadyAddresses"] is True
    assert matches(peers["spec"]["selector"], spec["template"]["metadata"]["labels"])
    assert spec["podManagementPolicy"] == "Parallel"
    assert spec["replicas"] % 2 == 1, "an odd member count: an even one adds no failure tolerance"
    c = container(statefulset, "etcd")
    args = dict(a[2:].split("=", 1) for a in c["args"])
    peer_port = port_number(c, "peer")
    expected = {f"{statefulset['metadata']['name']}-{i}":
                f"http://{statefulset['metadata']['name']}-{i}.{spec['serviceName']}:{peer_port}"
                for i in range(spec["replicas"])}
    assert dict(m.split("=", 1) for m in args["initial-cluster"].split(",")) == expected
    assert args["name"] == "$(POD_NAME)"
    assert args["initial-advertise-peer-urls"] == f"http://$(POD_NAME).{spec['serviceName']}:{peer_port}"
    assert urlsplit(args["listen-client-urls"]).port == port_number(c, "client")
    env = {e["name"]: e for e in c["env"]}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    mount = c["volumeMounts"][0]
    assert args["data-dir"].startswith(mount["mountPath"] + "/")
    assert mount["name"] in {t["metadata"]["name"] for t in spec["volumeClaimTemplates"]}


def test_etcd_liveness_checks_the_member_and_readiness_the_cluster():
    c = container(find("StatefulSet", "etcd"), "etcd")
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health?serializable=true"
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert port_number(c, c[probe]["httpGet"]["port"]) == 2379
