"""Serving the app: aiohttp's runner, on a listening socket that accepts every waiting connection at once.

Why not `web.run_app`'s TCPSite: on uvloop, libuv (since 1.45) accepts one connection per loop iteration.
Under load an iteration takes milliseconds, so a burst of new clients (a load test's ramp, clients
reconnecting after a restart) waits in the accept queue: 256 connections at once took 2-3 s to be
accepted at ~2,500 requests/s. Here the listening socket is polled by the loop, and each time it is
readable every pending connection (up to the backlog) is accepted and handed to aiohttp.

Signals: SIGTERM and SIGINT ask for a graceful stop. The listening sockets close at once (connections already
open are served on), then the app's `wind_down` runs (`router/server/shutdown.py`: the grace period), then
aiohttp closes the connections and the app. A second signal asks the wind-down to hurry; a third exits at
once (status 1).
"""

from __future__ import annotations

import asyncio
import errno
import gc
import logging
import os
import signal
import socket
import ssl
from typing import Awaitable, Callable

from aiohttp import web

from router.core.errors import ListenError
from router.core.keys import LOCAL_RESOURCES
from router.core.local_resources import LocalResourceErrors, local_resource_kind
from router.server.http_errors import HeadWatch, JsonErrorServer, RouterRunner

logger = logging.getLogger(__name__)

# Out of descriptors or memory: stop accepting for a moment instead of spinning on a readable socket.
RESOURCE_ERRORS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
RESOURCE_PAUSE_S = 1.0
# The cyclic collector's thresholds once serving (gen0 allocations, gen0 passes per gen1 pass, gen1 passes per
# full pass). Python's (700, 10, 10) collected ~1,000 times during a 4,096-request burst, 8 of them full passes
# over every request's live objects: 1.2-1.7 s of the burst's 4.3-4.7 s of CPU (bench/rollout_burst.py, with a
# gc.callbacks timer). Requests free their objects by reference counting; cycles wait for a larger pass.
GC_THRESHOLDS = (50_000, 20, 100)
# A client that opens a TLS connection and sends no handshake is dropped after this long.
TLS_HANDSHAKE_TIMEOUT_S = 10.0


class StopSignals:
    """SIGTERM/SIGINT: the first asks for a graceful stop (`requested`), the second to hurry (`hurry`: abort
    what is left now), the third exits at once."""

    __slots__ = ("received", "requested", "hurry")

    def __init__(self) -> None:
        self.received: list[str] = []
        self.requested = asyncio.Event()
        self.hurry = asyncio.Event()

    @property
    def first(self) -> str | None:
        return self.received[0] if self.received else None

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self.receive, signal.Signals(signum).name)

    def receive(self, name: str) -> None:
        self.received.append(name)
        if len(self.received) == 1:
            logger.info("%s: shutting down gracefully (%s again: abort what is left now)", name, name)
            self.requested.set()
        elif len(self.received) == 2:
            logger.warning("%s again: aborting what is left now (a third signal exits at once)", name)
            self.hurry.set()
        else:
            logger.error("%s a third time: exiting at once, without answering what is left", name)
            logging.shutdown()
            os._exit(1)


def listen_backlog(backlog: int) -> int:
    """The accept queue asked of the kernel: at least the machine's own maximum (net.core.somaxconn), so that
    a burst beyond the connections the router accepts waits there instead of in SYN retries."""
    try:
        with open("/proc/sys/net/core/somaxconn") as f:
            return max(backlog, int(f.read()))
    except (OSError, ValueError):
        return backlog


class EagerAcceptSite(web.BaseSite):
    """A TCP site like aiohttp's TCPSite that drains the accept queue on each readiness event.

    `max_clients`: client connections open at once (`DescriptorBudget.clients`); at that many it stops
    accepting, and new clients wait in the listen backlog until a connection closes."""

    __slots__ = ("_host", "_port", "_reuse_port", "_ssl", "_listeners", "_loop", "_paused", "accepted_total",
                 "max_clients", "clients", "_full", "_local_errors", "full_total")

    def __init__(self, runner: web.BaseRunner, host: str | None, port: int, *, backlog: int = 2048,
                 reuse_port: bool = False, ssl_context: "ssl.SSLContext | None" = None,
                 max_clients: int | None = None, local_errors: LocalResourceErrors | None = None) -> None:
        super().__init__(runner, backlog=backlog)
        self.max_clients = max_clients
        self.clients = 0  # accepted and not closed yet
        self._full = False  # not accepting: max_clients are open
        self.full_total = 0  # times it stopped accepting for that
        self._local_errors = local_errors if local_errors is not None else LocalResourceErrors()
        self._host = host
        self._port = port
        # SO_REUSEPORT: several processes (the replicas of `--replicas N`) listen on one port, each with its own
        # socket and accept queue; the kernel spreads new connections over them. Off by default, so that a
        # second router started on a taken port fails to bind instead of silently sharing it.
        self._reuse_port = reuse_port
        self._ssl = ssl_context  # --tls-cert-path/--tls-key-path: HTTPS on every accepted connection
        self._listeners: list[socket.socket] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._paused: dict[socket.socket, asyncio.TimerHandle] = {}
        self.accepted_total = 0

    @property
    def name(self) -> str:
        host = self._host or "0.0.0.0"
        scheme = "https" if self._ssl is not None else "http"
        return f"{scheme}://{f'[{host}]' if ':' in host else host}:{self.port}"

    @property
    def port(self) -> int:
        return self._listeners[0].getsockname()[1] if self._listeners else self._port

    @property
    def sockets(self) -> list[socket.socket]:
        return list(self._listeners)

    async def start(self) -> None:
        await super().start()
        self._loop = loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(self._host or None, self._port, type=socket.SOCK_STREAM,
                                       flags=socket.AI_PASSIVE)
        seen = set()
        try:
            for family, kind, proto, _, address in infos:
                if (family, address) in seen:
                    continue
                seen.add((family, address))
                sock = socket.socket(family, kind, proto)
                self._listeners.append(sock)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if self._reuse_port:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)  # as asyncio's create_server
                sock.bind(address)
                sock.listen(listen_backlog(self._backlog))
                sock.setblocking(False)
            for sock in self._listeners:
                loop.add_reader(sock.fileno(), self._accept, sock)
            server = self._runner.server
            if isinstance(server, JsonErrorServer):  # the count of open client connections follows their ends
                server.on_connection_lost = self._client_closed
            else:
                self.max_clients = None
        except BaseException:
            self._close_listeners()
            raise

    async def stop(self) -> None:
        self._close_listeners()
        await super().stop()

    def stop_listening(self) -> None:
        """Close the listening sockets (new connections are refused); open connections are served on."""
        self._close_listeners()

    def _close_listeners(self) -> None:
        for handle in self._paused.values():
            handle.cancel()
        self._paused.clear()
        for sock in self._listeners:
            if self._loop is not None and sock.fileno() >= 0:
                self._loop.remove_reader(sock.fileno())
            sock.close()
        self._listeners.clear()

    def _accept(self, listener: socket.socket) -> None:
        """Accept what is waiting (at most a backlog's worth, so that a flood cannot starve the loop)."""
        for _ in range(self._backlog):
            if self.max_clients is not None and self.clients >= self.max_clients:
                self._stop_accepting()
                return
            try:
                conn, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in RESOURCE_ERRORS:
                    kind = local_resource_kind(exc)
                    if kind is not None:
                        self._local_errors.note(kind, "accepting a client connection", exc)
                    else:
                        logger.error("cannot accept connections (%s); pausing %g s", exc, RESOURCE_PAUSE_S)
                    self._loop.remove_reader(listener.fileno())
                    self._paused[listener] = self._loop.call_later(RESOURCE_PAUSE_S, self._resume, listener)
                return  # e.g. ECONNABORTED: the client gave up; the next readiness event brings the rest
            self.accepted_total += 1
            self.clients += 1
            conn.setblocking(False)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._loop.create_task(self._serve(conn))

    def _resume(self, listener: socket.socket) -> None:
        self._paused.pop(listener, None)
        if listener.fileno() >= 0 and not self._full:
            self._loop.add_reader(listener.fileno(), self._accept, listener)

    def _stop_accepting(self) -> None:
        """max_clients are open: new clients wait in the listen backlog until one closes."""
        if self._full:
            return
        self._full = True
        self.full_total += 1
        for sock in self._listeners:
            if sock not in self._paused and sock.fileno() >= 0:
                self._loop.remove_reader(sock.fileno())

    def _client_closed(self) -> None:
        self.clients -= 1
        if self._full and self.clients < self.max_clients:
            self._full = False
            for sock in self._listeners:
                if sock not in self._paused and sock.fileno() >= 0:
                    self._loop.add_reader(sock.fileno(), self._accept, sock)

    async def _serve(self, conn: socket.socket) -> None:
        try:
            if self._ssl is None:
                await self._loop.connect_accepted_socket(self._runner.server, conn)
            else:
                await self._loop.connect_accepted_socket(self._runner.server, conn, ssl=self._ssl,
                                                         ssl_handshake_timeout=TLS_HANDSHAKE_TIMEOUT_S)
        except Exception as exc:  # the client left at once, or the runner is shutting down
            logger.debug("accepted connection dropped: %s", exc)
            conn.close()
            self._client_closed()  # no protocol was made for it: its end is counted here


IDLE_FOR_EVER_S = 365 * 24 * 3600.0


def run(app: web.Application, *, host: str, port: int, loop: asyncio.AbstractEventLoop, backlog: int,
        shutdown_timeout: float, announce: Callable[[str], None],
        wind_down: Callable[[StopSignals], Awaitable[None]] | None = None, reuse_port: bool = False,
        on_listening: Callable[[EagerAcceptSite], None] | None = None,
        ssl_context: "ssl.SSLContext | None" = None, header_read_timeout: float = 0.0,
        idle_connection_timeout: float = 0.0, max_clients: int | None = None) -> None:
    """`web.run_app`'s job (signals, graceful shutdown, cancelling what is left) with EagerAcceptSite.

    On SIGTERM/SIGINT: stop listening, `await wind_down(signals)`, then close: handlers still running get
    `shutdown_timeout` seconds before they are cancelled. `header_read_timeout`, `idle_connection_timeout`: SMG's
    client connection bounds (0: none). `max_clients`: client connections open at once (the rest wait in the
    listen backlog)."""
    runner = RouterRunner(app, handler_cancellation=True,  # a client that disconnects cancels its handler
                          access_log=None, shutdown_timeout=shutdown_timeout,
                          # aiohttp closes at once when 0: "never" is a year
                          keepalive_timeout=idle_connection_timeout or IDLE_FOR_EVER_S,
                          auto_decompress=False)  # the app decodes bodies itself (core/request_body.py)
    signals = StopSignals()

    async def serve() -> None:
        signals.install(asyncio.get_running_loop())
        await runner.setup()
        heads = HeadWatch(runner.server, header_read_timeout) if header_read_timeout else None
        try:
            site = EagerAcceptSite(runner, host, port, backlog=backlog, reuse_port=reuse_port, ssl_context=ssl_context,
                                   max_clients=max_clients, local_errors=app.get(LOCAL_RESOURCES))
            try:
                await site.start()
            except OSError as exc:
                raise ListenError("--host/--port", host, port, exc) from None
            if on_listening is not None:
                on_listening(site)
            announce(f"serving on {site.name}")
            # What exists now lives as long as the process: keep it out of the cyclic collector's full
            # passes (they took up to 45 ms, a p99 spike, with ~70k start-up objects to scan each time).
            gc.collect()
            gc.freeze()
            gc.set_threshold(*GC_THRESHOLDS)
            await signals.requested.wait()
            site.stop_listening()
            if wind_down is not None:
                await wind_down(signals)
        finally:
            if heads is not None:
                heads.close()
            await runner.cleanup()

    asyncio.set_event_loop(loop)
    main = loop.create_task(serve())
    try:
        loop.run_until_complete(main)
    except (web.GracefulExit, KeyboardInterrupt):
        pass
    finally:
        try:
            if not main.done():
                main.cancel()
                try:
                    loop.run_until_complete(main)
                except asyncio.CancelledError:
                    pass
        finally:
            left = asyncio.all_tasks(loop)
            for task in left:
                task.cancel()
            if left:
                loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()
