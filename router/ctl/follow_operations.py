"""Long operations, followed step by step while they run: role conversion (`convert`) and the fleet-wide
operations (`update-weights`, `update-version`, `pause`, `continue`); and their history (`operations`)."""

from __future__ import annotations

import argparse
import re
import threading
import time
from typing import Any, Callable

from router.ctl.client import FAILED, OK, AdminClient, Answer, CtlError, Refused
from router.ctl.render import Console, age, cell, clip, fields, seconds, table
from router.ctl.views import resolve_worker, worker_path

POLL_INTERVAL_S = 0.2
PROGRESS_MESSAGE_WIDTH = 160  # the whole message: `operations ID` or --json
WORKER_OUTCOME_COLUMNS = ("url", "role", "success", "status", "version", "routable", "message")


# ---- steps as they complete -------------------------------------------------------------------------------
def step_name(step: dict) -> str:
    return step.get("step") or step.get("name") or "?"


class StepPrinter:
    """Prints each step of a record once it has ended (and once when first seen still running)."""

    def __init__(self, console: Console):
        self.console = console
        self.ended: set[int] = set()
        self.seen_running: set[int] = set()

    def show(self, steps: list[dict]) -> None:
        for index, step in enumerate(steps):
            outcome = step.get("outcome")
            name = step_name(step)
            if outcome in (None, "running"):
                if index not in self.seen_running:
                    self.seen_running.add(index)
                    deadline = step.get("deadline_s")
                    self.console.say(f"  {name:<12} running" + (f" (deadline {cell(deadline)} s)" if deadline else ""))
            elif index not in self.ended:
                self.ended.add(index)
                message = step.get("message") or ""
                self.console.say(f"  {name:<12} {outcome:<8} {seconds(step.get('duration_s')):>8}"
                                 + (f"  {clip(message, PROGRESS_MESSAGE_WIDTH)}" if message else ""))


def worker_outcomes(rows: list[dict]) -> str:
    return table(WORKER_OUTCOME_COLUMNS, [[r.get("url"), r.get("role"), r.get("success"), r.get("status"),
                                           r.get("weight_version"), r.get("routable"), r.get("message")]
                                          for r in rows], max_width=70)


# ---- convert ----------------------------------------------------------------------------------------------
def convert(client: AdminClient, args: argparse.Namespace, console: Console) -> int:
    worker = resolve_worker(client, args.worker)
    body: dict[str, Any] = {"new_role": args.to, "mode": args.mode, "wait": False}
    for field, value in (("timeout_s", args.timeout), ("switch_timeout_s", args.switch_timeout),
                         ("verify_timeout_s", args.verify_timeout)):
        if value is not None:
            body[field] = value
    record = client.post(f"/admin/workers/{worker_path(worker)}/convert", body).body
    if record.get("outcome") == "unchanged":
        console.document(record)
        console.say(record.get("message", "nothing to do"))
        return OK
    console.say(f"converting {worker['id']} {worker['url']}: {record['old_role']} -> {record['new_role']} "
                f"(mode {record['mode']}, conversion {record['id']})")
    printer = StepPrinter(console)
    while True:
        printer.show(record.get("steps", []))
        if record.get("state") == "done":
            break
        time.sleep(POLL_INTERVAL_S)
        record = client.get(f"/admin/conversions/{record['id']}").body
    console.document(record)
    if record.get("outcome") == "converted":
        console.say(f"converted: {worker['url']} is a {record['new_role']} worker (bootstrap port "
                    f"{cell(record.get('bootstrap_port'))}) after {seconds(record.get('duration_s'))}: emptying "
                    f"{seconds(record.get('empty_s'))}, server switch {seconds(record.get('server_switch_s'))}, "
                    f"router {seconds(record.get('overhead_s'))}")
        return OK
    where = {"restored": f"it is back in the {record['old_role']} pool",
             "failed": "it is out of routing: `pd-router ctl reinstate` once its server is fixed"}
    console.warn(f"conversion {record['id']} {record.get('outcome')} (HTTP {record.get('status')}): "
                 f"{record.get('message')}" + (f"; {where[record['outcome']]}" if record.get("outcome") in where
                                               else ""))
    return FAILED


# ---- fleet-wide operations ------------------------------------------------------------------------------
def _op_number(op_id: Any) -> int:
    match = re.fullmatch(r"op(\d+)", str(op_id))
    return int(match.group(1)) if match else -1


def _latest_op_number(state: dict) -> int:
    ops = list(state.get("history") or []) + ([state["current"]] if state.get("current") else [])
    return max((_op_number(op.get("id")) for op in ops), default=0)


def _our_operation(state: dict, kind: str, after: int) -> dict | None:
    """The first operation of `kind` started after op number `after`: the one this command asked for."""
    ops = list(state.get("history") or []) + ([state["current"]] if state.get("current") else [])
    ours = [op for op in ops if op.get("kind") == kind and _op_number(op.get("id")) > after]
    return min(ours, key=lambda op: _op_number(op.get("id")), default=None)


def run_fleet_operation(client: AdminClient, console: Console, kind: str, body: dict,
                        describe: Callable[[dict, dict | None], str]) -> int:
    """POST the operation (it answers when it has ended) while following its steps in `GET /weight_updates`."""
    after = _latest_op_number(client.get("/weight_updates").body)
    outcome: dict[str, Any] = {}

    def send() -> None:
        try:
            outcome["answer"] = client.post("/" + kind, body, timeout=client.long_timeout)
        except CtlError as error:
            outcome["error"] = error

    sender = threading.Thread(target=send, name=f"ctl-{kind}", daemon=True)
    sender.start()
    printer = StepPrinter(console)
    while True:
        sender.join(POLL_INTERVAL_S)
        try:
            state = client.get("/weight_updates").body
        except CtlError:
            state = {}  # progress is best effort: the answer says what happened
        op = _our_operation(state, kind, after)
        if op is not None:
            printer.show(op.get("steps", []))
        if not sender.is_alive():
            break
    error = outcome.get("error")
    if error is not None and not (isinstance(error, Refused) and isinstance(error.body, dict)):
        raise error
    answer: Answer | None = outcome.get("answer")
    result = answer.body if answer is not None else error.body
    result = result if isinstance(result, dict) else {}
    console.document(result)
    if result.get("workers"):
        console.say(worker_outcomes(result["workers"]))
    if error is not None:
        console.warn(f"{kind} failed (HTTP {error.status}): {error.message}")
        return FAILED
    console.say(describe(result, op))
    return OK


def _took(op: dict | None) -> str:
    return f" ({op['id']}, {seconds(op.get('duration_s'))})" if op else ""


def update_weights(client: AdminClient, args: argparse.Namespace, console: Console) -> int:
    body: dict[str, Any] = {"model_path": args.path, "abort_all_requests": args.abort}
    if args.version is not None:
        body["weight_version"] = args.version
    if args.load_format is not None:
        body["load_format"] = args.load_format
    if args.retry_aborted:
        body["retry_aborted"] = True
    console.say(f"updating the fleet's weights from {args.path} ({'aborting' if args.abort else 'draining'} "
                f"running requests)")
    return run_fleet_operation(client, console, "update_weights_from_disk", body, lambda r, op: (
        f"updated: the fleet serves weight version {cell(r.get('weight_version'))}{_took(op)}; "
        f"{cell(r.get('num_aborted_requests'))} requests aborted"))


def update_version(client: AdminClient, args: argparse.Namespace, console: Console) -> int:
    body = {"new_version": args.version, "abort_all_requests": not args.drain}
    console.say(f"relabelling the fleet's weights as {args.version}")
    return run_fleet_operation(client, console, "update_weight_version", body, lambda r, op: (
        f"updated: the fleet serves weight version {cell(r.get('weight_version'))}{_took(op)}"))


def pause(client: AdminClient, args: argparse.Namespace, console: Console) -> int:
    body: dict[str, Any] = {}
    if args.mode:
        body["mode"] = args.mode
    if args.retry_aborted:
        body["retry_aborted"] = True
    console.say(f"pausing generation (mode {args.mode or 'abort'})")
    return run_fleet_operation(client, console, "pause_generation", body, lambda r, op: (
        f"paused{_took(op)}: new requests wait in the router until `pd-router ctl continue`"))


def resume(client: AdminClient, args: argparse.Namespace, console: Console) -> int:
    console.say("continuing generation")
    return run_fleet_operation(client, console, "continue_generation", {}, lambda r, op: (
        f"continued{_took(op)}: the router routes again"))


# ---- history ----------------------------------------------------------------------------------------------
def _conversion_row(c: dict) -> list:
    state = c.get("outcome") or c.get("state")
    return [c["id"], f"convert {c['old_role']}->{c['new_role']}", c.get("worker_url"), state,
            age(c.get("started_at")), seconds(c.get("duration_s")), c.get("message"), c.get("started_at") or 0]


def _operation_row(op: dict) -> list:
    version = (op.get("options") or {}).get("weight_version")
    target = f"fleet -> {version}" if version else "fleet"
    return [op["id"], op["kind"], target, op.get("state"), age(op.get("started_at")), seconds(op.get("duration_s")),
            op.get("message"), op.get("started_at") or 0]


def operations(client: AdminClient, args: argparse.Namespace, console: Console) -> int:
    if args.id:
        return _one_operation(client, args.id, console)
    fleet = client.get("/weight_updates").body
    conversions = client.get(f"/admin/conversions?limit={args.limit}").body
    console.document({"weight_updates": fleet, "conversions": conversions})
    left_out = ", ".join(f"{w.get('url')} ({w.get('kind')}: {w.get('reason')})" for w in fleet.get("left_out", []))
    console.say(fields([("fleet weight version", fleet.get("fleet_weight_version")),
                        ("paused", fleet.get("paused")),
                        ("memory released", fleet.get("memory_released")),
                        ("running", ", ".join(filter(None, [(fleet.get("current") or {}).get("id"),
                                                            *conversions.get("running", [])]))),
                        ("left out", left_out)]))
    ops = [_operation_row(op) for op in ([fleet["current"]] if fleet.get("current") else [])]
    ops += [_operation_row(op) for op in fleet.get("history", [])]
    ops += [_conversion_row(c) for c in conversions.get("conversions", [])]
    ops.sort(key=lambda row: row[-1], reverse=True)
    console.say()
    console.say(table(("id", "kind", "target", "state", "started", "took", "message"),
                      [row[:-1] for row in ops[: args.limit]], max_width=70))
    return OK


def _one_operation(client: AdminClient, op_id: str, console: Console) -> int:
    is_conversion = re.fullmatch(r"c\d+", op_id) is not None
    path = f"/admin/conversions/{op_id}" if is_conversion else f"/weight_updates/{op_id}"
    record = client.get(path).body
    console.document(record)
    skip = {"steps", "workers", "notes", "error"}
    shown = [(k, age(v) if k == "started_at" else v) for k, v in record.items()
             if k not in skip and not isinstance(v, dict)]
    console.say(fields(shown))
    console.say()
    console.say(table(("step", "outcome", "took", "deadline s", "message"),
                      [[step_name(s), s.get("outcome"), seconds(s.get("duration_s")), s.get("deadline_s"),
                        s.get("message")] for s in record.get("steps", [])], max_width=90))
    if record.get("workers"):
        console.say()
        console.say(worker_outcomes(record["workers"]))
    return OK
