"""The legs' HTTP/1.1 client (router/upstream_http.py) against real loopback servers that answer scripted bytes."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from dataclasses import dataclass, field

import pytest

from router.dataplane.upstream_http import (UpstreamConnectError, UpstreamError, UpstreamPool, UpstreamProtocolError,
                                  header_lines)

from .helpers import free_port, wait_for

JSON_OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json; charset=utf-8\r\nContent-Length: 12\r\n\r\n{\"ok\": true}"


@dataclass
class Seen:
    """One request as the server read it."""

    connection: int
    index: int  # its position on its connection
    head: bytes
    body: bytes


@dataclass
class ScriptedServer:
    """A TCP server that reads HTTP requests and lets the test answer each with raw bytes.

    `answer(seen, writer)` is awaited per request; it writes what it likes and returns False to close the
    connection afterwards. Records every request and every connection that ended (EOF or reset)."""

    answer: object
    requests: list[Seen] = field(default_factory=list)
    connections: int = 0
    ended: int = 0
    server: asyncio.AbstractServer | None = None
    writers: list = field(default_factory=list)

    async def __aenter__(self) -> "ScriptedServer":
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()
        for writer in self.writers:
            writer.close()
        await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        number = self.connections
        self.connections += 1
        self.writers.append(writer)
        index = 0
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    break
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                body = await reader.readexactly(length)
                seen = Seen(number, index, head, body)
                self.requests.append(seen)
                index += 1
                keep = await self.answer(seen, writer)
                await writer.drain()
                if keep is False:
                    break
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self.ended += 1  # the client closed, or we are about to
            writer.close()


def answering(*chunks: bytes, keep: bool = True):
    async def answer(seen, writer):
        for chunk in chunks:
            writer.write(chunk)
            await writer.drain()
        return keep
    return answer


@contextlib.asynccontextmanager
async def pool_factory():
    pools = []

    def make(**kw) -> UpstreamPool:
        pools.append(UpstreamPool(**kw))
        return pools[-1]

    try:
        yield make
    finally:
        for p in pools:
            await p.close()


@pytest.fixture
async def pool():
    async with pool_factory() as make:
        yield make


async def test_content_length_answer_and_keep_alive_reuse(pool):
    async with ScriptedServer(answering(JSON_OK)) as server:
        client = pool()
        for i in range(3):
            response = await client.post(server.url, "/generate", b'{"i": %d}' % i,
                                         header_lines({"X-Request-Id": "abc"}))
            assert response.status == 200
            assert response.content_type == "application/json"
            assert response.header("content-type") == "application/json; charset=utf-8"
            assert response.header("X-Missing") is None
            assert await response.read() == b'{"ok": true}'
            response.close()
        assert client.connects_total == 1 and server.connections == 1
        assert [s.body for s in server.requests] == [b'{"i": 0}', b'{"i": 1}', b'{"i": 2}']
        head = server.requests[0].head
        assert head.startswith(b"POST /generate HTTP/1.1\r\n")
        assert f"Host: 127.0.0.1:{server.port}\r\n".encode() in head
        assert b"Content-Type: application/json\r\n" in head and b"Content-Length: 8\r\n" in head
        assert b"X-Request-Id: abc\r\n" in head
        assert client.in_use == 0


async def test_chunked_answer_split_at_every_byte(pool):
    body = b"4\r\nWiki\r\n6;ext=1\r\npedia \r\nE\r\nin \r\n\r\nchunks.\r\n0\r\nX-Trailer: yes\r\n\r\n"
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    wire = head + body
    async with ScriptedServer(answering(*[wire[i:i + 1] for i in range(len(wire))])) as server:
        client = pool()
        for _ in range(2):
            response = await client.post(server.url, "/generate", b"{}")
            assert response.content_type == "text/event-stream"
            assert await response.read() == b"Wikipedia in \r\n\r\nchunks."
        assert client.connects_total == 1  # read to its end: reused


async def test_stream_pieces_arrive_before_the_body_ends(pool):
    second = asyncio.Event()

    async def answer(seen, writer):
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n7\r\ndata: 1\r\n")
        await writer.drain()
        await second.wait()  # the client must have the first piece before the second exists
        writer.write(b"7\r\ndata: 2\r\n0\r\n\r\n")
        return True

    async with ScriptedServer(answer) as server:
        client = pool()
        response = await client.post(server.url, "/generate", b"{}")
        assert await response.next_chunk() == b"data: 1"
        second.set()
        pieces = [piece async for piece in response]
        assert pieces == [b"data: 2"]
        assert response.complete
        assert client.idle_connections(server.url) == 1


async def test_body_until_close_is_read_and_the_connection_not_reused(pool):
    async with ScriptedServer(answering(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nall of it", keep=False)) as server:
        client = pool()
        for _ in range(2):
            response = await client.post(server.url, "/generate", b"{}")
            assert await response.read() == b"all of it"
        assert client.connects_total == 2


async def test_connection_close_header_is_honoured(pool):
    async with ScriptedServer(answering(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok")) as server:
        client = pool()
        for _ in range(2):
            response = await client.post(server.url, "/generate", b"{}")
            assert await response.read() == b"ok"
        assert client.connects_total == 2
        await wait_for(lambda: server.ended == 1)


async def test_no_body_statuses(pool):
    answers = iter([b"HTTP/1.1 204 No Content\r\n\r\n", b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"])

    async def answer(seen, writer):
        writer.write(next(answers))
        return True

    async with ScriptedServer(answer) as server:
        client = pool()
        for status in (204, 200):
            response = await client.post(server.url, "/generate", b"{}")
            assert response.status == status and await response.read() == b""
        assert client.connects_total == 1 and client.in_use == 0


async def test_interim_100_answer_is_skipped(pool):
    async with ScriptedServer(answering(b"HTTP/1.1 100 Continue\r\n\r\n" + JSON_OK)) as server:
        response = await pool().post(server.url, "/generate", b"{}")
        assert response.status == 200 and await response.read() == b'{"ok": true}'


async def test_server_closing_an_idle_connection_costs_nothing(pool):
    async with ScriptedServer(answering(JSON_OK, keep=False)) as server:
        client = pool()
        first = await client.post(server.url, "/generate", b"{}")
        assert await first.read() == b'{"ok": true}'
        # Content-Length framed and keep-alive: pooled, until the server's close arrives.
        await wait_for(lambda: client.idle_connections(server.url) == 0, message="the pool saw the close")
        second = await client.post(server.url, "/generate", b"{}")
        assert await second.read() == b'{"ok": true}'
        assert client.connects_total == 2 and client.stale_retries_total == 0
        assert len(server.requests) == 2


async def test_connections_idle_past_the_idle_timeout_are_not_reused(pool):
    async with ScriptedServer(answering(JSON_OK)) as server:
        client = pool(idle_timeout=0.0)  # every pooled connection is already too old when asked for
        for _ in range(2):
            response = await client.post(server.url, "/generate", b"{}")
            assert await response.read() == b'{"ok": true}'
        assert client.connects_total == 2
        await wait_for(lambda: server.ended == 1, message="the expired connection was closed")


async def test_stale_reused_connection_is_retried_once_on_a_fresh_one(pool):
    async def answer(seen, writer):
        if seen.connection == 0 and seen.index == 1:
            return False  # close without a byte of answer: what a server timing out an idle connection does
        writer.write(JSON_OK)
        return True

    async with ScriptedServer(answer) as server:
        client = pool()
        for _ in range(2):
            response = await client.post(server.url, "/generate", b"{}")
            assert await response.read() == b'{"ok": true}'
        assert client.stale_retries_total == 1 and client.connects_total == 2
        assert [(s.connection, s.index) for s in server.requests] == [(0, 0), (0, 1), (1, 0)]


async def test_fresh_connection_closed_before_answering_is_not_retried(pool):
    async with ScriptedServer(answering(keep=False)) as server:
        client = pool()
        with pytest.raises(UpstreamProtocolError, match="before answering"):
            await client.post(server.url, "/generate", b"{}")
        assert len(server.requests) == 1 and client.stale_retries_total == 0 and client.in_use == 0


async def test_reused_connection_cut_after_some_answer_is_not_retried(pool):
    async def answer(seen, writer):
        writer.write(JSON_OK if seen.index == 0 else b"HTTP/1.1 200 OK\r\nContent-Le")
        return seen.index == 0

    async with ScriptedServer(answer) as server:
        client = pool()
        first = await client.post(server.url, "/generate", b"{}")
        await first.read()
        with pytest.raises(UpstreamProtocolError):
            await client.post(server.url, "/generate", b"{}")
        assert len(server.requests) == 2 and client.stale_retries_total == 0 and client.in_use == 0


async def test_body_cut_mid_way_is_an_error(pool):
    async with ScriptedServer(answering(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial", keep=False)) as server:
        client = pool()
        response = await client.post(server.url, "/generate", b"{}")
        with pytest.raises(UpstreamProtocolError, match="before the end of the body"):
            await response.read()
        assert client.in_use == 0


async def test_cancelled_mid_body_closes_the_connection(pool):
    async with ScriptedServer(answering(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial")) as server:
        client = pool()
        got_part = asyncio.Event()

        async def leg():
            response = await client.post(server.url, "/generate", b"{}")
            try:
                assert await response.next_chunk() == b"partial"
                got_part.set()
                await response.read()
            finally:
                response.close()

        task = asyncio.ensure_future(leg())
        await got_part.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_for(lambda: server.ended == 1, message="the server saw the connection close")
        assert client.in_use == 0 and client.idle_connections(server.url) == 0
        assert client.open_connections == 0 or all(c.lost for c in client._connections)


async def test_cancelled_while_waiting_for_the_head_closes_the_connection(pool):
    async def never(seen, writer):
        await asyncio.Event().wait()

    async with ScriptedServer(never) as server:
        client = pool()
        task = asyncio.ensure_future(client.post(server.url, "/generate", b"{}"))
        await wait_for(lambda: len(server.requests) == 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert client.in_use == 0 and client.idle_connections(server.url) == 0
        await wait_for(lambda: client.open_connections == 0, message="the connection closed")


async def test_a_stream_closed_early_is_not_reused(pool):
    async with ScriptedServer(answering(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n")) as server:
        client = pool()
        response = await client.post(server.url, "/generate", b"{}")
        assert await response.next_chunk() == b"abc"
        response.close()
        assert client.in_use == 0 and client.idle_connections(server.url) == 0
        await wait_for(lambda: server.ended == 1)
        with pytest.raises(UpstreamError):
            await response.read()


async def test_connect_refused(pool):
    client = pool()
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(UpstreamConnectError, match="cannot connect"):
        await client.post(url, "/generate", b"{}")
    assert client.in_use == 0 and client.open_connections == 0


async def test_connect_timeout(pool):
    client = pool(connect_timeout=0.05)

    class HangingLoop:
        """The running loop, except that connecting never completes (a black-holed address)."""

        def __init__(self, loop):
            self._loop = loop

        def __getattr__(self, name):
            return getattr(self._loop, name)

        async def create_connection(self, *args, **kwargs):
            await asyncio.Event().wait()

    client.loop = HangingLoop(client.loop)
    with pytest.raises(UpstreamConnectError, match="no connection within"):
        await client.post("http://127.0.0.1:9", "/generate", b"{}")
    assert client.in_use == 0


GARBLED_HEADS = [
    (b"HTTP/1.1 200 OK\r\nX-Big: " + b"x" * 70000 + b"\r\n\r\n", "head larger"),
    (b"SSH-2.0-OpenSSH\r\n\r\n", "malformed status line"),
    (b"HTTP/1.1 2x0 OK\r\n\r\n", "malformed status line"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: ten\r\n\r\n", "malformed Content-Length"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n", "conflicting Content-Length"),
]
GARBLED_CHUNKED = [
    (b"zz\r\nabc\r\n0\r\n\r\n", "malformed chunk size"),
    (b"3\r\nabcXY0\r\n\r\n", "no CRLF after a chunk"),
]


@pytest.mark.parametrize("wire, message", GARBLED_HEADS)
async def test_garbled_or_oversized_heads_are_errors(pool, wire, message):
    async with ScriptedServer(answering(wire)) as server:
        client = pool()
        with pytest.raises(UpstreamProtocolError, match=message):
            response = await client.post(server.url, "/generate", b"{}")
            await response.read()
        assert client.in_use == 0 and client.idle_connections(server.url) == 0
        await wait_for(lambda: server.ended == 1, message="the connection was closed")


@pytest.mark.parametrize("body, message", GARBLED_CHUNKED)
async def test_garbled_chunked_bodies_are_errors(pool, body, message):
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    async with ScriptedServer(answering(head + body)) as server:
        client = pool()
        response = await client.post(server.url, "/generate", b"{}")
        with pytest.raises(UpstreamProtocolError, match=message):
            await response.read()
        assert client.in_use == 0 and client.idle_connections(server.url) == 0


async def test_oversized_body_is_refused(pool):
    async with ScriptedServer(answering(b"HTTP/1.1 200 OK\r\nContent-Length: 2000\r\n\r\n" + b"x" * 2000)) as server:
        client = pool(max_body_size=1000)
        response = await client.post(server.url, "/generate", b"{}")
        with pytest.raises(UpstreamProtocolError, match="larger than 1000"):
            await response.read()
        assert client.in_use == 0
        with pytest.raises(UpstreamProtocolError, match="larger than 1000"):
            await response.read()


async def test_bytes_past_the_message_end_prevent_reuse(pool):
    async with ScriptedServer(answering(JSON_OK + b"HTTP/1.1 200 OK\r\n")) as server:
        client = pool()
        for _ in range(2):
            response = await client.post(server.url, "/generate", b"{}")
            assert await response.read() == b'{"ok": true}'
        assert client.connects_total == 2


async def test_in_use_bound_makes_callers_wait_their_turn(pool):
    release = asyncio.Event()

    async def answer(seen, writer):
        if seen.index == 0:
            await release.wait()
        writer.write(JSON_OK)
        return True

    async with ScriptedServer(answer) as server:
        client = pool(max_connections=1)
        first = asyncio.ensure_future(client.post(server.url, "/generate", b"{}"))
        await wait_for(lambda: len(server.requests) == 1)
        second = asyncio.ensure_future(client.post(server.url, "/generate", b"{}"))
        await wait_for(lambda: len(client._slot_waiters) == 1, message="the second caller waits for a slot")
        assert len(server.requests) == 1 and not second.done()
        release.set()
        for task in (first, second):
            response = await task
            assert await response.read() == b'{"ok": true}'
        assert client.connects_total == 1 and client.in_use == 0


async def test_waiting_caller_cancelled_gives_no_slot_away(pool):
    async def never(seen, writer):
        await asyncio.Event().wait()

    async with ScriptedServer(never) as server:
        client = pool(max_connections=1)
        first = asyncio.ensure_future(client.post(server.url, "/generate", b"{}"))
        await wait_for(lambda: len(server.requests) == 1)
        second = asyncio.ensure_future(client.post(server.url, "/generate", b"{}"))
        await wait_for(lambda: len(client._slot_waiters) == 1)
        second.cancel()
        first.cancel()
        for task in (first, second):
            with pytest.raises(asyncio.CancelledError):
                await task
        assert client.in_use == 0 and not client._slot_waiters


async def test_oversized_body_still_arriving_closes_the_connection(pool):
    async with ScriptedServer(answering(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n" + b"x" * 5000)) as server:
        client = pool(max_body_size=1000)
        response = await client.post(server.url, "/generate", b"{}")
        with pytest.raises(UpstreamProtocolError, match="larger than 1000"):
            await response.read()
        assert client.in_use == 0 and client.idle_connections(server.url) == 0
        await wait_for(lambda: server.ended == 1, message="the connection was closed")


async def test_large_bodies_pause_reading_and_arrive_whole(pool):
    big = bytes(range(256)) * (3 * 4096)  # 3 MiB: beyond the buffered amount at which reading pauses
    pieces = [big[i:i + 200_000] for i in range(0, len(big), 200_000)]
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"
    answers = iter([b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(big) + big,
                    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked])

    async def answer(seen, writer):
        writer.write(next(answers))
        return True

    async with ScriptedServer(answer) as server:
        client = pool()
        whole = await client.post(server.url, "/generate", b"{}")
        await wait_for(lambda: whole._paused, message="reading paused while nobody consumed the body")
        assert await whole.read() == big
        streamed = await client.post(server.url, "/generate", b"{}")
        got = bytearray()
        async for piece in streamed:
            got += piece
        assert bytes(got) == big
        assert client.connects_total == 1 and client.in_use == 0  # both read to their end: one connection


def test_header_lines_refuse_injection():
    assert header_lines({"Authorization": "Bearer k"}) == b"Authorization: Bearer k\r\n"
    with pytest.raises(ValueError):
        header_lines({"X-Request-Id": "a\r\nHost: evil"})


# The router serves on uvloop while the suite runs on asyncio's loop: every scenario above runs on uvloop too.
_PARAMETRIZED = {"test_garbled_or_oversized_heads_are_errors": GARBLED_HEADS,
                 "test_garbled_chunked_bodies_are_errors": GARBLED_CHUNKED}
UVLOOP_CASES = [pytest.param(f, args, id=f"{name}-{i}" if name in _PARAMETRIZED else name)
                for name, f in list(globals().items())
                if name.startswith("test_") and inspect.iscoroutinefunction(f)
                for i, args in enumerate(_PARAMETRIZED.get(name, [()]))]


@pytest.mark.parametrize("scenario, args", UVLOOP_CASES)
def test_on_uvloop(scenario, args):
    import uvloop

    async def run():
        async with pool_factory() as make:
            await scenario(make, *args)

    uvloop.run(run())
