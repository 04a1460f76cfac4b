"""The peers' probe and fleet-reading routes (sgl-router 0.3.2, SMG 1.13; docs/PEERS.md), with their shapes:

- `GET /liveness`: 200 `OK` (text) while the process serves, shutting down included: a liveness probe must
  not restart a router that is draining.
- `GET /readiness`: 200 `{"status": "ready", "healthy_workers", "total_workers", "prefill", "decode"}` when
  each pool has a routable worker; else 503 `{"status": "not ready", "reason": "insufficient healthy workers"
  | "draining"}` with the usual `error` object beside it. The Kubernetes manifests probe these two.
- `GET /get_loads` (admin): every worker's own load report, read now: `{"workers": [{"worker": url, "role",
  "load": used KV tokens (SMG's measure; -1: not read), "running", "waiting", "token_usage", "details": the
  whole 0.5.23 report}]}`.
- `GET /engine_metrics` (admin): every worker's `/metrics` as one Prometheus text, each sample labelled
  `worker_addr="<url>"`, a family's lines kept together; empty (a comment) when the workers serve no
  metrics (SGLang without --enable-metrics); 503 (JSON error; the peers: 500 with text) when none answers.
Both fan-outs are answered once for concurrent callers (shared_answers.py).
"""

from __future__ import annotations

import dataclasses
import re

from aiohttp import web

from router.api.info import reachable_workers
from router.api.shared_answers import SHARED_ANSWERS
from router.control.upstream import UPSTREAM, fan_out
from router.core.errors import ServiceUnavailable, json_response
from router.core.keys import LIFECYCLE, REGISTRY
from router.core.registry import Role

FAN_OUT_TIMEOUT = 10.0
# The shared answers of the fan-outs (no reuse: a fresh read per call, one at a time).
SHARED_ROUTES = {"get_loads": 0.0, "engine_metrics": 0.0}
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"
_SAMPLE = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?(\s.*)")
_FAMILY_SUFFIXES = ("_bucket", "_sum", "_count", "_total", "_created", "_info")


async def liveness(request: web.Request) -> web.Response:
    return web.Response(text="OK")


async def readiness(request: web.Request) -> web.Response:
    registry = request.app[REGISTRY]
    routable = {role: len(registry.routable(role)) for role in Role}
    body = {"healthy_workers": sum(routable.values()), "total_workers": len(registry.workers()),
            "prefill": routable[Role.PREFILL], "decode": routable[Role.DECODE]}
    if request.app[LIFECYCLE].shutting_down:
        reason = "draining"
    elif not all(routable.values()):
        reason = "insufficient healthy workers"
    else:
        return json_response({"status": "ready", **body})
    empty = [role.value for role, n in routable.items() if n == 0]
    message = reason if reason == "draining" else f"no routable worker in pool(s): {', '.join(empty)}"
    return json_response({"status": "not ready", "reason": reason, **body,
                          "error": {"message": message, "type": "unavailable", "code": 503}}, status=503)


async def _loads(app: web.Application) -> tuple[dict, int]:
    workers = reachable_workers(app[REGISTRY])
    upstream = app[UPSTREAM]
    loads = await fan_out(workers, lambda w: upstream.load(w.url, timeout=FAN_OUT_TIMEOUT))
    rows = []
    for worker, load in zip(workers, loads):
        row = {"worker": worker.url, "role": worker.role.value, "load": -1}
        if load is not None:
            row.update(load=load.used_tokens if load.used_tokens is not None else -1, running=load.running,
                       waiting=load.waiting, token_usage=load.token_usage,
                       details=dataclasses.asdict(load.report) if load.report is not None else None)
        rows.append(row)
    return {"workers": rows}, 200


def _label(url: str) -> str:
    return 'worker_addr="' + url.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _family(name: str, known: set[str]) -> str:
    if name in known:
        return name
    for suffix in _FAMILY_SUFFIXES:
        if name.endswith(suffix) and name[: -len(suffix)] in known:
            return name[: -len(suffix)]
    return name


def merge_metrics(texts: list[tuple[str, str]]) -> str:
    """(worker url, its /metrics text) -> one exposition: each family's HELP/TYPE once (the first worker's),
    then its samples from every worker, labelled worker_addr."""
    headers: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    for url, text in texts:
        label = _label(url)
        known: set[str] = set()
        for line in text.splitlines():
            if not line.strip():
                continue
            if line.startswith("#"):
                parts = line.split(None, 3)
                if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                    known.add(parts[2])
                    family = headers.setdefault(parts[2], [])
                    samples.setdefault(parts[2], [])
                    if not any(h.split(None, 2)[1] == parts[1] for h in family):
                        family.append(line)
                continue
            match = _SAMPLE.fullmatch(line)
            if match is None:
                continue
            name, labels, rest = match.groups()
            inner = labels[1:-1].strip().rstrip(",") if labels else ""
            merged = f"{name}{{{label}{',' + inner if inner else ''}}}{rest}"
            samples.setdefault(_family(name, known), []).append(merged)
    out = []
    for family, lines in samples.items():
        out.extend(headers.get(family, ()))
        out.extend(lines)
    return "\n".join(out) + "\n"


async def _engine_metrics(app: web.Application) -> tuple[str, int]:
    workers = reachable_workers(app[REGISTRY])
    if not workers:
        raise ServiceUnavailable("no worker registered")
    upstream = app[UPSTREAM]
    replies = await fan_out(workers, lambda w: upstream.get(w.url, "/metrics", timeout=FAN_OUT_TIMEOUT))
    answered = [(w.url, r.text) for w, r in zip(workers, replies) if r.ok]
    if not answered and not any(r.status == 404 for r in replies):
        raise ServiceUnavailable("no worker answered /metrics: "
                                 + "; ".join(f"{w.url}: {r.status or r.message()}" for w, r in zip(workers, replies)))
    if not answered:  # they run, without metrics: an empty exposition, a scraper's "nothing yet"
        return "# no worker serves /metrics (SGLang serves it with --enable-metrics)\n", 200
    return merge_metrics(answered), 200


async def get_loads(request: web.Request) -> web.Response:
    app = request.app
    body, status = await app[SHARED_ANSWERS]["get_loads"].get(lambda: _loads(app))
    return json_response(body, status=status)


async def engine_metrics(request: web.Request) -> web.Response:
    app = request.app
    text, _ = await app[SHARED_ANSWERS]["engine_metrics"].get(lambda: _engine_metrics(app))
    return web.Response(body=text.encode(), headers={"Content-Type": PROMETHEUS_TEXT})


def setup(app: web.Application) -> None:
    r = app.router
    r.add_get("/liveness", liveness)
    r.add_get("/readiness", readiness)
    r.add_get("/get_loads", get_loads)
    r.add_get("/engine_metrics", engine_metrics)
