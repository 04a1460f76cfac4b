"""The router's own resources: its open-files limit, the descriptors a burst may take, and running out of them.

A rollout burst (thousands of requests at once) takes one descriptor per client connection and one per leg.
At start-up the router raises its soft RLIMIT_NOFILE to the hard limit (`raise_open_files_limit`) and splits
what it may open (`DescriptorBudget`): client connections accepted at once (the rest wait in the listen
backlog) and leg connections open at once (the rest of the requests wait in the router's leg queue,
`dataplane/leg_room.py`). Each request in flight takes three descriptors: its client's and its two legs'.

Running out anyway (another process took the machine's files, the ephemeral ports are spent, the kernel is
short of buffers) is the router's failure, not a server's: `local_resource_kind` names it, `LocalResourceErrors`
counts it by kind (`pd_router_local_resource_errors_total{kind}`) and logs one rate-limited line; the request
path retries such a leg on the same pair once a descriptor is free, and no breaker or probe counts it.
"""

from __future__ import annotations

import errno
import logging
import resource
import time
from dataclasses import dataclass

logger = logging.getLogger(__name__)

# errno -> the metric's `kind` label: what running out of the router's own resources raises.
LOCAL_RESOURCE_ERRNOS = {
    errno.EMFILE: "EMFILE",  # this process's open-files limit
    errno.ENFILE: "ENFILE",  # the machine's open-files limit
    errno.EADDRNOTAVAIL: "EADDRNOTAVAIL",  # no ephemeral port left toward that address
    errno.ENOBUFS: "ENOBUFS",  # the kernel's socket buffers
}
LOG_EVERY_S = 10.0  # at most one error line per this many seconds, naming what it left out

# Descriptors kept out of the budget: the listening sockets, the event loop's own, logs, the control plane's
# connections (probes, load polls, fan-outs), etcd, a few closing transports. An eighth of the limit, at least
# 32 and at most 1,024.
RESERVE_MIN, RESERVE_MAX, RESERVE_SHARE = 32, 1024, 8
DESCRIPTORS_PER_REQUEST = 3  # its client connection and its two legs


def local_resource_kind(exc: BaseException | None) -> str | None:
    """The errno name when `exc` (or an exception it was raised from) is the router running out of its own
    descriptors, ports or buffers; None otherwise (a refused or unreachable server is the server's state)."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, OSError) and exc.errno in LOCAL_RESOURCE_ERRNOS:
            return LOCAL_RESOURCE_ERRNOS[exc.errno]
        os_error = getattr(exc, "os_error", None)  # aiohttp's ClientConnectorError keeps the OSError
        if isinstance(os_error, OSError) and os_error.errno in LOCAL_RESOURCE_ERRNOS:
            return LOCAL_RESOURCE_ERRNOS[os_error.errno]
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return None


class LocalResourceErrors:
    """Counts of the router's own resource failures by kind, and their one rate-limited error line."""

    __slots__ = ("counts", "_clock", "_logged_at", "_unlogged")

    def __init__(self, clock=time.monotonic) -> None:
        self.counts = dict.fromkeys(LOCAL_RESOURCE_ERRNOS.values(), 0)  # every kind shown from the start
        self._clock = clock
        self._logged_at: float | None = None
        self._unlogged = 0

    def note(self, kind: str, where: str, detail: object) -> None:
        self.counts[kind] += 1
        now = self._clock()
        if self._logged_at is not None and now - self._logged_at < LOG_EVERY_S:
            self._unlogged += 1
            return
        more = f" ({self._unlogged} more in the last {now - self._logged_at:.0f} s)" if self._unlogged else ""
        self._logged_at, self._unlogged = now, 0
        logger.error("the router ran out of its own resources (%s) %s: %s%s; no server is blamed, the request "
                     "waits for a descriptor and is retried on the same pair", kind, where, detail, more)

    @property
    def total(self) -> int:
        return sum(self.counts.values())


@dataclass(frozen=True, slots=True)
class DescriptorBudget:
    """What the open-files limit `limit` allows: `clients` client connections accepted at once, `legs` leg
    connections open at once (idle ones included), so `concurrency` requests on the servers at once."""

    limit: int
    reserve: int
    clients: int
    legs: int

    @property
    def concurrency(self) -> int:
        return self.legs // 2

    @classmethod
    def of(cls, limit: int, max_legs: int) -> "DescriptorBudget":
        """`max_legs`: --max-connections, the legs' own bound."""
        reserve = min(max(limit // RESERVE_SHARE, RESERVE_MIN), RESERVE_MAX)
        usable = max(limit - reserve, DESCRIPTORS_PER_REQUEST)
        # A request on the servers takes a client connection and two legs; a queued one, only its client's. A
        # third to the legs: as many requests again wait in the router, accepted, as run on the servers, and
        # every client connection beyond the legs' bound is one fewer client left in the listen backlog (whose
        # overflow costs a client seconds of SYN retries).
        legs = min(max(2, (usable // DESCRIPTORS_PER_REQUEST) & ~1), max(2, max_legs))
        return cls(limit=limit, reserve=reserve, clients=max(1, usable - legs), legs=legs)

    @classmethod
    def current(cls, max_legs: int) -> "DescriptorBudget":
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        return cls.of(soft if soft != resource.RLIM_INFINITY else hard if hard != resource.RLIM_INFINITY
                      else 1 << 20, max_legs)


def raise_open_files_limit(max_connections: int) -> DescriptorBudget:
    """Raise the soft RLIMIT_NOFILE to the hard limit (logged), and return the budget it allows; a warning when
    the hard limit caps the leg connections below `max_connections` (--max-connections)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            logger.info("open-files limit raised from %s to the hard limit %s", soft, hard)
        except (ValueError, OSError) as exc:
            logger.warning("cannot raise the open-files limit from %s to %s: %s", soft, hard, exc)
    budget = DescriptorBudget.current(max_connections)
    capped = budget.legs < max_connections
    logger.log(logging.WARNING if capped else logging.INFO,
               "open-files limit %d: at most %d requests on the servers at once (%d leg connections), %d client "
               "connections accepted at once; more clients wait in the listen backlog, more requests in the "
               "router's queue until their deadline%s",
               budget.limit, budget.concurrency, budget.legs, budget.clients,
               f" (the hard limit caps --max-connections {max_connections}: raise it, `ulimit -Hn`, to serve more)"
               if capped else "")
    return budget
