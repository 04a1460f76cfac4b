"""When a worker may be routed to: pure rules over what the registry knows (no I/O, one test table each).

The registry applies `judge` after every change of a worker (state, health verdict, breaker, weight version,
hold) and of the fleet's weight version, and keeps the verdict on the worker, so the request path reads a
cached tuple and nothing else keeps a second list. `choose_fleet_version` is the start-up rule for a fleet
whose servers disagree (a router that died half-way through a weight update).
"""

from __future__ import annotations

import collections
import enum
import time
from dataclasses import dataclass, field
from typing import Iterable

from router.core.states import Role, WorkerState


class HoldKind(str, enum.Enum):
    """Why a server is held out of routing, named for what brings it back."""

    WEIGHTS = "weights"  # failed a weight update or serves another version: an update or the reconciler
    PAUSED = "paused"  # paused or not ready (`/ready` 503): continue_generation, or `/ready` answering 200
    MEMORY = "memory"  # its memory was not resumed: resume_memory_occupation
    # took a weight update, but its cache still holds the old weights' KV (0.5.23 refuses the flush while
    # requests are on the server, e.g. paused in place): the router's /flush_cache once the server is idle
    CACHE = "cache"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class Hold:
    kind: HoldKind
    reason: str
    since: float = field(default_factory=time.time)

    def to_dict(self) -> dict:
        return {"kind": self.kind.value, "reason": self.reason, "since": self.since}


def rejoin_refusal(version: str | None, fleet_version: str | None) -> str | None:
    """Why a worker may not serve: its weights differ from the fleet's (None: it may). A server that reports
    no version cannot be judged, and a fleet without a version holds nobody to one."""
    if fleet_version is None or version is None or version == fleet_version:
        return None
    return f"weight version {version!r} differs from the fleet's {fleet_version!r}"


@dataclass(frozen=True, slots=True)
class Verdict:
    healthy: bool  # the health monitor's verdict, and the weight check
    health_reason: str
    routable: bool
    reason: str  # why it is not routable ("" when it is)


def judge(state: WorkerState, monitor_healthy: bool, monitor_reason: str, breaker: str, weight_version: str | None,
          fleet_version: str | None, hold: Hold | None) -> Verdict:
    """Routable = active, not held out, healthy (probes), breaker not open, on the fleet's weight version."""
    refusal = rejoin_refusal(weight_version, fleet_version)
    healthy = monitor_healthy and refusal is None
    health_reason = monitor_reason if not monitor_healthy else (refusal or monitor_reason)
    if hold is not None:
        reason = f"held out ({hold.kind}): {hold.reason}"
    elif state is not WorkerState.ACTIVE:
        reason = f"state {state}"
    elif not monitor_healthy:
        reason = f"unhealthy: {monitor_reason or 'health probes failing'}"
    elif breaker == "open":
        reason = "circuit breaker open"
    elif refusal is not None:
        reason = refusal
    else:
        reason = ""
    return Verdict(healthy, health_reason, not reason, reason)


def choose_fleet_version(servers: Iterable[tuple[Role, str | None]]) -> str | None:
    """The weight version a fleet serves when its servers disagree (after a router died mid-update): one held
    by at least one prefill and one decode server (it can serve), preferring the version most servers hold;
    a tie goes to the version of the earliest server listed. When no version has a pair, the most common one
    (nothing serves until the servers are fixed, but none is routed on another version). None when no server
    reports a version."""
    servers = [(role, version) for role, version in servers if version is not None]
    counts = collections.Counter(version for _, version in servers)
    roles: dict[str, set[Role]] = collections.defaultdict(set)
    first: dict[str, int] = {}
    for index, (role, version) in enumerate(servers):
        roles[version].add(role)
        first.setdefault(version, index)
    servable = [v for v in counts if roles[v] == {Role.PREFILL, Role.DECODE}]
    candidates = servable or list(counts)
    if not candidates:
        return None
    return min(candidates, key=lambda v: (-counts[v], first[v]))
