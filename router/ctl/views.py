"""The read-only commands: workers, health, policies, rebalancer (and its knobs), cluster."""

from __future__ import annotations

import argparse
import json
from urllib.parse import quote

from router.ctl.client import FAILED, OK, AdminClient, Refused, UsageError, error_message
from router.ctl.render import Console, cell, fields, table


# ---- finding a worker by id or URL ----------------------------------------------------------------------
def list_workers(client: AdminClient) -> list[dict]:
    return client.get("/workers").body["workers"]


def resolve_worker(client: AdminClient, key: str) -> dict:
    """The worker record whose id or URL is `key` (a URL with or without its trailing slash)."""
    workers = list_workers(client)
    wanted = key.rstrip("/")
    for worker in workers:
        if key == worker["id"] or wanted == worker["url"].rstrip("/"):
            return worker
    known = ", ".join(f"{w['id']} {w['url']}" for w in workers) or "none"
    raise Refused(f"no worker {key!r} is registered (workers: {known})")


def worker_path(worker: dict) -> str:
    return quote(worker["id"], safe="")


# ---- workers ----------------------------------------------------------------------------------------------
WORKER_COLUMNS = ("id", "url", "role", "state", "routable", "healthy", "breaker", "inflight", "bootstrap",
                  "version", "ranks")


def ranks_cell(w: dict) -> str:
    """`-` for one rank; else each rank's router in-flight / server-reported requests: `0:2/5,1:0/1`."""
    rows = w.get("ranks") or []
    if not rows:
        return "-"

    def reported(r: dict) -> str:
        return "?" if r.get("running") is None else str(r["running"] + r["waiting"])
    return ",".join(f"{r['dp_rank']}:{r['inflight']}/{reported(r)}" for r in rows)


def worker_row(w: dict, wide: bool) -> list:
    row = [w["id"], w["url"], w["role"], w["state"], w["routable"], w["is_healthy"], w["breaker"], w["inflight"],
           w["bootstrap_port"], w["weight_version"], ranks_cell(w)]
    if wide:
        row += [w.get("requests_total"), w.get("failures_total"),
                "; ".join(r for r in (w.get("state_reason"), w.get("health_reason")) if r)]
    return row


def workers(client: AdminClient, args: argparse.Namespace, console: Console) -> int:
    listing = client.get("/workers").body
    console.document(listing)
    rows = listing["workers"]
    headers = WORKER_COLUMNS + (("requests", "failures", "reason") if args.wide else ())
    console.say(table(headers, [worker_row(w, args.wide) for w in rows], max_width=120 if args.wide else 60))
    by_role = {role: sum(w["role"] == role for w in rows) for role in ("prefill", "decode")}
    routable = sum(bool(w["routable"]) for w in rows)
    console.say(f"\n{len(rows)} workers: {by_role['prefill']} prefill, {by_role['decode']} decode; "
                f"{routable} routable")
    return OK


# ---- health -----------------------------------------------------------------------------------------------
def health(client: AdminClient, args: argparse.Namespace, console: Console) -> int:
    summary = client.get("/health", accept=(503,))
    detail = client.get("/admin/health").body
    console.document({"health": summary.body, "status": summary.status, "workers": detail})
    body = summary.body if isinstance(summary.body, dict) else {}
    admission = body.get("admission", {})
    console.say(f"router: {body.get('status', summary.status)} (in flight {cell(admission.get('in_flight'))}, "
                f"queued {cell(admission.get('queued'))}, held {cell(admission.get('held'))})")
    pools = body.get("pools", {})
    console.say(table(("pool", "routable", "total", "unhealthy", "breaker open"),
                      [[name, p.get("routable"), p.get("total"), p.get("unhealthy"), p.get("breaker_open")]
                       for name, p in pools.items()]))
    console.say()
    rows = [[w["worker_id"], w["url"], w["healthy"], w["probe"]["failures"], w["probe"]["successes"],
             w["breaker"]["phase"], w["breaker"]["failures"], w["breaker"]["opened_total"], w["probes_total"],
             w.get("reason") or w.get("refusal")] for w in detail.get("workers", [])]
    console.say(table(("worker", "url", "healthy", "probe fails", "probe oks", "breaker", "breaker fails",
                       "opened", "probes", "reason"), rows))
    probes, breaker = detail.get("probes", {}), detail.get("breaker", {})
    console.say(f"\nprobes {'on' if probes.get('enabled') else 'off'} ({probes.get('endpoint')} every "
                f"{cell(probes.get('interval_secs'))} s); breaker {'on' if breaker.get('enabled') else 'off'} "
                f"(opens after {cell(breaker.get('failure_threshold'))} faults)")
    if summary.status != 200:
        console.warn(f"the router is not ready: {error_message(summary.body, summary.status)}")
        return FAILED
    return OK


# ---- policies and the rebalancer ----------------------------------------------------------------------
def policies(client: AdminClient, args: argparse.Namespace, console: Console) -> int:
    body = client.get("/admin/policies").body
    console.document(body)
    for role, pool in body.get("pools", {}).items():
        policy = dict(pool.get("policy") or {})
        name = policy.pop("name", "?")
        extra = ", ".join(f"{k} {cell(v)}" for k, v in policy.items() if not isinstance(v, (dict, list)))
        console.say(f"{role} pool: {name}" + (f" ({extra})" if extra else ""))
        rows = []
        for w in pool.get("workers", []):
            load = w.get("server_load") or {}
            rows.append([w["id"], w["url"], w["routable"], w["inflight"], w.get("effective_load"),
                         load.get("running"), load.get("waiting"), load.get("token_usage"), load.get("age_secs")])
        console.say(table(("id", "url", "routable", "inflight", "load", "running", "waiting", "kv usage",
                           "report age s"), rows))
        console.say()
    monitor = body.get("load_monitor") or {}
    console.say(f"load monitor: {'on' if monitor.get('enabled') else 'off'}, every {cell(monitor.get('interval_secs'))}"
                f" s; {cell(monitor.get('polls'))} polls, {cell(monitor.get('failures'))} failed")
    return OK


def parse_setting(text: str) -> tuple[str, object]:
    """`name=value`: the value as JSON where it parses (numbers, booleans), else the text."""
    name, sep, raw = text.partition("=")
    if not sep or not name:
        raise UsageError(f"--set expects NAME=VALUE, got {text!r}")
    try:
        return name, json.loads(raw)
    except ValueError:
        return name, raw


def rebalancer(client: AdminClient, args: argparse.Namespace, console: Console) -> int:
    changes = dict(parse_setting(s) for s in args.set or ())
    if args.mode:
        changes["mode"] = args.mode
    if changes:
        client.call("PUT", "/admin/rebalancer", changes)
        console.say("changed: " + ", ".join(f"{k}={cell(v)}" for k, v in changes.items()))
    body = client.get(f"/admin/rebalancer?limit={args.limit}").body
    console.document(body)
    state, counters = body.get("state", {}), body.get("counters", {})
    model = next(((d.get("model") or {}) for d in reversed(body.get("decisions", [])) if (d.get("model") or {})
                  .get("choice")), {})
    console.say(fields([("mode", body.get("mode")), ("applying", (body.get("applying") or {}).get("url")),
                        ("model", _model_line(model)),
                        ("conversions decided", state.get("conversions_decided")),
                        ("refill", _refill_line(body.get("refill") or {})),
                        ("counters", ", ".join(f"{k} {v}" for k, v in sorted(counters.items())) or "-")]))
    config = body.get("config", {})
    console.say("config: " + ", ".join(f"{k}={cell(v)}" for k, v in config.items() if k != "mode"))
    decisions = body.get("decisions", [])
    if decisions:
        console.say()
        console.say(table(("action", "direction", "worker", "applied", "guards", "reason"),
                          [[d.get("action"), d.get("direction"), d.get("worker_id"), d.get("applied"),
                            d.get("guards"), d.get("reason")] for d in reversed(decisions)], max_width=80))
    return OK


def _model_line(model: dict) -> str:
    """The last fitted reading: the split chosen and why, and each candidate's predicted attainment."""
    if not model:
        return "-"
    candidates = ", ".join(f"{c['split']} {c['value'] * 100:.0f}%" for c in model.get("candidates", []))
    choice = model.get("choice") or {}
    return f"{choice.get('split')} ({choice.get('why')}); predicted: {candidates or '-'}"


def _refill_line(refill: dict) -> str:
    """Whether an empty pool is refilled, and the last refill decision's reason."""
    last = refill.get("last") or {}
    state = "on" if refill.get("enabled") else "off"
    return f"{state}; last: {last.get('reason')}" if last else state


# ---- cluster (router replicas) --------------------------------------------------------------------------
def cluster(client: AdminClient, args: argparse.Namespace, console: Console) -> int:
    answer = client.get("/admin/cluster", accept=(404,))
    if answer.status == 404:
        console.document({"cluster": None, "message": "not a cluster: this router runs alone"})
        console.say("not a cluster: this router runs alone (no /admin/cluster)")
        return OK
    body = answer.body
    console.document(body)
    if not isinstance(body, dict):
        console.say(cell(body))
        return OK
    scalars = [(k, v) for k, v in body.items() if not isinstance(v, (dict, list))]
    if scalars:
        console.say(fields(scalars))
    for name, value in body.items():
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            headers = list(dict.fromkeys(k for row in value for k in row))
            console.say(f"\n{name}:")
            console.say(table(headers, [[row.get(h) for h in headers] for row in value]))
        elif isinstance(value, (dict, list)):
            console.say(f"\n{name}: {json.dumps(value)}")
    return OK
