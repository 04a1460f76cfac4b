"""deploy/kubernetes/pod-discovery/: router.yaml's variant with Kubernetes pod discovery and the RBAC it needs.
Validated offline (Kubernetes' JSON schemas, strict), its flags parsed by the router's own CLI, its wiring
(service account, binding, namespace) checked, and its Role held against what the router asks of the API: the
router, configured from the manifest's flags, discovers pods through the API server stand-in while the stand-in
enforces that Role, and the verbs it asked for are exactly the ones the Role grants."""

from __future__ import annotations

import copy

import kubernetes_validate
import pytest
import yaml

from router.core.keys import REGISTRY
from router.core.registry import Role
from router.server.cli import config_from_args

from .deploy_support import ROOT, flag_values
from .helpers import wait_for
from .k8s_apiserver import pod
from .test_deploy_kubernetes import KUBERNETES_VERSIONS, router_help, without_flags
from .test_kubernetes_pods import cluster  # noqa: F401: the stand-in and the pods' servers (a fixture)

VARIANT = ROOT / "deploy" / "kubernetes" / "pod-discovery"
DOCS = [d for path in sorted(VARIANT.glob("*.yaml")) for d in yaml.safe_load_all(path.read_text()) if d]
# the flags that name the workers: the base's worker URLs, the variant's pod discovery
WORKER_FLAGS = {"--prefill", "--decode"}
DISCOVERY_FLAGS = {"--service-discovery", "--prefill-selector", "--decode-selector", "--service-discovery-port",
                   "--service-discovery-namespace", "--bootstrap-port-annotation"}


def find(kind: str, docs: list[dict] = DOCS) -> dict:
    (found,) = [d for d in docs if d["kind"] == kind]
    return found


def deployment() -> dict:
    return find("Deployment")


def args() -> list[str]:
    (c,) = deployment()["spec"]["template"]["spec"]["containers"]
    return list(c["args"])


def discovery_config():
    return config_from_args(args(), env={}).worker_sources


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("doc", DOCS, ids=[f"{d['kind']}/{d['metadata']['name']}" for d in DOCS])
def test_manifest_is_valid_against_the_kubernetes_schema(doc, version):
    kubernetes_validate.validate(doc, version, strict=True)


def test_the_router_args_parse_with_the_router_cli_as_pod_discovery():
    sources = discovery_config()
    assert sources.service_discovery and not config_from_args(args(), env={}).prefill
    assert (sources.prefill_selector, sources.decode_selector) == (("app=sglang", "role=prefill"),
                                                                   ("app=sglang", "role=decode"))
    assert sources.service_discovery_port == 30000
    known, _ = router_help()
    assert not {t for t in args() if t.startswith("--")} - known


def test_the_router_runs_as_the_service_account_bound_to_the_role_in_the_pods_namespace():
    account, role, binding = find("ServiceAccount"), find("Role"), find("RoleBinding")
    namespace = discovery_config().service_discovery_namespace
    assert namespace, "without it the router watches every namespace: a ClusterRole and ClusterRoleBinding"
    assert {d["metadata"]["namespace"] for d in DOCS} == {namespace}
    spec = deployment()["spec"]["template"]["spec"]
    assert spec["serviceAccountName"] == account["metadata"]["name"]
    assert spec["automountServiceAccountToken"] is True, "the in-cluster client reads the account's token"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["metadata"]["name"],
                                    "namespace": account["metadata"]["namespace"]}]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": role["metadata"]["name"]}


def test_the_variant_is_router_yaml_but_for_the_worker_flags_and_the_account():
    """What else the router's Deployment, Service and budget say (probes, grace, keys, etcd) stays router.yaml's."""
    base = [d for d in yaml.safe_load_all((ROOT / "deploy" / "kubernetes" / "router.yaml").read_text()) if d]
    variant = [copy.deepcopy(d) for d in DOCS if d["kind"] in {"Deployment", "Service", "PodDisruptionBudget"}]
    for doc in variant:
        del doc["metadata"]["namespace"]
    spec = find("Deployment", variant)["spec"]["template"]["spec"]
    del spec["serviceAccountName"]
    spec["automountServiceAccountToken"] = False
    for docs, flags in ((base, WORKER_FLAGS), (variant, DISCOVERY_FLAGS)):
        (c,) = find("Deployment", docs)["spec"]["template"]["spec"]["containers"]
        c["args"] = without_flags(c["args"], flags)
    assert variant == base


async def test_discovery_runs_under_the_manifests_role_asking_for_exactly_its_verbs(cluster):  # noqa: F811
    """The stand-in enforces the Role (403 for any other verb or namespace); the router is configured by the
    manifest's flags (its port aside: the pods' servers share one loopback port)."""
    role = find("Role")
    cluster.api.roles = [(role["metadata"]["namespace"], role["rules"])]
    sources = discovery_config().with_(service_discovery_port=cluster.port)
    labels = {role_: dict(item.split("=") for item in flag_values(args(), f"--{role_}-selector"))
              for role_ in ("prefill", "decode")}
    urls = {}
    for index, (name, role_) in enumerate((("p0", "prefill"), ("d0", "decode")), start=1):
        ip = await cluster.server(name, role_, index)
        await cluster.api.apply(pod(name, ip, labels[role_], namespace=sources.service_discovery_namespace))
        urls[role_] = f"http://{ip}:{cluster.port}"
    await cluster.start_router(**dict(sources))
    registry = cluster.client.app[REGISTRY]
    assert {w.url for w in registry.workers(Role.PREFILL)} == {urls["prefill"]}
    assert {w.url for w in registry.workers(Role.DECODE)} == {urls["decode"]}
    await wait_for(lambda: cluster.api.watches_open() == 2, message="both selectors watched")
    assert (await cluster.discovery())["error"] is None
    await cluster.generate()
    granted = {verb for rule in role["rules"] for verb in rule["verbs"]}
    assert cluster.api.verbs() == granted, "the Role grants exactly what the router asks for"
