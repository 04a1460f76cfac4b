"""Aborting a request's rids on one server, in the background, over the legs' pool.

Three parts of the request path send these: a leg stopped before its end (the other leg failed, the client
left, an overdue prefill), an eviction (`Eviction.evict`), and the flows' single-request abort
(`DataplaneControl`). One sender serves them all, built before any of them.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

import orjson

from router.core.registry import Worker
from router.core.router_identity import HOP_LINE
from router.dataplane.upstream_http import UpstreamError, UpstreamPool, header_lines

logger = logging.getLogger(__name__)

ABORT_TIMEOUT_S = 5.0


def with_authorization(headers: bytes, line: bytes) -> bytes:
    """Header lines (`header_lines`' bytes) with their Authorization line replaced by `line`."""
    kept = b"".join(h + b"\r\n" for h in headers.split(b"\r\n") if h and h[:14].lower() != b"authorization:")
    return kept + line


class LegAborts:
    """`abort_on(worker, rids)`: `/abort_request {"rid"}` for each rid on `worker`, in an owned task."""

    __slots__ = ("_legs", "_spawn", "_headers")

    def __init__(self, legs: UpstreamPool, spawn: Callable[[Awaitable], asyncio.Task],
                 worker_api_key: str | None = None) -> None:
        """`worker_api_key`: --worker-api-key, sent to every worker (a worker's own key replaces it)."""
        self._legs = legs
        self._spawn = spawn
        self._headers = HOP_LINE + (header_lines({"Authorization": f"Bearer {worker_api_key}"})
                                    if worker_api_key else b"")

    def abort_on(self, worker: Worker, rids: list[str]) -> None:
        if rids:
            self._spawn(self._send(worker, rids))

    async def _send(self, worker: Worker, rids: list[str]) -> None:
        # Over the legs' pool: a burst of disconnects (a load test stopping, a client timing out many
        # requests) sends two aborts per request while the router is busiest.
        headers = self._headers if worker.auth_line is None else with_authorization(self._headers, worker.auth_line)
        for rid in rids:
            try:
                async with asyncio.timeout(ABORT_TIMEOUT_S):
                    resp = await self._legs.post(worker.url, "/abort_request", orjson.dumps({"rid": rid}), headers)
                    try:
                        await resp.read()
                    finally:
                        resp.close()
            except (UpstreamError, TimeoutError, OSError) as exc:
                logger.debug("abort of %s on %s failed: %s", rid, worker.url, exc)
