"""The deploy/ artefacts as the deploy tests read them: the Kubernetes manifests and the router's place in them."""

from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
MANIFESTS = sorted((ROOT / "deploy" / "kubernetes").glob("*.yaml"))


def documents() -> list[dict]:
    docs = []
    for path in MANIFESTS:
        docs.extend(doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None)
    return docs


DOCS = documents()


def find(kind: str, name: str) -> dict:
    found = [d for d in DOCS if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def router_deployment() -> dict:
    return find("Deployment", "pd-router")


def container(workload: dict, name: str) -> dict:
    return next(c for c in workload["spec"]["template"]["spec"]["containers"] if c["name"] == name)


def router_container() -> dict:
    return container(router_deployment(), "pd-router")


def router_args() -> list[str]:
    return list(router_container()["args"])


def flag_values(args: list[str], flag: str) -> list[str] | None:
    """The values after `flag` (up to the next flag); [] when it takes none, None when it is absent."""
    if flag not in args:
        return None
    values = []
    for token in args[args.index(flag) + 1:]:
        if token.startswith("--"):
            break
        values.append(token)
    return values


def port_number(c: dict, port: int | str) -> int:
    """A container's port by number or by name."""
    if isinstance(port, int):
        return port
    named = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
    assert port in named, f"port {port!r} is not a named port of container {c['name']}"
    return named[port]


def matches(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())
