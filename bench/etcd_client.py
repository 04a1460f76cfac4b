"""What the etcd gateway client costs, against a bare HTTP call to the same etcd: `python -m bench.etcd_client`.

    python -m bench.etcd_client [--ops 300] [--rounds 3] [--concurrency 16] [--no-fsync]

Starts a one-member etcd (router/cluster/etcd_process.py) and, in this process, measures one call at a time:
- baselines: a plain aiohttp GET of etcd's /health (a quorum read inside etcd) and a bare aiohttp POST of
  /v3/kv/range (the gateway, no client code);
- the client: get, put, create (a transaction: create-if-absent on a leased key), replace (compare-and-swap),
  keep_alive_once, and watch delivery (from a put's send to the event coming out of a watch's iterator);
then puts and /health GETs from `concurrency` callers at once (calls/s). Operations are interleaved in rounds
so the machine's other users disturb all of them alike. Prints one JSON line per operation (p50/p99 ms,
client CPU µs per call) with its latency as a ratio of the /health baseline, then a table.
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import statistics
import sys
import time

import aiohttp
import orjson

from router.cluster.etcd import EtcdClient
from router.cluster.etcd_process import EtcdProcess
from router.cluster.etcd_types import b64

BASELINE = "health_get"


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(samples: dict[str, list[float]], cpu: dict[str, float]) -> list[dict]:
    """One row per operation: p50/p99 ms, CPU µs per call, and p50 as a ratio of the baseline's."""
    base = statistics.median(samples[BASELINE]) if samples.get(BASELINE) else None
    rows = []
    for name, values in samples.items():
        p50 = statistics.median(values)
        rows.append({"op": name, "calls": len(values), "p50_ms": round(p50 * 1e3, 3),
                     "p99_ms": round(percentile(values, 0.99) * 1e3, 3),
                     "cpu_us_per_call": round(cpu[name] / len(values) * 1e6, 1),
                     "p50_vs_health": round(p50 / base, 2) if base else None})
    return rows


class Bench:
    def __init__(self, client: EtcdClient, session: aiohttp.ClientSession, url: str):
        self.client = client
        self.session = session
        self.url = url
        self.counter = 0
        self.lease = 0
        self.cas_revision = 0

    async def health_get(self) -> None:
        async with self.session.get(self.url + "/health") as reply:
            await reply.read()

    async def raw_range(self) -> None:
        async with self.session.post(self.url + "/v3/kv/range", data=orjson.dumps({"key": b64("/bench/k")})) as reply:
            await reply.read()

    async def get(self) -> None:
        await self.client.get("/bench/k")

    async def put(self) -> None:
        await self.client.put("/bench/k", b"v" * 64)

    async def create(self) -> None:
        self.counter += 1
        await self.client.create(f"/bench/op/{self.counter}", b"owner", lease=self.lease)

    async def replace(self) -> None:
        self.cas_revision = await self.client.replace("/bench/cas", b"x", mod_revision=self.cas_revision)

    async def keep_alive(self) -> None:
        await self.client.keep_alive_once(self.lease)


async def watch_delivery(client: EtcdClient, count: int) -> tuple[list[float], float]:
    """Seconds from a put's send to its event leaving the watch iterator, one put at a time; CPU seconds."""
    async with client.watch("/bench/watched", start_revision=(await client.status())["revision"] + 1) as watch:
        await client.put("/bench/watched", b"warm-up")  # the stream is open and warm before anything is timed
        assert (await asyncio.wait_for(anext(watch), 10.0)).value == b"warm-up"
        latencies = []
        cpu_before = _cpu()
        for index in range(count):
            sent = time.perf_counter()
            await client.put("/bench/watched", str(index))
            event = await asyncio.wait_for(anext(watch), 10.0)
            latencies.append(time.perf_counter() - sent)
            assert event.value == str(index).encode()
        return latencies, _cpu() - cpu_before


async def throughput(call, calls: int, concurrency: int) -> float:
    async def caller(count: int) -> None:
        for _ in range(count):
            await call()

    began = time.perf_counter()
    await asyncio.gather(*[caller(calls // concurrency) for _ in range(concurrency)])
    return calls // concurrency * concurrency / (time.perf_counter() - began)


async def run(args: argparse.Namespace) -> dict:
    async with EtcdProcess(fsync=not args.no_fsync) as etcd, EtcdClient(etcd.endpoints) as client, \
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64)) as session:
        bench = Bench(client, session, etcd.client_url)
        bench.lease = await client.grant_lease(600)
        bench.cas_revision = (await client.put("/bench/cas", b"x")).revision
        await client.put("/bench/k", b"v")
        ops = ["health_get", "raw_range", "get", "put", "create", "replace", "keep_alive"]
        samples: dict[str, list[float]] = {op: [] for op in ops}
        cpu = dict.fromkeys(ops, 0.0)
        for call in [getattr(bench, op) for op in ops]:
            for _ in range(20):  # warm-up: connections open, code paths hot
                await call()
        per_round = max(args.ops // args.rounds, 1)
        for _ in range(args.rounds):
            for op in ops:
                call = getattr(bench, op)
                cpu_before = _cpu()
                for _ in range(per_round):
                    began = time.perf_counter()
                    await call()
                    samples[op].append(time.perf_counter() - began)
                cpu[op] += _cpu() - cpu_before
        delivery, delivery_cpu = await watch_delivery(client, args.ops)
        samples["watch_delivery"], cpu["watch_delivery"] = delivery, delivery_cpu
        rows = summarize(samples, cpu)
        concurrent = {"put_per_s": round(await throughput(bench.put, args.ops, args.concurrency)),
                      "health_get_per_s": round(await throughput(bench.health_get, args.ops, args.concurrency))}
        concurrent["put_vs_health"] = round(concurrent["put_per_s"] / concurrent["health_get_per_s"], 2)
        status = await client.status()
        return {"etcd": status.get("version"), "fsync": not args.no_fsync, "ops": rows,
                "concurrency": args.concurrency, **concurrent}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.etcd_client", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", type=int, default=300, help="calls per operation (default 300)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--concurrency", type=int, default=16, help="callers in the calls/s part (default 16)")
    parser.add_argument("--no-fsync", action="store_true", help="run etcd with --unsafe-no-fsync (as the tests do)")
    args = parser.parse_args(argv)
    result = asyncio.run(run(args))
    for row in result["ops"]:
        print(orjson.dumps(row).decode())
    print(f"etcd {result['etcd']} fsync={result['fsync']}")
    print(f"{'op':<16}{'p50 ms':>9}{'p99 ms':>9}{'cpu µs':>9}{'p50/health':>12}")
    for row in result["ops"]:
        print(f"{row['op']:<16}{row['p50_ms']:>9.3f}{row['p99_ms']:>9.3f}{row['cpu_us_per_call']:>9.1f}"
              f"{row['p50_vs_health']:>12.2f}")
    print(f"{result['concurrency']} callers: put {result['put_per_s']}/s, /health {result['health_get_per_s']}/s, "
          f"ratio {result['put_vs_health']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
