"""The record of one client request, filled in by the request path and handed to its observers at the end.

Metrics, the access log and the rebalancer's latency window read these records; they live in core so that
none of them needs to import the request path that writes them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from router.core.registry import Worker

if TYPE_CHECKING:
    from aiohttp import web

    from router.core.tracing import RequestTrace


class RequestOutcome(enum.StrEnum):
    """How a client request ended, as its observers (metrics, access log, rebalancer) name it."""

    SUCCESS = "success"
    ERROR = "error"  # answered with an error (before or after the first byte)
    CLIENT_DISCONNECT = "client_disconnect"  # the client left first
    ABORTED = "aborted"  # answered with SGLang's abort answer after the router aborted its servers


@dataclass(slots=True)
class RequestRecord:
    """One client request's outcome, handed to every observer once, at the end."""

    route: str
    stream: bool
    status: int = 0
    started: float = 0.0
    e2e_s: float = 0.0
    ttft_s: float | None = None
    itl_s: float | None = None  # mean gap between decode events after the first
    events: int = 0
    attempts: int = 0
    retries_aborted: int = 0
    local_retries: int = 0  # attempts the router could not send for want of its own descriptors (re-sent)
    waiting_for_room: bool = False  # in the router's leg queue (dataplane/leg_room.py) now
    prefill: Worker | None = None
    decode: Worker | None = None
    outcome: RequestOutcome = RequestOutcome.SUCCESS  # set once, by `conclude`, when the request ends
    request_id: str = ""
    error: str = ""  # why it failed (set where the failure is seen: the request path, the relay)
    client_gone: bool = False  # the client left before its answer ended
    abort_answered: bool = False  # answered with SGLang's abort answer (the router aborted its servers)
    response: web.StreamResponse | None = None  # set once a stream has started
    trace: RequestTrace | None = None  # the request's span, with --enable-trace (core/tracing.py)
    # the request's size as the router reads it (request_shape.request_sizes): the rebalancer's mix
    prompt_size: int = 0
    answer_size: int = 0

    def conclude(self) -> RequestOutcome:
        """The request's outcome, from what was recorded of it: the one place that names it."""
        if self.client_gone:
            self.outcome = RequestOutcome.CLIENT_DISCONNECT
        elif self.abort_answered:
            self.outcome = RequestOutcome.ABORTED
        elif self.error or self.status >= 400:
            self.outcome = RequestOutcome.ERROR
        else:
            self.outcome = RequestOutcome.SUCCESS
        return self.outcome


RequestObserver = Callable[[RequestRecord], None]
