"""The Policy interface: choose one worker of a pool for a request.

Policies do no I/O and never see the registry: they get the routable candidates (already filtered to
active, healthy workers of one pool) and a small description of the request. Choosing must stay cheap:
it may not grow with the number of requests in flight.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable


class Outcome(str, enum.Enum):
    SUCCESS = "success"
    ERROR = "error"  # the worker failed the request
    CANCELLED = "cancelled"  # the client went away, or the other leg failed


@dataclass(slots=True)
class RequestInfo:
    """What a policy may look at. `text` is only filled for policies that ask for it (needs_text)."""

    route: str
    text: str | None = None
    batch_size: int = 1


@runtime_checkable
class Candidate(Protocol):
    id: str
    url: str
    inflight: int


class Policy:
    """Base class: subclasses implement `select`; the hooks are no-ops by default."""

    name = "base"
    needs_text = False  # set True to receive the prompt text in RequestInfo

    def select(self, candidates: Sequence[Candidate], request: RequestInfo) -> Candidate:
        raise NotImplementedError

    def on_complete(self, worker: Candidate, outcome: Outcome) -> None:
        """Called once per leg when it ends."""

    def on_worker_removed(self, worker: Candidate) -> None:
        """Called when a worker leaves the pool (removed, converted, failed)."""

    def state(self) -> dict:
        """What the admin API shows about this policy."""
        return {"name": self.name}
