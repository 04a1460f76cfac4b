"""The legs' keep-alive connections: one pool of idle connections per upstream server, a bound on those in
use, connecting (with a timeout), reusing, sweeping the idle ones, watching the busy ones for silence,
closing."""

from __future__ import annotations

import asyncio
import collections
import socket
import ssl as ssl_module
import time
from urllib.parse import urlsplit

from router.core.local_resources import LocalResourceErrors, local_resource_kind
from router.dataplane.upstream_http.response import (
    LocalResourceError,
    StaleConnection,
    UpstreamConnectError,
    UpstreamResponse,
    UpstreamSilent,
    exchange,
)

MAX_BODY_SIZE = 1024 * 1024 * 1024  # for whole-body reads: a logprob answer for a large batch is big
IDLE_SWEEP_S = 5.0
# A connection idle this long is not reused: SGLang's uvicorn closes idle connections after 5 s
# (SGLANG_TIMEOUT_KEEP_ALIVE), and reusing one just as the server closes it is the stale-connection race.
IDLE_TIMEOUT_S = 4.0
# The silence watch looks at every answer in progress this many times per timeout (at most every 5 s): an
# answer is cut after between one timeout and one look more of silence.
SILENCE_LOOKS_PER_TIMEOUT = 4
SILENCE_LOOK_MAX_S = 5.0


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
        response.feed(data)

    def eof_received(self) -> bool:
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        pool = self.pool
        pool._connections.discard(self)
        if pool._descriptor_freed is not None:
            pool._free_descriptor()
        response = self.response
        if response is not None:
            self.response = None
            response.connection_lost(exc)

    def close(self) -> None:
        self.lost = True
        if self.transport is not None:
            self.transport.close()


class _Endpoint:
    """One upstream server (scheme, host, port): its idle connections and request-line prefixes."""

    __slots__ = ("host", "port", "ssl", "server_hostname", "idle", "forgotten", "_prefixes", "_host_header")

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
        self.forgotten = False  # its server left the fleet: its connections close instead of idling
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
                 ssl_context: ssl_module.SSLContext | None = None, silence_timeout: float | None = None,
                 max_open: int | None = None, local_errors: LocalResourceErrors | None = None) -> None:
        """`silence_timeout`: cut an answer (its reader gets `UpstreamSilent`) once its server has sent
        nothing for this long after the answer's head; None or 0: never. `max_open`: connections open at once,
        idle ones included (the descriptors the legs may take: `DescriptorBudget.legs`); a new one beyond it
        closes an idle one of another server first. `local_errors`: where the router's own resource failures
        are counted (`LocalResourceError`)."""
        self.loop = asyncio.get_running_loop()
        self.max_open = max_open if max_open is not None else max_connections
        self.max_connections = min(max_connections, self.max_open)
        self.local_errors = local_errors if local_errors is not None else LocalResourceErrors()
        self._descriptor_freed: asyncio.Future | None = None  # set while a leg waits for one (wait_descriptor)
        self.connect_timeout = connect_timeout
        self.idle_timeout = idle_timeout  # --upstream-pool-idle-timeout-secs; swept at least twice per timeout
        self._sweep_every = min(IDLE_SWEEP_S, max(self.idle_timeout / 2, 0.05))
        self.max_body_size = max_body_size
        self._ssl_context = ssl_context
        self._endpoints: dict[str, _Endpoint] = {}
        self._connections: set[_Connection] = set()
        self._connecting = 0  # connections being made (not in _connections yet)
        self._in_use = 0
        self._slot_waiters: collections.deque[asyncio.Future] = collections.deque()
        self._sweeper: asyncio.TimerHandle | None = None
        self._closed = False
        self.connects_total = 0  # fresh connections made (tests and diagnostics: keep-alive works)
        self.stale_retries_total = 0
        self.silence_timeout = silence_timeout or None
        self.silence_cuts_total = 0
        self.silence_looks_total = 0  # looks taken (tests wait on it instead of on the clock)
        self._silence_reasons: set[str] = set()  # why silence is expected now (the fleet paused in place)
        self._silence_look: asyncio.TimerHandle | None = None
        if self.silence_timeout is not None:
            self._look_every = min(self.silence_timeout / SILENCE_LOOKS_PER_TIMEOUT, SILENCE_LOOK_MAX_S)
            self._silence_look = self.loop.call_later(self._look_every, self._look_for_silence)

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
                return await exchange(self, conn, request)
            except StaleConnection:
                # The server closed the idle connection as we wrote: nothing of ours was processed.
                self.stale_retries_total += 1
                return await exchange(self, await self._connect(endpoint), request)
        except BaseException:
            self.release_slot()
            raise

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
        if len(self._connections) + self._connecting >= self.max_open:
            self._close_oldest_idle()
        conn = _Connection(self, endpoint)
        ssl = None
        if endpoint.ssl:
            if self._ssl_context is None:  # made once: loading the CA store costs milliseconds
                self._ssl_context = ssl_module.create_default_context()
            ssl = self._ssl_context
        where = f"{endpoint.host}:{endpoint.port}"
        self._connecting += 1
        try:
            async with asyncio.timeout(self.connect_timeout):
                await self.loop.create_connection(lambda: conn, endpoint.host, endpoint.port, ssl=ssl,
                                                  server_hostname=endpoint.server_hostname)
        except TimeoutError:
            raise UpstreamConnectError(f"cannot connect to {where}: no connection within "
                                       f"{self.connect_timeout:g} s") from None
        except (OSError, ssl_module.SSLError) as exc:
            kind = local_resource_kind(exc)
            if kind is not None:  # the router's own limit, not the server's state
                self.local_errors.note(kind, f"connecting to {where}", exc)
                raise LocalResourceError(kind, f"cannot connect to {where}: {exc}") from exc
            raise UpstreamConnectError(f"cannot connect to {where}: {exc}") from exc
        finally:
            self._connecting -= 1
        self.connects_total += 1
        return conn

    def _close_oldest_idle(self) -> None:
        """Make room for a new connection: close the idle connection unused the longest (any server)."""
        oldest: _Connection | None = None
        for endpoint in self._endpoints.values():
            for conn in endpoint.idle:
                if not conn.lost and (oldest is None or conn.idle_since < oldest.idle_since):
                    oldest = conn
        if oldest is not None:
            oldest.endpoint.idle.remove(oldest)
            oldest.close()

    # ---- waiting for a descriptor after a local resource error ----------------------------------------
    async def wait_descriptor(self, timeout: float) -> bool:
        """Wait until one of the pool's connections closes (a descriptor is free again), at most `timeout`
        seconds (the exhaustion may be another part's: the caller tries again then). True if one closed."""
        if self._descriptor_freed is None:
            self._descriptor_freed = self.loop.create_future()
        try:
            async with asyncio.timeout(timeout):
                await asyncio.shield(self._descriptor_freed)
            return True
        except TimeoutError:
            return False

    def _free_descriptor(self) -> None:
        freed, self._descriptor_freed = self._descriptor_freed, None
        if not freed.done():
            freed.set_result(None)

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
                self.release_slot()  # given to us just as we were cancelled: pass it on
            else:
                try:
                    self._slot_waiters.remove(waiter)
                except ValueError:
                    pass
            raise

    def release_slot(self) -> None:
        waiters = self._slot_waiters
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot passes straight to the waiter
                return
        self._in_use -= 1

    # ---- idle connections ----------------------------------------------------------------------------
    def put_idle(self, conn: _Connection) -> None:
        if self._closed or conn.lost or conn.endpoint.forgotten:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        conn.endpoint.idle.append(conn)
        if self._sweeper is None:
            self._sweeper = self.loop.call_later(self._sweep_every, self._sweep)

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
            self._sweeper = self.loop.call_later(self._sweep_every, self._sweep)

    def forget(self, base_url: str) -> None:
        """The server left the fleet: close its idle connections and drop what the pool keeps for it (a
        connection still answering closes when its answer ends)."""
        endpoint = self._endpoints.pop(base_url, None)
        if endpoint is not None:
            endpoint.forgotten = True
            for conn in endpoint.idle:
                conn.close()
            endpoint.idle.clear()

    def knows(self, base_url: str) -> bool:
        return base_url in self._endpoints

    # ---- silence ---------------------------------------------------------------------------------------
    def expect_silence(self, reason: str) -> None:
        """Silence is expected for `reason` (the fleet is paused in place): nothing is cut, and silence so
        far does not count once the last reason is released."""
        self._silence_reasons.add(reason)

    def end_silence(self, reason: str) -> None:
        self._silence_reasons.discard(reason)

    def _look_for_silence(self) -> None:
        self.silence_looks_total += 1
        now = time.monotonic()
        expected = bool(self._silence_reasons)
        for conn in list(self._connections):
            response = conn.response
            if response is None:
                continue
            if expected:
                response.restart_silence()
            elif response.silent_for(now) >= self.silence_timeout:
                self.silence_cuts_total += 1
                response.cut(UpstreamSilent(f"the server sent nothing for {self.silence_timeout:g} s in the "
                                            f"middle of its answer"))
        if not self._closed:
            self._silence_look = self.loop.call_later(self._look_every, self._look_for_silence)

    async def close(self) -> None:
        """Close every connection (in use ones too) and wait until their transports are gone."""
        self._closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        if self._silence_look is not None:
            self._silence_look.cancel()
            self._silence_look = None
        for endpoint in self._endpoints.values():
            endpoint.idle.clear()
        connections = list(self._connections)
        for conn in connections:
            conn.close()
        # Transports finish closing on the next loop iterations; wait (bounded) so nothing leaks a warning.
        deadline = self.loop.time() + 1.0
        while self._connections and self.loop.time() < deadline:
            await asyncio.sleep(0)
