"""What of a worker and of the fleet is shared in etcd: the records, made from the registry and compared.

Shared (decides where traffic may go, the same on every replica): a worker's URL, role, bootstrap port, admin
state and its reason, the hold that keeps it out of routing, and the facts read from its server (weight
version, switch API, server version); the fleet's weight version and holds. Not shared (each replica's own
data plane): in-flight counts, health probes and their verdict, the circuit breaker, policy state, server
load reports. A worker still `pending` (its server not read yet) is this replica's business: not published.
"""

from __future__ import annotations

import time

from router.core.registry import Worker, WorkerState
from router.core.routability import Hold, HoldKind

FACTS = ("weight_version", "switch_api", "server_version")
# Who wrote a record and when, and the worker id its creator gave it (ids are each replica's own; the URL is
# the worker's identity across replicas): not part of what a record means.
_META = ("by", "at", "id")


def worker_record(worker: Worker, replica_id: str) -> dict:
    hold = worker.hold
    return {
        "url": worker.url,
        "id": worker.id,
        "role": worker.role.value,
        "bootstrap_port": worker.bootstrap_port,
        "state": worker.state.value,
        "state_reason": worker.state_reason,
        "hold": None if hold is None else {"kind": hold.kind.value, "reason": hold.reason, "since": hold.since},
        **{name: getattr(worker, name) for name in FACTS},
        "by": replica_id,
        "at": round(time.time(), 3),
    }


def removal_record(worker: Worker, replica_id: str, by: str) -> dict:
    """A server the cluster removed (`removed/<url>`): what it was, and who removed it how (for the warning a
    replica logs when its command line names it)."""
    return {"url": worker.url, "id": worker.id, "role": worker.role.value, "bootstrap_port": worker.bootstrap_port,
            "by": replica_id, "how": by, "at": round(time.time(), 3)}


def describe_removal(record: dict) -> str:
    at = record.get("at")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at)) if isinstance(at, (int, float)) else "?"
    role = record.get("role") or "?"
    port = f", bootstrap port {record['bootstrap_port']}" if record.get("bootstrap_port") is not None else ""
    return (f"removed from the cluster at {when} by replica {record.get('by', '?')} ({record.get('how') or 'removed'}; "
            f"it was {role}{port})")


def fleet_record(weight_version: str | None, holds: dict[str, dict], silences: set[str], flags: dict,
                 replica_id: str) -> dict:
    """`holds`: admission's fleet-wide holds by reason; `silences`: the legs' expected silence (a pause in
    place); `flags`: the weight flow's shared state (the pause mode, the released memory tags)."""
    return {"weight_version": weight_version, "holds": holds, "silences": sorted(silences), **flags,
            "by": replica_id, "at": round(time.time(), 3)}


def meaning(record: dict) -> dict:
    """The record without who wrote it and when, and a hold without its start time."""
    plain = {k: v for k, v in record.items() if k not in _META}
    if isinstance(plain.get("hold"), dict):
        plain["hold"] = {k: v for k, v in plain["hold"].items() if k != "since"}
    if isinstance(plain.get("holds"), dict):
        plain["holds"] = {reason: {k: v for k, v in info.items() if k not in ("since", "replica")}
                          for reason, info in plain["holds"].items() if isinstance(info, dict)}
    return plain


def same(a: dict | None, b: dict | None) -> bool:
    if a is None or b is None:
        return a is b
    return meaning(a) == meaning(b)


def hold_of(record: dict) -> Hold | None:
    raw = record.get("hold")
    if not isinstance(raw, dict):
        return None
    try:
        kind = HoldKind(raw.get("kind"))
    except ValueError:
        return None
    since = raw.get("since")
    return Hold(kind, str(raw.get("reason", "")), since if isinstance(since, (int, float)) else time.time())


def state_of(record: dict) -> WorkerState:
    """The record's state; one this version does not know is `failed` (never routed, visibly)."""
    try:
        return WorkerState(record.get("state"))
    except ValueError:
        return WorkerState.FAILED
