"""Serving the app: aiohttp's runner, on a listening socket that accepts every waiting connection at once.

Why not `web.run_app`'s TCPSite: on uvloop, libuv (since 1.45) accepts one connection per loop iteration.
Under load an iteration takes milliseconds, so a burst of new clients (a load test's ramp, clients
reconnecting after a restart) waits in the accept queue: 256 connections at once took 2-3 s to be
accepted at ~2,500 requests/s. Here the listening socket is polled by the loop, and each time it is
readable every pending connection (up to the backlog) is accepted and handed to aiohttp.
"""

from __future__ import annotations

import asyncio
import errno
import gc
import logging
import socket
from typing import Callable

from aiohttp import web

logger = logging.getLogger(__name__)

# Out of descriptors or memory: stop accepting for a moment instead of spinning on a readable socket.
RESOURCE_ERRORS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
RESOURCE_PAUSE_S = 1.0


class EagerAcceptSite(web.BaseSite):
    """A TCP site like aiohttp's TCPSite that drains the accept queue on each readiness event."""

    __slots__ = ("_host", "_port", "_listeners", "_loop", "_paused", "accepted_total")

    def __init__(self, runner: web.BaseRunner, host: str | None, port: int, *, backlog: int = 2048) -> None:
        super().__init__(runner, backlog=backlog)
        self._host = host
        self._port = port
        self._listeners: list[socket.socket] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._paused: dict[socket.socket, asyncio.TimerHandle] = {}
        self.accepted_total = 0

    @property
    def name(self) -> str:
        host = self._host or "0.0.0.0"
        return f"http://{f'[{host}]' if ':' in host else host}:{self.port}"

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
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)  # as asyncio's create_server
                sock.bind(address)
                sock.listen(self._backlog)
                sock.setblocking(False)
            for sock in self._listeners:
                loop.add_reader(sock.fileno(), self._accept, sock)
        except BaseException:
            self._close_listeners()
            raise

    async def stop(self) -> None:
        self._close_listeners()
        await super().stop()

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
            try:
                conn, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in RESOURCE_ERRORS:
                    logger.error("cannot accept connections (%s); pausing %g s", exc, RESOURCE_PAUSE_S)
                    self._loop.remove_reader(listener.fileno())
                    self._paused[listener] = self._loop.call_later(RESOURCE_PAUSE_S, self._resume, listener)
                return  # e.g. ECONNABORTED: the client gave up; the next readiness event brings the rest
            self.accepted_total += 1
            conn.setblocking(False)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._loop.create_task(self._serve(conn))

    def _resume(self, listener: socket.socket) -> None:
        self._paused.pop(listener, None)
        if listener.fileno() >= 0:
            self._loop.add_reader(listener.fileno(), self._accept, listener)

    async def _serve(self, conn: socket.socket) -> None:
        try:
            await self._loop.connect_accepted_socket(self._runner.server, conn)
        except Exception as exc:  # the client left at once, or the runner is shutting down
            logger.debug("accepted connection dropped: %s", exc)
            conn.close()


def run(app: web.Application, *, host: str, port: int, loop: asyncio.AbstractEventLoop, backlog: int,
        shutdown_timeout: float, announce: Callable[[str], None]) -> None:
    """`web.run_app`'s job (signals, graceful shutdown, cancelling what is left) with EagerAcceptSite."""
    runner = web.AppRunner(app, handler_cancellation=True,  # a client that disconnects cancels its handler
                           access_log=None, shutdown_timeout=shutdown_timeout)

    async def serve() -> None:
        await runner.setup()
        try:
            site = EagerAcceptSite(runner, host, port, backlog=backlog)
            await site.start()
            announce(f"serving on {site.name}")
            # What exists now lives as long as the process: keep it out of the cyclic collector's full
            # passes (they took up to 45 ms, a p99 spike, with ~70k start-up objects to scan each time).
            gc.collect()
            gc.freeze()
            while True:
                await asyncio.sleep(3600)
        finally:
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
