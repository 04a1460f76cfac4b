"""The Policy interface: choose one worker of a pool for a request.

Policies do no I/O and never see the registry: they get the routable candidates (already filtered to
active, healthy workers of one pool) and a small description of the request. Choosing must stay cheap:
it may not grow with the number of requests in flight.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Protocol, Sequence, runtime_checkable

if TYPE_CHECKING:
    from .load_report import LoadReport


class LegOutcome(str, enum.Enum):
    """How one leg (a prefill's or a decode's half of a request) ended, as its policy learns it. Not a
    request's outcome (`router.core.records.RequestOutcome`), a conversion's, a step's or an operation's."""

    SUCCESS = "success"
    ERROR = "error"  # the worker failed the request
    CANCELLED = "cancelled"  # the client went away, or the other leg failed


@dataclass(slots=True)
class RequestInfo:
    """What a policy may look at. `text` is only filled for policies that ask for it (needs_text); `headers`
    are the client's request headers as they came (a case-insensitive mapping, never copied: the routing-key
    policies read one or two of them)."""

    route: str
    text: str | None = None
    batch_size: int = 1
    headers: Mapping[str, str] | None = None


@dataclass(frozen=True, slots=True)
class ServerLoad:
    """What a server last reported about its own load (`/v1/loads`, or `/get_load` on old servers).

    Written onto the worker by the router's load monitor; policies only read it. `inflight_at` is the
    router's own in-flight count when the snapshot was taken, so that requests routed since can be added
    to the server's (older) figure without counting them twice.
    """

    running: int
    waiting: int
    token_usage: float | None = None  # KV cache usage in [0, 1], when the server reports it
    inflight_at: int = 0
    taken_at: float = 0.0  # monotonic time of the snapshot
    # 0.5.23's whole report (policies/load_report.py: the PD queues, token counts, cumulative counters), and
    # what the load monitor made of its counters since the previous poll (None: not known).
    report: "LoadReport | None" = None
    prefill_busy: float | None = None  # share of the time spent in prefill forwards
    decode_step_s: float | None = None  # mean decode step (the inter-token latency it gave)
    decode_batch: float | None = None  # mean batch size of those steps
    decode_publish_steps: float | None = None  # decode steps between two published rows (the load monitor's)
    # a decode step = fixed + per_request x batch, fitted on the server's steps (None: not known yet)
    decode_step_fixed_s: float | None = None
    decode_step_per_request_s: float | None = None
    # The router's in-flight count on each data-parallel rank when the snapshot was taken (`--dp-aware`).
    rank_inflight_at: tuple[int, ...] = ()

    @property
    def requests(self) -> int:
        return self.running + self.waiting


@runtime_checkable
class Candidate(Protocol):
    id: str
    url: str
    inflight: int


def effective_load(worker: Candidate) -> int:
    """Requests on a worker, by the router's count and, when known, the server's own report.

    The server sees traffic the router does not (other routers, direct clients) but reports it late; the
    router's count is current but partial. Estimate: the server's figure plus what the router routed since
    the snapshot, never less than the router's own count. O(1).
    """
    inflight = worker.inflight
    load = getattr(worker, "server_load", None)
    if load is None:
        return inflight
    return max(inflight, load.requests + inflight - load.inflight_at)


class Policy:
    """Base class: subclasses implement `select`; the hooks are no-ops by default."""

    name = "base"
    needs_text = False  # set True to receive the prompt text in RequestInfo
    reads_server_load = False  # True: it reads `worker.server_load` (the load monitor polls for it)

    @classmethod
    def build(cls, params, rng=None) -> "Policy":
        """Make one from the validated PolicyParams (and a seeded RNG in tests); override to use them."""
        return cls()

    def select(self, candidates: Sequence[Candidate], request: RequestInfo) -> Candidate:
        raise NotImplementedError

    def on_complete(self, worker: Candidate, outcome: LegOutcome) -> None:
        """Called once per leg when it ends."""

    def on_worker_removed(self, worker: Candidate) -> None:
        """Called when a worker leaves the pool (removed, converted, failed)."""

    # Periodic upkeep (cache_aware's eviction), run by the router in an owned task; None: no upkeep.
    maintenance_interval: float | None = None

    def maintain(self) -> None:
        """Called every `maintenance_interval` seconds."""

    def state(self) -> dict:
        """What the admin API shows about this policy."""
        return {"name": self.name}
