"""The record of one client request, filled in by the request path and handed to its observers at the end.

Metrics, the access log and the rebalancer's latency window read these records; they live in core so that
none of them needs to import the request path that writes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from router.core.registry import Worker

if TYPE_CHECKING:
    from aiohttp import web


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
    prefill: Worker | None = None
    decode: Worker | None = None
    outcome: str = "success"  # success | error | client_disconnect | aborted
    request_id: str = ""
    error: str = ""
    response: web.StreamResponse | None = None  # set once a stream has started


RequestObserver = Callable[[RequestRecord], None]
