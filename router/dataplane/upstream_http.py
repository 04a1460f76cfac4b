"""A lean HTTP/1.1 client for the request path's two legs: keep-alive pools on plain asyncio protocols.

Why not aiohttp's ClientSession here: it costs ~130 µs of CPU per POST where a protocol that parses only what
the proxy needs costs ~10 µs (`python -m bench.client_cost`), and every request makes two. The control plane
(`upstream.py`, aborts) keeps aiohttp.

What it does, and no more: POST a body; the status and content type; the whole body, or its pieces as they
arrive (SSE); Content-Length, chunked and read-until-close framing; keep-alive reuse with a bound on the
connections in use; a connect timeout. Rules that keep a pool sound:
- a connection goes back to its pool only once its response has been read to its end with keep-alive; an
  error, a cancellation, garbage after the message or a response closed early closes it instead;
- a request on a reused connection that the server closed before answering (it timed out the idle
  connection while we wrote) is sent once more on a fresh connection; never when any byte of an answer came.
"""

from __future__ import annotations

import asyncio
import collections
import re
import socket
import ssl as ssl_module
import time
from urllib.parse import urlsplit

MAX_HEAD_SIZE = 64 * 1024
MAX_BODY_SIZE = 1024 * 1024 * 1024  # for whole-body reads: a logprob answer for a large batch is big
PAUSE_ABOVE = 1024 * 1024  # buffered, unconsumed body bytes at which reading from the socket pauses
MAX_CHUNK_LINE = 4096
IDLE_SWEEP_S = 5.0
# A connection idle this long is not reused: SGLang's uvicorn closes idle connections after 5 s
# (SGLANG_TIMEOUT_KEEP_ALIVE), and reusing one just as the server closes it is the stale-connection race.
IDLE_TIMEOUT_S = 4.0

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


class UpstreamProtocolError(UpstreamError):
    """The answer is not HTTP/1.x we can read: garbled, oversized, or cut before its end."""


class _Stale(UpstreamError):
    """A reused connection closed before any byte of the answer: the request may be sent again."""


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
                 "_slot", "_cbuf", "_cstate", "_clean_end", "_paused", "_reused", "__weakref__")

    def __init__(self, conn: "_Connection", pool: "UpstreamPool") -> None:
        self.status = 0
        self.content_type = ""
        self._head = self._lower = b""
        self._conn: _Connection | None = conn
        self._pool = pool
        self._framing = _LENGTH
        self._remaining = 0
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._done = False  # the whole body is in (or the exchange failed)
        self._error: UpstreamError | None = None
        self._waiter: asyncio.Future | None = None
        self._got_bytes = False
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

    # ---- protocol side ---------------------------------------------------------------------------------
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
            self._pool._slot_released()

    def _fail(self, error: UpstreamError) -> None:
        if not self._done:
            self._done = True
            self._error = error
            self._chunks.clear()
        self._wake()

    def _feed(self, data: bytes) -> None:
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
                return self._feed(rest) if rest else None
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
                self._pool._put_idle(conn)
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

    def _connection_lost(self, exc: Exception | None) -> None:
        self._conn = None
        if self._head_in and self._framing == _UNTIL_CLOSE and exc is None:
            self._done = True
            self._release_slot()
            self._wake()
            return
        why = f": {exc}" if exc else ""
        if not self._head_in:
            if self._reused and not self._got_bytes:
                error: UpstreamError = _Stale(f"reused connection closed before an answer{why}")
            else:
                error = UpstreamProtocolError(f"server closed the connection before answering{why}")
        else:
            error = UpstreamProtocolError(f"server closed the connection before the end of the body{why}")
        self._fail(error)
        self._release_slot()


class _Connection(asyncio.Protocol):
    """One TCP connection to one endpoint; `response` is the exchange it is serving, None while idle."""

    __slots__ = ("pool", "endpoint", "transport", "response", "served", "lost", "idle_since")

    def __init__(self, pool: "UpstreamPool", endpoint: "_Endpoint") -> None:
        self.pool = pool
        self.endpoint = endpoint
        self.transport: asyncio.Transport | None = None
        self.response: UpstreamResponse | None = None
        self.served = 0
        self.lost = False
        self.idle_since = 0.0

    def connection_made(self, transport) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
        self.pool._connections.add(self)

    def data_received(self, data: bytes) -> None:
        response = self.response
        if response is None:  # unsolicited bytes on an idle connection: it cannot be trusted
            self.close()
            return
        response._feed(data)

    def eof_received(self) -> bool:
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.pool._connections.discard(self)
        response = self.response
        if response is not None:
            self.response = None
            response._connection_lost(exc)

    def close(self) -> None:
        self.lost = True
        if self.transport is not None:
            self.transport.close()


class _Endpoint:
    """One upstream server (scheme, host, port): its idle connections and request-line prefixes."""

    __slots__ = ("host", "port", "ssl", "server_hostname", "idle", "_prefixes", "_host_header")

    def __init__(self, base_url: str) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl = parts.scheme == "https"
        self.server_hostname = self.host if self.ssl else None
        host = f"[{self.host}]" if ":" in self.host else self.host
        default = 443 if self.ssl else 80
        host = host if host.isascii() else host.encode("idna").decode("ascii")
        self._host_header = (host if self.port == default else f"{host}:{self.port}").encode("ascii")
        self.idle: list[_Connection] = []
        self._prefixes: dict[str, bytes] = {}

    def prefix(self, path: str) -> bytes:
        """`POST path HTTP/1.1`, Host and Content-Type, up to the Content-Length value."""
        prefix = self._prefixes.get(path)
        if prefix is None:
            if any(c in path for c in "\r\n ") or not path.startswith("/"):
                raise ValueError(f"bad request path {path!r}")
            prefix = self._prefixes[path] = (
                b"POST " + path.encode("ascii") + b" HTTP/1.1\r\nHost: " + self._host_header
                + b"\r\nContent-Type: application/json\r\nContent-Length: ")
        return prefix


def header_lines(headers: dict[str, str]) -> bytes:
    """Extra request headers as wire bytes (values with CR or LF are refused)."""
    out = []
    for name, value in headers.items():
        if "\r" in value or "\n" in value or "\r" in name or "\n" in name or ":" in name:
            raise ValueError(f"header {name!r} cannot be sent")
        out.append(f"{name}: {value}\r\n".encode("utf-8", "surrogateescape"))
    return b"".join(out)


class UpstreamPool:
    """Keep-alive connections to the upstream servers, for the request path's POSTs."""

    def __init__(self, *, max_connections: int = 8192, connect_timeout: float | None = 10.0,
                 idle_timeout: float = IDLE_TIMEOUT_S, max_body_size: int = MAX_BODY_SIZE,
                 ssl_context: ssl_module.SSLContext | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        self.max_connections = max_connections
        self.connect_timeout = connect_timeout
        self.idle_timeout = idle_timeout
        self.max_body_size = max_body_size
        self._ssl_context = ssl_context
        self._endpoints: dict[str, _Endpoint] = {}
        self._connections: set[_Connection] = set()
        self._in_use = 0
        self._slot_waiters: collections.deque[asyncio.Future] = collections.deque()
        self._sweeper: asyncio.TimerHandle | None = None
        self._closed = False
        self.connects_total = 0  # fresh connections made (tests and diagnostics: keep-alive works)
        self.stale_retries_total = 0

    @property
    def in_use(self) -> int:
        return self._in_use

    @property
    def open_connections(self) -> int:
        return len(self._connections)

    def idle_connections(self, base_url: str) -> int:
        endpoint = self._endpoints.get(base_url)
        return sum(1 for c in endpoint.idle if not c.lost) if endpoint else 0

    async def post(self, base_url: str, path: str, body: bytes, headers: bytes = b"") -> UpstreamResponse:
        """Send `POST path` with a JSON body and return once the answer's head is in.

        `headers`: extra header lines as `header_lines()` makes them. The caller must `close()` the response
        (or read it to its end) in every case."""
        endpoint = self._endpoints.get(base_url)
        if endpoint is None:
            endpoint = self._endpoints[base_url] = _Endpoint(base_url)
        request = b"".join((endpoint.prefix(path), str(len(body)).encode(), b"\r\n", headers, b"\r\n", body))
        await self._take_slot()
        try:
            conn = self._idle_connection(endpoint)
            if conn is None:
                conn = await self._connect(endpoint)
            try:
                return await self._exchange(conn, request)
            except _Stale:
                # The server closed the idle connection as we wrote: nothing of ours was processed.
                self.stale_retries_total += 1
                return await self._exchange(await self._connect(endpoint), request)
        except BaseException:
            self._slot_released()
            raise

    async def _exchange(self, conn: _Connection, request: bytes) -> UpstreamResponse:
        """Write the request on conn and wait for the head. The slot passes to the response on success."""
        response = UpstreamResponse(conn, self)
        response._slot = False  # post() holds the slot until the head is in
        conn.response = response
        conn.served += 1
        try:
            try:
                conn.transport.write(request)
            except (RuntimeError, OSError) as exc:  # the transport closed under us: nothing was sent
                raise (_Stale if response._reused else UpstreamError)(f"cannot send the request: {exc}") from exc
            while not response._head_in and not response._done:
                await response._wait()
        except BaseException:
            response.close()
            raise
        if not response._head_in:
            raise response._error
        if response._done:  # (a body error is raised by read(), after the head)
            self._slot_released()  # the whole answer came with its head
        else:
            response._slot = True  # released when the body ends or the response is closed
        return response

    def _idle_connection(self, endpoint: _Endpoint) -> _Connection | None:
        idle = endpoint.idle
        deadline = time.monotonic() - self.idle_timeout
        while idle:
            conn = idle.pop()
            if conn.lost or conn.transport.is_closing():
                continue
            if conn.idle_since < deadline:
                conn.close()
                continue
            return conn
        return None

    async def _connect(self, endpoint: _Endpoint) -> _Connection:
        if self._closed:
            raise UpstreamConnectError("client is closed")
        conn = _Connection(self, endpoint)
        ssl = None
        if endpoint.ssl:
            if self._ssl_context is None:  # made once: loading the CA store costs milliseconds
                self._ssl_context = ssl_module.create_default_context()
            ssl = self._ssl_context
        where = f"{endpoint.host}:{endpoint.port}"
        try:
            async with asyncio.timeout(self.connect_timeout):
                await self.loop.create_connection(lambda: conn, endpoint.host, endpoint.port, ssl=ssl,
                                                  server_hostname=endpoint.server_hostname)
        except TimeoutError:
            raise UpstreamConnectError(f"cannot connect to {where}: no connection within "
                                       f"{self.connect_timeout:g} s") from None
        except (OSError, ssl_module.SSLError) as exc:
            raise UpstreamConnectError(f"cannot connect to {where}: {exc}") from exc
        self.connects_total += 1
        return conn

    # ---- the in-use bound -----------------------------------------------------------------------------
    async def _take_slot(self) -> None:
        if self._in_use < self.max_connections and not self._slot_waiters:
            self._in_use += 1
            return
        waiter = self.loop.create_future()
        self._slot_waiters.append(waiter)
        try:
            await waiter  # the releaser counted our slot already
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self._slot_released()  # given to us just as we were cancelled: pass it on
            else:
                try:
                    self._slot_waiters.remove(waiter)
                except ValueError:
                    pass
            raise

    def _slot_released(self) -> None:
        waiters = self._slot_waiters
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot passes straight to the waiter
                return
        self._in_use -= 1

    # ---- idle connections ----------------------------------------------------------------------------
    def _put_idle(self, conn: _Connection) -> None:
        if self._closed or conn.lost:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        conn.endpoint.idle.append(conn)
        if self._sweeper is None:
            self._sweeper = self.loop.call_later(IDLE_SWEEP_S, self._sweep)

    def _sweep(self) -> None:
        """Close connections idle for longer than idle_timeout, drop lost ones from the idle lists."""
        self._sweeper = None
        deadline = time.monotonic() - self.idle_timeout
        remaining = 0
        for endpoint in self._endpoints.values():
            keep = []
            for conn in endpoint.idle:
                if conn.lost:
                    continue
                if conn.idle_since < deadline:
                    conn.close()
                else:
                    keep.append(conn)
            endpoint.idle[:] = keep
            remaining += len(keep)
        if remaining and not self._closed:
            self._sweeper = self.loop.call_later(IDLE_SWEEP_S, self._sweep)

    async def close(self) -> None:
        """Close every connection (in use ones too) and wait until their transports are gone."""
        self._closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for endpoint in self._endpoints.values():
            endpoint.idle.clear()
        connections = list(self._connections)
        for conn in connections:
            conn.close()
        # Transports finish closing on the next loop iterations; wait (bounded) so nothing leaks a warning.
        deadline = self.loop.time() + 1.0
        while self._connections and self.loop.time() < deadline:
            await asyncio.sleep(0)
