"""router/serving.py: the listening site accepts every waiting connection at once, and serves them."""

from __future__ import annotations

import asyncio
import socket
import sys

import pytest
from aiohttp import web

from router.server.serving import EagerAcceptSite

from .helpers import wait_for


@pytest.fixture
async def site():
    app = web.Application()

    async def hello(request: web.Request) -> web.Response:
        return web.Response(text=f"hello {request.match_info['n']}")

    app.router.add_get("/hello/{n}", hello)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = EagerAcceptSite(runner, "127.0.0.1", 0, backlog=64)
    await site.start()
    yield site
    await runner.cleanup()


async def test_one_readiness_event_accepts_every_waiting_connection(site):
    loop = asyncio.get_running_loop()
    listener = site.sockets[0]
    loop.remove_reader(listener.fileno())  # hold the loop off: connections queue up in the kernel
    clients = []
    try:
        for _ in range(20):
            client = socket.create_connection(("127.0.0.1", site.port))  # completes from the accept queue
            clients.append(client)
        site._accept(listener)  # what one readiness event does
        assert site.accepted_total == 20
        loop.add_reader(listener.fileno(), site._accept, listener)
        readers = []
        for n, client in enumerate(clients):
            client.setblocking(False)
            reader, writer = await asyncio.open_connection(sock=client)
            writer.write(f"GET /hello/{n} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
            readers.append((reader, writer))
        for n, (reader, writer) in enumerate(readers):
            answer = await reader.read()
            assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(f"hello {n}".encode())
            writer.close()
    finally:
        for client in clients:
            client.close()


async def test_serves_over_the_loop_and_stops_listening(site):
    reader, writer = await asyncio.open_connection("127.0.0.1", site.port)
    writer.write(b"GET /hello/x HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert (await reader.read()).endswith(b"hello x")
    writer.close()
    port = site.port
    assert site.name == f"http://127.0.0.1:{port}"
    await site.stop()
    assert site.sockets == []
    with pytest.raises(ConnectionRefusedError):
        await asyncio.open_connection("127.0.0.1", port)


async def test_a_client_gone_before_it_is_served_costs_nothing(site):
    loop = asyncio.get_running_loop()
    listener = site.sockets[0]
    loop.remove_reader(listener.fileno())
    gone = socket.create_connection(("127.0.0.1", site.port))
    gone.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST on close
    gone.close()
    site._accept(listener)
    loop.add_reader(listener.fileno(), site._accept, listener)
    reader, writer = await asyncio.open_connection("127.0.0.1", site.port)
    writer.write(b"GET /hello/y HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert (await reader.read()).endswith(b"hello y")
    writer.close()
    await wait_for(lambda: site.accepted_total >= 2)


async def test_reuse_port_lets_sites_share_a_port_and_only_then():
    """`--replicas N`: each child binds the port with SO_REUSEPORT; without it a taken port fails to bind."""
    async def who(request: web.Request) -> web.Response:
        return web.Response(text="x")

    app = web.Application()
    app.router.add_get("/who", who)
    runners = [web.AppRunner(app, access_log=None) for _ in range(3)]
    for runner in runners:
        await runner.setup()
    try:
        first = EagerAcceptSite(runners[0], "127.0.0.1", 0, reuse_port=True)
        await first.start()
        second = EagerAcceptSite(runners[1], "127.0.0.1", first.port, reuse_port=True)
        await second.start()
        assert second.port == first.port
        lone = EagerAcceptSite(runners[2], "127.0.0.1", first.port)
        with pytest.raises(OSError, match="in use"):
            await lone.start()
        for _ in range(40):  # new connections are spread over both sites' accept queues
            reader, writer = await asyncio.open_connection("127.0.0.1", first.port)
            writer.write(b"GET /who HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert (await reader.read()).endswith(b"x")
            writer.close()
        await wait_for(lambda: first.accepted_total + second.accepted_total == 40)
        assert first.accepted_total > 0 and second.accepted_total > 0
    finally:
        for runner in runners:
            await runner.cleanup()


@pytest.mark.parametrize("flag", ["--port", "--prometheus-port"])
async def test_a_port_taken_is_one_error_line_and_exit_1_not_a_traceback(flag):
    """An operator starting a second router on a port in use: `pd-router` says where it cannot listen and why,
    in one line, and exits 1."""
    from simulator.fleet import Fleet

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    free_port = free.getsockname()[1]
    free.close()
    try:
        async with Fleet(1, 1) as fleet:
            ports = {"--port": port, "--prometheus-port": free_port}
            if flag == "--prometheus-port":
                ports = {"--port": free_port, "--prometheus-port": port}
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "router", "--host", "127.0.0.1", "--prefill", fleet.prefill[0].url,
                str(fleet.prefill[0].bootstrap_port), "--decode", fleet.decode[0].url,
                *(str(v) for kv in ports.items() for v in kv), stderr=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE)
            _, err = await asyncio.wait_for(proc.communicate(), timeout=60)
    finally:
        taken.close()
    text = err.decode()
    assert proc.returncode == 1, text
    assert "Traceback" not in text, text
    assert f"cannot listen on 127.0.0.1:{port} ({'--host/--port' if flag == '--port' else flag})" in text, text


async def test_at_max_clients_new_clients_wait_in_the_backlog_until_one_closes():
    from router.server.http_errors import RouterRunner

    app = web.Application()

    async def hello(request: web.Request) -> web.Response:
        return web.Response(text="hello")

    app.router.add_get("/hello", hello)
    runner = RouterRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = EagerAcceptSite(runner, "127.0.0.1", 0, backlog=64, max_clients=2)
    await site.start()
    streams = []
    try:
        for _ in range(3):  # the kernel completes all three from the listen backlog
            streams.append(await asyncio.open_connection("127.0.0.1", site.port))
        await wait_for(lambda: site.clients == 2 and site.full_total == 1, message="two accepted, then full")
        assert site.accepted_total == 2
        reader, writer = streams[2]
        writer.write(b"GET /hello HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        streams[0][1].close()  # one closes: the third is accepted and answered
        answer = await asyncio.wait_for(reader.read(), 10)
        assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"hello")
        assert site.accepted_total == 3
    finally:
        for _, writer in streams:
            writer.close()
        await runner.cleanup()
