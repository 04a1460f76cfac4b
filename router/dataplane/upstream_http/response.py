"""One HTTP/1.1 exchange of the legs' client: the answer's head, its body framing, and the consumer's API.

`UpstreamResponse` parses what its connection feeds it (status line, the few header fields the framing
needs, Content-Length / chunked / read-until-close bodies) and hands the body to its reader, whole or in
pieces as they arrive. It hands its connection back to the pool only once the body arrived whole with
keep-alive; anything else (an error, garbage after the message, a response closed early) closes it.
"""

from __future__ import annotations

import asyncio
import re
from typing import Protocol

MAX_HEAD_SIZE = 64 * 1024
PAUSE_ABOVE = 1024 * 1024  # buffered, unconsumed body bytes at which reading from the socket pauses
MAX_CHUNK_LINE = 4096

_HEAD_END = b"\r\n\r\n"
_HEX = re.compile(rb"[0-9A-Fa-f]{1,15}")

# Body framing.
_LENGTH, _CHUNKED, _UNTIL_CLOSE = 0, 1, 2
# Chunked decoder states.
_SIZE, _DATA, _DATA_END, _TRAILERS = 0, 1, 2, 3


class UpstreamError(Exception):
    """The upstream server could not be reached or gave no usable answer."""


class UpstreamConnectError(UpstreamError):
    """No connection could be made (refused, unresolvable, connect timeout): the request was not sent."""


class LocalResourceError(UpstreamConnectError):
    """The router ran out of its own descriptors, ephemeral ports or socket buffers (`kind`: EMFILE, ENFILE,
    EADDRNOTAVAIL, ENOBUFS) before the request was sent: its failure, never the server's."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class UpstreamProtocolError(UpstreamError):
    """The answer is not HTTP/1.x we can read: garbled, oversized, or cut before its end."""


class UpstreamSilent(UpstreamError):
    """The server stopped sending in the middle of its answer: the pool's silence watch cut the exchange."""


class StaleConnection(UpstreamError):
    """A reused connection closed before any byte of the answer: the request may be sent again."""


class _Carrier(Protocol):
    """The connection an exchange runs on (`pool._Connection`)."""

    transport: asyncio.Transport
    response: UpstreamResponse | None
    served: int  # exchanges started on it: above 0, it is a reused connection

    def close(self) -> None: ...


class _Pool(Protocol):
    """What an exchange needs of the pool it came from (`pool.UpstreamPool`)."""

    loop: asyncio.AbstractEventLoop
    max_body_size: int

    def release_slot(self) -> None: ...

    def put_idle(self, conn: _Carrier) -> None: ...


def _field(head: bytes, lower: bytes, name: bytes) -> bytes | None:
    """The value of the header line starting with `name` (b"\\r\\nname:", lower case), stripped."""
    at = lower.find(name)
    if at < 0:
        return None
    start = at + len(name)
    end = head.find(b"\r\n", start)
    return (head[start:end] if end >= 0 else head[start:]).strip()


class UpstreamResponse:
    """One exchange: status and headers once the head is in, then the body as it arrives.

    `read()` gives the whole body; `async for piece in response` (or `next_chunk()`) gives what has arrived
    so far each time. `close()` (idempotent; `async with` calls it) closes the connection unless the body
    was read to its end, so a half-read connection is never reused.
    """

    __slots__ = ("status", "content_type", "_head", "_lower", "_conn", "_pool", "_framing", "_remaining",
                 "_chunks", "_buffered", "_done", "_error", "_waiter", "_got_bytes", "_head_in", "_keep_alive",
                 "_slot", "_cbuf", "_cstate", "_clean_end", "_paused", "_reused", "_quiet_since", "__weakref__")

    def __init__(self, conn: _Carrier, pool: _Pool) -> None:
        self.status = 0
        self.content_type = ""
        self._head = self._lower = b""
        self._conn: _Carrier | None = conn
        self._pool = pool
        self._framing = _LENGTH
        self._remaining = 0
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._done = False  # the whole body is in (or the exchange failed)
        self._error: UpstreamError | None = None
        self._waiter: asyncio.Future | None = None
        # Bytes came: before the head, since the request was sent (a stale connection sent none); after it,
        # since the pool's silence watch last looked (so the hot path pays nothing more for the watch).
        self._got_bytes = False
        self._quiet_since = 0.0  # when the silence watch last saw bytes come (0: not looked yet)
        self._head_in = False
        self._keep_alive = True
        self._slot = True  # holds one of the pool's in-use slots until it ends
        self._cbuf = bytearray()
        self._cstate = _SIZE
        self._clean_end = True
        self._paused = False
        self._reused = conn.served > 0

    # ---- consumer side ---------------------------------------------------------------------------------
    async def read(self) -> bytes:
        """The whole body (raises UpstreamError if it cannot be read to its end)."""
        parts: list[bytes] = []
        size = 0
        while True:
            if self._chunks:
                size += self._buffered
                if size > self._pool.max_body_size:
                    error = UpstreamProtocolError(f"response body larger than {self._pool.max_body_size} bytes")
                    self._chunks.clear()
                    self._buffered = 0
                    if self._done:
                        self._error = error  # (it did arrive whole: its connection is sound)
                    else:
                        self._abandon(error)
                    raise error
                parts.extend(self._chunks)
                self._chunks.clear()
                self._buffered = 0
                self._resume()
            if self._done:
                if self._error is not None:
                    raise self._error
                return parts[0] if len(parts) == 1 else b"".join(parts)
            await self._wait()

    async def next_chunk(self) -> bytes:
        """What has arrived since the last call, waiting for something; b"" at the end of the body."""
        while True:
            chunks = self._chunks
            if chunks:
                data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
                chunks.clear()
                self._buffered = 0
                self._resume()
                return data
            if self._done:
                if self._error is not None:
                    raise self._error
                return b""
            await self._wait()

    def __aiter__(self) -> "UpstreamResponse":
        return self

    async def __anext__(self) -> bytes:
        data = await self.next_chunk()
        if not data:
            raise StopAsyncIteration
        return data

    async def __aenter__(self) -> "UpstreamResponse":
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()

    @property
    def complete(self) -> bool:
        """The body arrived whole."""
        return self._done and self._error is None

    def close(self) -> None:
        """Stop the exchange: the connection closes unless the body already arrived whole."""
        conn = self._conn
        if conn is not None:
            self._conn = None
            conn.response = None
            conn.close()
        if not self._done:
            self._done = True
            self._error = UpstreamError("response closed before its end")
        self._release_slot()

    # ---- the pool's silence watch ------------------------------------------------------------------------
    def silent_for(self, now: float) -> float:
        """How long the answer has been silent at `now` (monotonic), as seen by periodic looks: 0 before its
        head (a whole answer's head comes when it is ready), after its end, when bytes came since the last
        look, or while reading is paused because its reader is behind (that silence is ours)."""
        if not self._head_in or self._done:
            return 0.0
        if self._got_bytes or self._paused or not self._quiet_since:
            self._got_bytes = False
            self._quiet_since = now
            return 0.0
        return now - self._quiet_since

    def restart_silence(self) -> None:
        """Silence until now does not count (the fleet was paused on purpose)."""
        self._quiet_since = 0.0

    def cut(self, error: UpstreamError) -> None:
        """End the exchange with `error` (its reader gets it) and close its connection."""
        self._abandon(error)

    # ---- protocol side (its connection calls feed() and connection_lost()) -----------------------------
    async def _wait(self) -> None:
        waiter = self._waiter = self._pool.loop.create_future()
        try:
            await waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _resume(self) -> None:
        if self._paused and self._conn is not None:
            self._paused = False
            self._conn.transport.resume_reading()

    def _deliver(self, data: bytes) -> None:
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > PAUSE_ABOVE and not self._paused and self._conn is not None:
            self._paused = True
            self._conn.transport.pause_reading()

    def _release_slot(self) -> None:
        if self._slot:
            self._slot = False
            self._pool.release_slot()

    def _fail(self, error: UpstreamError) -> None:
        if not self._done:
            self._done = True
            self._error = error
            self._chunks.clear()
        self._wake()

    def feed(self, data: bytes) -> None:
        """Bytes from the socket; returns when they are consumed (the connection may have been handed back)."""
        self._got_bytes = True
        if not self._head_in:
            buf = self._cbuf
            if buf:
                buf += data
                data = bytes(buf)
                buf.clear()
            end = data.find(_HEAD_END, 0, MAX_HEAD_SIZE + 4)
            if end < 0:
                if len(data) > MAX_HEAD_SIZE:
                    return self._abandon(UpstreamProtocolError(
                        f"response head larger than {MAX_HEAD_SIZE} bytes"))
                buf += data
                return
            error = self._parse_head(data[:end])
            if error is not None:
                return self._abandon(UpstreamProtocolError(error))
            if not self._head_in:  # an interim 1xx answer: the real head follows
                rest = data[end + 4:]
                return self.feed(rest) if rest else None
            data = data[end + 4:]
            if self._done:  # no body
                if data:
                    self._clean_end = False
                self._finish()
                return
            self._wake()
            if not data:
                return
        framing = self._framing
        if framing == _LENGTH:
            remaining = self._remaining
            if len(data) > remaining:
                self._clean_end = False  # bytes past the message: the connection cannot be trusted
                data = data[:remaining]
            self._remaining = remaining - len(data)
            self._deliver(data)
            if self._remaining == 0:
                self._done = True
                self._finish()
            else:
                self._wake()
        elif framing == _CHUNKED:
            self._feed_chunked(data)
        else:
            self._deliver(data)
            self._wake()

    def _parse_head(self, head: bytes) -> str | None:
        """Status and body framing; an error message if the head is not HTTP/1.x.

        Only the fields the framing needs are looked up (each a `find` in C); `header()` reads others."""
        eol = head.find(b"\r\n")
        status_line = head[:eol] if eol >= 0 else head
        if not status_line.startswith(b"HTTP/1.") or len(status_line) < 12 or status_line[8:9] != b" " \
                or not status_line[9:12].isdigit() or status_line[12:13] not in (b"", b" "):
            return f"malformed status line {status_line[:80]!r}"
        status = int(status_line[9:12])
        if 100 <= status < 200 and status != 101:
            return None  # interim answer: skip it
        lower = head.lower()
        self._head = head
        self._lower = lower
        self.status = status
        self._head_in = True
        content_type = _field(head, lower, b"\r\ncontent-type:")
        self.content_type = (content_type.split(b";", 1)[0].strip().lower().decode("latin-1")
                             if content_type else "application/octet-stream")
        connection = _field(head, lower, b"\r\nconnection:")
        connection = connection.lower() if connection else b""
        self._keep_alive = b"close" not in connection and (status_line[7:8] != b"0" or b"keep-alive" in connection)
        if status in (204, 304) or status == 101:
            self._done = True
            self._keep_alive = self._keep_alive and status != 101
            return None
        te = _field(head, lower, b"\r\ntransfer-encoding:")
        length = _field(head, lower, b"\r\ncontent-length:")
        if te is not None:
            if te.lower().rsplit(b",", 1)[-1].strip() != b"chunked":
                self._framing = _UNTIL_CLOSE  # RFC 9112 6.3: read until the server closes
                self._keep_alive = False
                return None
            self._framing = _CHUNKED
            if length is not None:
                self._keep_alive = False  # both: chunked wins, and the connection is not reused
            return None
        if length is not None:
            if not length.isdigit():
                return f"malformed Content-Length {length[:40]!r}"
            again = lower.find(b"\r\ncontent-length:", lower.find(b"\r\ncontent-length:") + 1)
            if again >= 0 and _field(head[again:], lower[again:], b"\r\ncontent-length:") != length:
                return "conflicting Content-Length headers"
            self._framing = _LENGTH
            self._remaining = int(length)
            if self._remaining == 0:
                self._done = True
            return None
        self._framing = _UNTIL_CLOSE
        self._keep_alive = False
        return None

    def header(self, name: str) -> str | None:
        """A response header's value (the first, if repeated), None when absent."""
        if not self._head_in:
            return None
        value = _field(self._head, self._lower, b"\r\n" + name.lower().encode("latin-1") + b":")
        return None if value is None else value.decode("latin-1")

    def _feed_chunked(self, data: bytes) -> None:
        buf = self._cbuf
        if buf:
            buf += data
            data = bytes(buf)
            buf.clear()
        pos, end_of_data = 0, len(data)
        delivered = False
        while pos < end_of_data:
            state = self._cstate
            if state == _DATA:
                take = min(self._remaining, end_of_data - pos)
                self._deliver(data[pos:pos + take] if (pos or take < end_of_data) else data)
                delivered = True
                pos += take
                self._remaining -= take
                if self._remaining == 0:
                    self._cstate = _DATA_END
            elif state == _DATA_END:
                if end_of_data - pos < 2:
                    break
                if data[pos:pos + 2] != b"\r\n":
                    return self._abandon(UpstreamProtocolError("malformed chunked body: no CRLF after a chunk"))
                pos += 2
                self._cstate = _SIZE
            else:  # _SIZE or _TRAILERS: a line
                line_end = data.find(b"\r\n", pos)
                if line_end < 0:
                    if end_of_data - pos > MAX_CHUNK_LINE:
                        return self._abandon(UpstreamProtocolError("malformed chunked body: line too long"))
                    break
                line = data[pos:line_end]
                pos = line_end + 2
                if state == _TRAILERS:
                    if not line:  # the empty line after the trailers: the body is complete
                        if pos < end_of_data:
                            self._clean_end = False
                        self._done = True
                        self._finish()
                        return
                    continue
                size = line.split(b";", 1)[0].strip()
                if not _HEX.fullmatch(size):
                    return self._abandon(UpstreamProtocolError(f"malformed chunk size {line[:40]!r}"))
                self._remaining = int(size, 16)
                self._cstate = _DATA if self._remaining else _TRAILERS
        if pos < end_of_data:
            buf += data[pos:]
        if delivered:
            self._wake()

    def _finish(self) -> None:
        """The body is complete: hand the connection back (or close it) and wake the consumer."""
        conn = self._conn
        self._conn = None
        if conn is not None:
            conn.response = None
            if self._paused:
                self._paused = False
                conn.transport.resume_reading()
            if self._keep_alive and self._clean_end:
                self._pool.put_idle(conn)
            else:
                conn.close()
        self._release_slot()
        self._wake()

    def _abandon(self, error: UpstreamError) -> None:
        """The answer cannot be used: fail the exchange and close its connection."""
        self._fail(error)
        conn = self._conn
        if conn is not None:
            self._conn = None
            conn.response = None
            conn.close()
        self._release_slot()

    def connection_lost(self, exc: Exception | None) -> None:
        self._conn = None
        if self._head_in and self._framing == _UNTIL_CLOSE and exc is None:
            self._done = True
            self._release_slot()
            self._wake()
            return
        why = f": {exc}" if exc else ""
        if not self._head_in:
            if self._reused and not self._got_bytes:
                error: UpstreamError = StaleConnection(f"reused connection closed before an answer{why}")
            else:
                error = UpstreamProtocolError(f"server closed the connection before answering{why}")
        else:
            error = UpstreamProtocolError(f"server closed the connection before the end of the body{why}")
        self._fail(error)
        self._release_slot()


async def exchange(pool: _Pool, conn: _Carrier, request: bytes) -> UpstreamResponse:
    """Write the request on conn and wait for the head. The pool's in-use slot, taken by the caller, passes to
    the response on success (or goes back at once when the whole answer came with its head)."""
    response = UpstreamResponse(conn, pool)
    response._slot = False  # post() holds the slot until the head is in
    conn.response = response
    conn.served += 1
    try:
        try:
            conn.transport.write(request)
        except (RuntimeError, OSError) as exc:  # the transport closed under us: nothing was sent
            raise (StaleConnection if response._reused else UpstreamError)(f"cannot send the request: {exc}") from exc
        while not response._head_in and not response._done:
            await response._wait()
    except BaseException:
        response.close()
        raise
    if not response._head_in:
        raise response._error
    if response._done:  # (a body error is raised by read(), after the head)
        pool.release_slot()  # the whole answer came with its head
    else:
        response._slot = True  # released when the body ends or the response is closed
    return response
