"""Relaying decode's stream to the client, once its first event is in and the client's stream has begun.

From here on the client has seen bytes: a failure can no longer be answered as plain HTTP nor retried, so
it ends the stream with an SSE error event and `[DONE]`. Bytes are passed on as they come, except when
prefill's logprobs are merged into decode's events (then each event is rewritten).
"""

from __future__ import annotations

import asyncio
import logging
import time

from aiohttp import web

from router.core.records import RequestRecord
from router.dataplane import sse
from router.dataplane.aborts import last_event_aborted
from router.dataplane.attempt import Attempt
from router.dataplane.logprobs import merge_meta
from router.dataplane.upstream_http import UpstreamError, UpstreamResponse

logger = logging.getLogger(__name__)
# How much of a marked stream's end is kept to read its last event (a /generate event carries the text so far)
LAST_EVENT_BYTES = 1 << 20


class ClientGone(Exception):
    """Writing to the client failed: it disconnected."""


KEEPALIVE_COMMENT = b": keep-alive\n\n"


class KeepAlive:
    """--sse-keepalive-secs: an SSE comment on a client's stream its decode server has been silent on that long,
    so an idle-timeout proxy in between does not cut it. One timer per stream, moved lazily: a relayed chunk only
    notes its time and whether it ended an event; the timer, when it fires, writes a comment only at an event's
    end (never inside an event the server sent in pieces) and sets itself for the next due time."""

    __slots__ = ("response", "every", "last", "boundary", "sent", "_loop", "_timer", "_writing")

    def __init__(self, response: web.StreamResponse, every: float) -> None:
        self.response, self.every = response, every
        self.last = time.monotonic()
        self.boundary = True
        self.sent = 0
        self._loop = asyncio.get_running_loop()
        self._writing: asyncio.Task | None = None
        self._timer = self._loop.call_later(every, self._look)

    def _look(self) -> None:
        silent = time.monotonic() - self.last
        if silent >= self.every and self.boundary and self._writing is None:
            self._writing = asyncio.ensure_future(self._write())
            silent = 0.0
        self._timer = self._loop.call_later(max(self.every - silent, 0.01), self._look)

    async def _write(self) -> None:
        try:
            await self.response.write(KEEPALIVE_COMMENT)  # one transport write: never inside another frame
            self.sent += 1
        except (ConnectionError, RuntimeError):
            pass  # the client left, or the stream ended meanwhile: the relay finds out on its own
        finally:
            self._writing = None

    def close(self) -> None:
        self._timer.cancel()
        if self._writing is not None:
            self._writing.cancel()


async def relay(response: web.StreamResponse, d_resp: UpstreamResponse, events: list[bytes],
                splitter: sse.EventSplitter, prefill_first: dict[int, dict], record: RequestRecord,
                first_at: float, keepalive_s: float | None = None, attempt: Attempt | None = None) -> bool:
    """Relay decode's stream; True if it ended with [DONE]. Mid-stream failure → error event + [DONE].
    `keepalive_s`: --sse-keepalive-secs (None: no comments). Once `attempt` is marked by an operation that
    aborts it, the stream's end is kept, and its last event tells whether the abort ended it
    (`attempt.ended_aborted`)."""
    merge = bool(prefill_first)
    keep = KeepAlive(response, keepalive_s) if keepalive_s else None
    last_at = first_at
    saw_done = False
    end = b""  # the stream's last bytes, kept while the attempt is marked

    def keep_end(data: bytes) -> None:
        nonlocal end
        if attempt is not None and attempt.abort_action is not None:
            end = (end + data)[-LAST_EVENT_BYTES:]

    async def write(data: bytes) -> None:
        try:
            await response.write(data)
        except (ConnectionResetError, ConnectionError) as exc:
            raise ClientGone(str(exc)) from None

    def rewrite(raw_events: list[bytes]) -> bytes:
        nonlocal saw_done
        out = []
        for raw in raw_events:
            if sse.is_done(raw):
                saw_done = True
            elif merge:
                payload = sse.parse_event(raw)
                if isinstance(payload, dict):
                    merge_meta(prefill_first.get(payload.get("index", 0)), payload)
                    raw = sse.event(payload)
            out.append(raw)
        return b"".join(out)

    try:
        head = rewrite(events)
        keep_end(head)
        await write(head)
        record.events = len(events)
        if merge:
            async for chunk in d_resp:
                new = splitter.feed(chunk)
                if new:
                    last_at = time.monotonic()
                    record.events += len(new)
                    out = rewrite(new)
                    keep_end(out)
                    await write(out)
                    if keep is not None:
                        keep.last = last_at
        else:
            # Relay bytes as they come; only the tail is inspected for the final [DONE].
            tail = splitter.rest()
            if tail:
                keep_end(tail)
                await write(tail)
                if keep is not None:
                    keep.boundary = tail.endswith(b"\n\n")
            async for chunk in d_resp:
                last_at = time.monotonic()
                record.events += chunk.count(b"data:")
                keep_end(chunk)
                await write(chunk)
                tail = (tail + chunk)[-64:]
                if keep is not None:
                    keep.last, keep.boundary = last_at, chunk.endswith(b"\n\n")
            saw_done = saw_done or tail.rstrip(b"\r\n").endswith(sse.DONE.rstrip(b"\n"))
    except (UpstreamError, asyncio.TimeoutError) as exc:
        if keep is not None:
            keep.close()
        record.error = f"decode stream failed: {exc}"
        logger.warning("decode %s failed mid-stream: %s", record.decode.url if record.decode else "?", exc)
        await write(sse.error_event(f"decode worker failed mid-stream: {type(exc).__name__}: {exc}") + sse.DONE)
        return False
    finally:
        if keep is not None:  # nothing after the last event: the stream's end is written next
            keep.close()
    if end and attempt is not None:
        attempt.ended_aborted = last_event_aborted(end)
    if record.events > 1:
        record.itl_s = (last_at - first_at) / (record.events - 1)
    if not saw_done:
        record.error = "decode stream ended without [DONE]"
        await write(sse.error_event("decode worker closed the stream before [DONE]") + sse.DONE)
        return False
    try:
        await response.write_eof()
    except (ConnectionResetError, ConnectionError) as exc:
        raise ClientGone(str(exc)) from None
    return True


async def end_stream_with_error(response: web.StreamResponse, message: str, code: int,
                                type_: str = "timeout") -> None:
    """The stream began and the request failed (its deadline passed, or with --sse-keepalive-secs any failure
    once the head went out): an error event and [DONE], if the client is there."""
    try:
        await response.write(sse.error_event(message, code=code, type_=type_) + sse.DONE)
        await response.write_eof()
    except (ConnectionResetError, ConnectionError, RuntimeError):
        pass
