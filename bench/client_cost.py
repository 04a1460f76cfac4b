"""What one upstream POST costs a Python router in CPU: `python -m bench.client_cost`.

Against an instant nginx backend, in this process, on uvloop, 16 concurrent callers:
- aiohttp's ClientSession on a keep-alive pool (what pd-router's legs use),
- the same with a new connection per request (a leg whose connection was closed by an abort),
- a minimal keep-alive HTTP/1.1 protocol client (Content-Length answers only): the floor Python allows.
Prints CPU microseconds per request and each as a ratio to the pooled aiohttp figure.
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import sys
import tempfile
from pathlib import Path

import aiohttp
import orjson

from bench.ceiling import CeilingFleet
from bench.workload import GENERATE_REQUEST

BODY = orjson.dumps(GENERATE_REQUEST)
HEADERS = {"Content-Type": "application/json"}


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def _measure(call, requests: int, concurrency: int) -> float:
    """CPU microseconds per call, after a warm-up of 20 calls per caller."""
    async def caller(count: int) -> None:
        for _ in range(count):
            await call()

    await asyncio.gather(*[caller(20) for _ in range(concurrency)])
    before = _cpu()
    await asyncio.gather(*[caller(requests // concurrency) for _ in range(concurrency)])
    return (_cpu() - before) / (requests // concurrency * concurrency) * 1e6


async def aiohttp_cost(url: str, *, new_connections: bool, requests: int, concurrency: int) -> float:
    connector = aiohttp.TCPConnector(limit=0, force_close=new_connections)
    async with aiohttp.ClientSession(connector=connector) as session:
        async def call() -> None:
            async with session.post(url, data=BODY, headers=HEADERS) as response:
                await response.read()
                if response.status != 200:
                    raise RuntimeError(f"backend answered {response.status}")

        return await _measure(call, requests, concurrency)


class _MinimalConnection(asyncio.Protocol):
    """One keep-alive connection, one request at a time, Content-Length answers only."""

    def __init__(self) -> None:
        self.buffer = bytearray()
        self.waiter: asyncio.Future | None = None
        self.head_end: int | None = None
        self.message_end = 0

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if self.head_end is None:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            self.head_end = end + 4
            head = bytes(self.buffer[:end]).lower()
            at = head.find(b"content-length:")
            line_end = head.find(b"\r\n", at)
            self.message_end = self.head_end + int(head[at + 15:line_end if line_end >= 0 else len(head)])
        if len(self.buffer) >= self.message_end:
            status = int(self.buffer[9:12])
            body = bytes(self.buffer[self.head_end:self.message_end])
            del self.buffer[:self.message_end]
            self.head_end = None
            self.waiter.set_result((status, body))

    def connection_lost(self, exc) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError("backend closed the connection"))

    async def post(self, head: bytes) -> tuple[int, bytes]:
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.writelines((head, BODY))
        return await self.waiter


async def minimal_cost(host: str, port: int, *, requests: int, concurrency: int) -> float:
    loop = asyncio.get_running_loop()
    idle = [(await loop.create_connection(_MinimalConnection, host, port))[1] for _ in range(concurrency)]
    head = (b"POST /generate HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
            % (host.encode(), port, len(BODY)))

    async def call() -> None:
        connection = idle.pop()
        try:
            status, body = await connection.post(head)
        finally:
            idle.append(connection)
        if status != 200 or not body:
            raise RuntimeError(f"backend answered {status}")

    try:
        return await _measure(call, requests, concurrency)
    finally:
        for connection in idle:
            connection.transport.close()


async def compare(url: str, requests: int, concurrency: int) -> dict[str, float]:
    host, port = url.split("//", 1)[1].split(":")
    generate = f"{url}/generate"
    return {
        "aiohttp pooled": await aiohttp_cost(generate, new_connections=False, requests=requests,
                                             concurrency=concurrency),
        "aiohttp new connection": await aiohttp_cost(generate, new_connections=True, requests=requests,
                                                     concurrency=concurrency),
        "minimal protocol": await minimal_cost(host, int(port), requests=requests, concurrency=concurrency),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args(argv)
    import uvloop

    with tempfile.TemporaryDirectory(prefix="bench-client-cost-") as tmp, CeilingFleet(Path(tmp)) as fleet:
        costs = uvloop.run(compare(fleet.decode[0], args.requests, args.concurrency))
    base = costs["aiohttp pooled"]
    for name, micros in costs.items():
        print(f"{name:<24} {micros:7.0f} us CPU per request  ({micros / base:.2f}x aiohttp pooled)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
