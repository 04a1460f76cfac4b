"""One HTTP/1.1 exchange of the legs' client: the answer's head, its body framing, and the consumer's API.

`UpstreamResponse` finds the answer's head in what its connection feeds it, has httptools (llhttp, the
parser behind uvicorn; aiohttp vendors the same C parser) read the status line and the body framing
(Content-Length / chunked / read-until-close), looks up the header fields asked for in the head's bytes, and
hands the body to its reader, whole or in pieces as they arrive. It hands its connection back to the pool only once the body arrived whole with
keep-alive; anything else (an error, garbage after the message, a response closed early) closes it.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

import httptools

MAX_HEAD_SIZE = 64 * 1024
PAUSE_ABOVE = 1024 * 1024  # buffered, unconsumed body bytes at which reading from the socket pauses

_HEAD_END = b"\r\n\r\n"


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


def _error_message(exc: Exception, head_in: bool, data: bytes) -> str:
    """Our words for llhttp's complaint about an answer."""
    text = str(exc)
    if not head_in:
        if "Content-Length" in text:
            if "Duplicate" in text:
                return "conflicting Content-Length headers"
            if "Invalid character" in text:
                return "malformed Content-Length"
        if isinstance(exc, httptools.HttpParserInvalidStatusError) or "HTTP/" in text or "status" in text:
            status_line = data.split(b"\r\n", 1)[0]
            return f"malformed status line {status_line[:80]!r}"
        return f"malformed response head: {text}"
    if "chunk size" in text:
        return f"malformed chunk size ({text})"
    if "after chunk" in text:
        return f"malformed chunked body: no CRLF after a chunk ({text})"
    return f"malformed response body: {text}"


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

    __slots__ = ("status", "content_type", "_head", "_lower", "_conn", "_pool", "_parser", "_ended", "_interim",
                 "_chunks", "_buffered", "_done", "_error", "_waiter", "_got_bytes", "_head_in", "_keep_alive",
                 "_slot", "_cbuf", "_clean_end", "_paused", "_reused", "_quiet_since", "__weakref__")

    def __init__(self, conn: _Carrier, pool: _Pool) -> None:
        self.status = 0
        self.content_type = ""
        self._head = self._lower = b""
        self._conn: _Carrier | None = conn
        self._pool = pool
        # llhttp parses the answer and calls on_headers_complete, on_body and on_message_complete; the reference
        # cycle it makes (parser -> self) is cut when the exchange ends.
        self._parser: httptools.HttpResponseParser | None = httptools.HttpResponseParser(self)
        self._ended = False  # the parser saw the message's end (the body is whole once feed() has seen it)
        self._interim = False  # the parser is inside an interim 1xx answer
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
        self._cbuf = bytearray()  # the head while it arrives in pieces
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
        self._parser = None
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
            if not self._parse(data[:end + 4]):
                return
            rest = data[end + 4:]
            if not self._head_in:  # an interim 1xx answer: the real head follows
                return self.feed(rest) if rest else None
            head = self._head = data[:end]
            lower = self._lower = head.lower()
            content_type = _field(head, lower, b"\r\ncontent-type:")
            self.content_type = (content_type.split(b";", 1)[0].strip().lower().decode("latin-1")
                                 if content_type else "application/octet-stream")
            if self._ended:  # no body
                if rest:
                    self._clean_end = False
                self._done = True
                self._finish()
                return
            self._wake()
            if not rest:
                return
            data = rest
        if self._parse(data):
            if self._ended:
                self._done = True
                self._finish()
            elif self._chunks:
                self._wake()

    def _parse(self, data: bytes) -> bool:
        """Feed the parser; False when the answer was abandoned as unreadable."""
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:  # 101: the connection is no longer HTTP
            self._ended = True
            self._keep_alive = False
        except httptools.HttpParserError as exc:
            if self._ended:  # garbage after a whole message: the connection cannot be trusted
                self._clean_end = False
                return True
            self._abandon(UpstreamProtocolError(_error_message(exc, self._head_in, data)))
            return False
        return True

    # httptools callbacks
    def on_message_begin(self) -> None:
        if self._ended:  # bytes past the message: the connection cannot be trusted
            self._clean_end = False

    def on_headers_complete(self) -> None:
        parser = self._parser
        status = parser.get_status_code()
        if 100 <= status < 200 and status != 101:
            self._interim = True  # skip it: the real head follows
            return
        self.status = status
        self._head_in = True
        self._keep_alive = parser.should_keep_alive() and status != 101

    def on_body(self, data: bytes) -> None:
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > PAUSE_ABOVE and not self._paused and self._conn is not None:
            self._paused = True
            self._conn.transport.pause_reading()

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
        else:
            self._ended = True

    def header(self, name: str) -> str | None:
        """A response header's value (the first, if repeated), None when absent."""
        if not self._head_in:
            return None
        value = _field(self._head, self._lower, b"\r\n" + name.lower().encode("latin-1") + b":")
        return None if value is None else value.decode("latin-1")

    def _until_close(self) -> bool:
        """The body ends when the server closes (RFC 9112 6.3): no Content-Length, no chunked coding last."""
        te = _field(self._head, self._lower, b"\r\ntransfer-encoding:")
        if te is not None:
            return te.lower().rsplit(b",", 1)[-1].strip() != b"chunked"
        return _field(self._head, self._lower, b"\r\ncontent-length:") is None

    def _finish(self) -> None:
        """The body is complete: hand the connection back (or close it) and wake the consumer."""
        self._parser = None
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
        self._parser = None
        self._fail(error)
        conn = self._conn
        if conn is not None:
            self._conn = None
            conn.response = None
            conn.close()
        self._release_slot()

    def connection_lost(self, exc: Exception | None) -> None:
        self._conn = None
        self._parser = None
        if self._head_in and exc is None and not self._done and self._until_close():
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
