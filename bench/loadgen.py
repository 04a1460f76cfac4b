"""Closed-loop async load generator, run in its own process: N concurrent clients for D seconds.

    python -m bench.loadgen --url http://127.0.0.1:PORT --concurrency 64 --duration 10 [--stream]
    python -m bench.loadgen --direct-pd P_URL=BOOT_PORT,... --direct-decode D_URL,... ...

Prints one JSON line: requests/s, latency percentiles, errors, and for streams the time to first token.
With --direct-pd the clients do a router's work themselves (pick a P and a D, add the bootstrap fields, send
both legs at once): the zero-cost router that the others are compared against.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import resource
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import aiohttp
import orjson

from bench.workload import generate_request

ROOM_LIMIT = 2**63 - 1


@dataclass
class Tally:
    """What the clients saw inside the measuring window."""

    latencies: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    errors: Counter = field(default_factory=Counter)
    answered: int = 0  # good answers over the whole run, warm-up and answers after the window included


def percentile(sorted_values: list[float], q: float) -> float | None:
    """Nearest-rank percentile of an ascending list (q in [0, 100]); None when empty."""
    if not sorted_values:
        return None
    rank = max(1, -(-len(sorted_values) * q // 100))  # ceil(n * q / 100), at least 1
    return sorted_values[int(rank) - 1]


def summarize(tally: Tally, seconds: float) -> dict:
    lat = sorted(tally.latencies)
    ttft = sorted(tally.ttfts)
    errors = sum(tally.errors.values())

    def ms(value: float | None) -> float | None:
        return None if value is None else round(value * 1000, 3)

    result = {
        "requests": len(lat) + errors,
        "errors": errors,
        "error_kinds": dict(tally.errors),
        "answered": tally.answered,
        "seconds": round(seconds, 3),
        "rps": len(lat) / seconds if seconds > 0 else 0.0,
        "p50_ms": ms(percentile(lat, 50)),
        "p90_ms": ms(percentile(lat, 90)),
        "p99_ms": ms(percentile(lat, 99)),
        "max_ms": ms(lat[-1] if lat else None),
        "mean_ms": ms(sum(lat) / len(lat) if lat else None),
    }
    if ttft:
        result.update(ttft_p50_ms=ms(percentile(ttft, 50)), ttft_p99_ms=ms(percentile(ttft, 99)))
    return result


class DirectPD:
    """The router's job done in the client: random P and D, bootstrap fields, both legs concurrently."""

    def __init__(self, prefill: list[tuple[str, int | None]], decode: list[str]):
        self.prefill = [(url, urlsplit(url).hostname, port) for url, port in prefill]
        self.decode = decode

    def legs(self, body: dict) -> tuple[str, str, bytes]:
        p_url, p_host, p_port = random.choice(self.prefill)
        payload = orjson.dumps({**body, "bootstrap_host": p_host, "bootstrap_port": p_port,
                                "bootstrap_room": random.randint(0, ROOM_LIMIT)})
        return f"{p_url}/generate", f"{random.choice(self.decode)}/generate", payload


async def _post_status(session: aiohttp.ClientSession, url: str, payload: bytes, headers: dict) -> int:
    async with session.post(url, data=payload, headers=headers) as response:
        await response.read()
        return response.status


async def _read_answer(response: aiohttp.ClientResponse, stream: bool, started: float) -> float | None:
    """Consume the answer; return the time to first token for a stream. Raises on a bad answer."""
    if response.status != 200:
        raise _BadAnswer(f"http {response.status}")
    if not stream:
        if not await response.read():
            raise _BadAnswer("empty body")
        return None
    first_token = None
    done = False
    async for line in response.content:
        if not line.startswith(b"data:"):
            continue
        if line.startswith(b"data: [DONE]"):
            done = True
            break
        if first_token is None:
            first_token = time.perf_counter() - started
    if not done:
        raise _BadAnswer("stream ended without [DONE]")
    return first_token


class _BadAnswer(Exception):
    pass


async def _one_request(session: aiohttp.ClientSession, url: str, payload: bytes, stream: bool,
                       direct: DirectPD | None, body: dict) -> float | None:
    headers = {"Content-Type": "application/json"}
    started = time.perf_counter()
    if direct is None:
        async with session.post(url, data=payload, headers=headers) as response:
            return await _read_answer(response, stream, started)
    p_url, d_url, leg_payload = direct.legs(body)
    prefill = asyncio.ensure_future(_post_status(session, p_url, leg_payload, headers))
    try:
        async with session.post(d_url, data=leg_payload, headers=headers) as response:
            ttft = await _read_answer(response, stream, started)
    except BaseException:
        prefill.cancel()
        await asyncio.gather(prefill, return_exceptions=True)
        raise
    p_status = await prefill
    if p_status != 200:
        raise _BadAnswer(f"prefill http {p_status}")
    return ttft


async def _client(session, url, body, stream, direct, window, tally: Tally | None, stop_at: float) -> None:
    payload = orjson.dumps(body)
    while time.perf_counter() < stop_at:
        started = time.perf_counter()
        try:
            ttft = await _one_request(session, url, payload, stream, direct, body)
        except (_BadAnswer, aiohttp.ClientError, asyncio.TimeoutError, OSError) as err:
            if tally is not None and window[0] <= started:
                tally.errors[str(err) if isinstance(err, _BadAnswer) else type(err).__name__] += 1
            continue
        finished = time.perf_counter()
        if tally is not None:
            tally.answered += 1
        # Count requests that started inside the window and finished before its end.
        if tally is not None and window[0] <= started and finished <= window[1]:
            tally.latencies.append(finished - started)
            if ttft is not None:
                tally.ttfts.append(ttft)


async def run_load(*, url: str, concurrency: int, duration: float, warmup: float, stream: bool,
                   direct: DirectPD | None = None, request_timeout: float = 60.0) -> dict:
    body = generate_request(stream)
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=request_timeout)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        tally = Tally()
        now = time.perf_counter()
        window = (now + warmup, now + warmup + duration)
        cpu_before = resource.getrusage(resource.RUSAGE_SELF)
        clients = [_client(session, url, body, stream, direct, window, tally, window[1])
                   for _ in range(concurrency)]
        await asyncio.wait_for(asyncio.gather(*clients), timeout=warmup + duration + request_timeout + 10)
        cpu_after = resource.getrusage(resource.RUSAGE_SELF)
    result = summarize(tally, duration)
    result["loadgen_cpu_s"] = round((cpu_after.ru_utime - cpu_before.ru_utime)
                                    + (cpu_after.ru_stime - cpu_before.ru_stime), 3)
    return result


def _parse_prefill(spec: str) -> list[tuple[str, int | None]]:
    out = []
    for item in filter(None, spec.split(",")):
        url, _, port = item.partition("=")
        out.append((url, int(port) if port and port != "none" else None))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="router base URL (requests go to URL/generate)")
    parser.add_argument("--direct-pd", help="prefill servers as URL=BOOTSTRAP_PORT,... (no router)")
    parser.add_argument("--direct-decode", help="decode servers as URL,... (with --direct-pd)")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--request-timeout", type=float, default=60.0)
    args = parser.parse_args(argv)
    direct = None
    if args.direct_pd:
        if not args.direct_decode:
            parser.error("--direct-pd needs --direct-decode")
        direct = DirectPD(_parse_prefill(args.direct_pd), args.direct_decode.split(","))
    elif not args.url:
        parser.error("give --url or --direct-pd/--direct-decode")
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    result = asyncio.run(run_load(url=f"{args.url}/generate" if args.url else "", concurrency=args.concurrency,
                                  duration=args.duration, warmup=args.warmup, stream=args.stream, direct=direct,
                                  request_timeout=args.request_timeout))
    sys.stdout.write(orjson.dumps(result).decode() + "\n")


if __name__ == "__main__":
    main()
