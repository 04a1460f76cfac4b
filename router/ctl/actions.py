"""Short actions on workers and requests: add, remove, reinstate, abort, rejoin."""

from __future__ import annotations

import argparse
from typing import Any

from router.ctl.client import OK, AdminClient
from router.ctl.render import Console, cell, table
from router.ctl.views import WORKER_COLUMNS, resolve_worker, worker_path, worker_row


def add(client: AdminClient, args: argparse.Namespace, console: Console) -> int:
    body: dict[str, Any] = {"url": args.worker_url}
    if args.role:
        body["worker_type"] = args.role
    if args.bootstrap_port is not None:
        body["bootstrap_port"] = args.bootstrap_port
    answer = client.post("/workers", body).body
    console.document(answer)
    console.say(answer.get("message", "added"))
    if isinstance(answer.get("worker"), dict):
        console.say(table(WORKER_COLUMNS, [worker_row(answer["worker"], wide=False)]))
    return OK


def remove(client: AdminClient, args: argparse.Namespace, console: Console) -> int:
    worker = resolve_worker(client, args.worker)
    answer = client.call("DELETE", f"/workers/{worker_path(worker)}").body
    console.document(answer)
    console.say(answer.get("message", "removed"))
    return OK


def reinstate(client: AdminClient, args: argparse.Namespace, console: Console) -> int:
    worker = resolve_worker(client, args.worker)
    answer = client.post(f"/admin/workers/{worker_path(worker)}/reinstate", {}, timeout=client.long_timeout).body
    console.document(answer)
    console.say(answer.get("message", "reinstated"))
    if isinstance(answer.get("worker"), dict):
        console.say(table(WORKER_COLUMNS, [worker_row(answer["worker"], wide=False)]))
    return OK


def abort(client: AdminClient, args: argparse.Namespace, console: Console) -> int:
    body = {"abort_all": True} if args.all else {"rid": args.rid}
    answer = client.post("/abort_request", body, timeout=client.long_timeout)
    console.document(answer.body if answer.body is not None else {"success": True})
    what = "every request" if args.all else f"request {args.rid}"
    console.say(f"aborted {what}: the aborted requests have ended")
    return OK


def rejoin(client: AdminClient, args: argparse.Namespace, console: Console) -> int:
    answer = client.post("/weight_updates/rejoin", {}, timeout=client.long_timeout).body
    console.document(answer)
    console.say(f"fleet weight version {cell(answer.get('fleet_weight_version'))}; rejoined: "
                f"{cell(answer.get('rejoined'))}; still left out: {cell(answer.get('left_out'))}")
    return OK
