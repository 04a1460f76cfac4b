"""Prefix-cache hits of cache_aware against random (and round_robin) on a shared-prefix workload.

    python -m bench.cache_aware_hits                      # 4P+1D, 16 shared system prompts, 400 requests per policy
    python -m bench.cache_aware_hits --requests 100       # quicker

Every request is one of `--prefixes` long system prompts (chosen uniformly, seeded) followed by a short
distinct question, sent by `--concurrency` closed-loop clients through pd-router. Each simulated prefill server
has a prefix cache (`--prefix-cache-tokens`, LRU) that holds only some of the system prompts, as a real
server's radix cache holds what fits in its KV memory: a policy that keeps each prompt on one server lets the
caches hold them all between them, one that spreads every prompt everywhere makes them evict each other. The
servers count the prompt tokens they prefilled and how many of those came from their cache; the hit rate is
cached / prefilled over all prefill servers. Each policy gets a fresh fleet (cold caches). Printed: hit rate,
TTFT and requests/s per policy, and the ratio of cache_aware's hit rate to random's. JSON under out/bench/.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import random
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp
import orjson

from bench import procs
from bench.contenders import REPO_ROOT
from bench.simfleet import SimFleet

BASELINE = "random"
POLICIES = ("cache_aware", "random", "round_robin")


def sim_args(cache_tokens: int) -> list[str]:
    # one prefill forward at a time, 0.1 ms per uncached prompt token: hits show in TTFT too
    return ["--prefill-concurrency", "1", "--prefill-overhead-s", "0.002", "--prefill-per-token-s", "0.0001",
            "--decode-step-s", "0.005", "--prefix-cache-tokens", str(cache_tokens), "--health-check-s", "0"]


def system_prompts(count: int, words: int) -> list[str]:
    return [f"System prompt {k}. " + " ".join(f"rule{k}-{i}" for i in range(words)) for k in range(count)]


def requests(prompts: list[str], n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [f"{rng.choice(prompts)}\nQuestion {i}: what about item {rng.randrange(10**6)}?" for i in range(n)]


async def drive(url: str, texts: list[str], concurrency: int) -> dict:
    queue = list(reversed(texts))
    ttfts: list[float] = []
    errors = 0

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal errors
        while queue:
            text = queue.pop()
            body = {"text": text, "stream": True, "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}}
            sent = time.monotonic()
            try:
                async with session.post(url + "/generate", data=orjson.dumps(body),
                                        headers={"Content-Type": "application/json"},
                                        timeout=aiohttp.ClientTimeout(total=120)) as resp:
                    first = None
                    async for chunk in resp.content.iter_any():
                        if first is None and b"data: " in chunk:
                            first = time.monotonic()
                    if resp.status != 200 or first is None:
                        errors += 1
                    else:
                        ttfts.append(first - sent)
            except (aiohttp.ClientError, asyncio.TimeoutError):
                errors += 1

    started = time.monotonic()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
    elapsed = time.monotonic() - started
    ttfts.sort()
    return {"requests": len(texts), "errors": errors, "rps": round(len(texts) / elapsed, 2),
            "ttft_p50_ms": _ms(ttfts, 50), "ttft_p90_ms": _ms(ttfts, 90)}


def _ms(values: list[float], q: int) -> float | None:
    if not values:
        return None
    return round(1000 * values[min(len(values) - 1, max(0, -(-len(values) * q // 100) - 1))], 2)


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


def prefill_counters(prefill_urls: list[str]) -> tuple[int, int, list[float]]:
    """(cached tokens, prefilled tokens, per-server hit rate) summed over the prefill servers."""
    cached = prefilled = 0
    per_server = []
    for url in prefill_urls:
        counters = _get_json(url + "/_sim/state")["counters"]
        cached += counters["cached_tokens"]
        prefilled += counters["prefill_tokens"]
        per_server.append(round(counters["cached_tokens"] / counters["prefill_tokens"], 4)
                          if counters["prefill_tokens"] else 0.0)
    return cached, prefilled, per_server


def run_policy(policy: str, texts: list[str], args, workdir: Path) -> dict:
    with SimFleet(workdir / policy, prefills=args.prefills, decodes=1,
                  extra_args=sim_args(args.prefix_cache_tokens)) as fleet:
        port = procs.free_port()
        argv = [sys.executable, "-m", "router", *fleet.mini_lb_args(), "--host", "127.0.0.1", "--port", str(port),
                "--prefill-policy", policy, "--decode-policy", "random", "--rebalance", "off",
                "--log-level", "warning"]
        router = procs.start(f"router-{policy}", argv, workdir / policy, cwd=str(REPO_ROOT))
        url = f"http://127.0.0.1:{port}"
        try:
            procs.wait_until(lambda: procs.http_status(url + "/health") == 200, timeout=60,
                             what="the router serving", child=router)
            load = asyncio.run(drive(url, texts, args.concurrency))
            cached, prefilled, per_server = prefill_counters([u for u, _ in fleet.prefill])
            policy_state = _get_json(url + "/admin/policies")["pools"]["prefill"]["policy"]
        finally:
            procs.stop(router)
    return {"policy": policy, **load, "cached_tokens": cached, "prefilled_tokens": prefilled,
            "hit_rate": round(cached / prefilled, 4) if prefilled else None, "per_server_hit_rate": per_server,
            "router_view": {k: policy_state[k] for k in ("decisions", "estimated_hit_ratio") if k in policy_state}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cache_aware_hits", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefills", type=int, default=4)
    parser.add_argument("--prefixes", type=int, default=16, help="distinct system prompts")
    parser.add_argument("--prefix-words", type=int, default=300, help="tokens of each system prompt")
    parser.add_argument("--prefix-cache-tokens", type=int, default=1600,
                        help="each prefill server's cache (default: 5 of the 16 prompts)")
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "out" / "bench")
    args = parser.parse_args(argv)
    texts = requests(system_prompts(args.prefixes, args.prefix_words), args.requests, args.seed)
    rows = []
    with tempfile.TemporaryDirectory(prefix="cache-bench-") as tmp:
        for policy in args.policies.split(","):
            rows.append(run_policy(policy, texts, args, Path(tmp)))
    by_policy = {r["policy"]: r for r in rows}
    ratio = None
    if "cache_aware" in by_policy and BASELINE in by_policy and by_policy[BASELINE]["hit_rate"]:
        ratio = round(by_policy["cache_aware"]["hit_rate"] / by_policy[BASELINE]["hit_rate"], 3)
    result = {"bench": "cache_aware_hits", "at": dt.datetime.now().isoformat(timespec="seconds"),
              "setup": {k: getattr(args, k) for k in ("prefills", "prefixes", "prefix_words", "prefix_cache_tokens",
                                                      "requests", "concurrency", "seed")},
              "rows": rows, "hit_rate_ratio_vs_random": ratio}
    print(render(result))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"cache_aware_hits-{dt.datetime.now():%Y%m%d-%H%M%S}.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"\nresult: {path}")
    return 0


def render(result: dict) -> str:
    s = result["setup"]
    lines = [f"{s['prefills']} prefill servers, {s['prefixes']} system prompts of {s['prefix_words']} tokens, "
             f"{s['prefix_cache_tokens']} cached tokens per server, {s['requests']} requests, "
             f"{s['concurrency']} clients",
             f"{'policy':<14}{'hit rate':>10}{'TTFT p50 ms':>13}{'TTFT p90 ms':>13}{'req/s':>8}{'errors':>8}"]
    for r in result["rows"]:
        hit = f"{r['hit_rate'] * 100:.1f}%" if r["hit_rate"] is not None else "-"
        lines.append(f"{r['policy']:<14}{hit:>10}{r['ttft_p50_ms'] or '-':>13}{r['ttft_p90_ms'] or '-':>13}"
                     f"{r['rps']:>8}{r['errors']:>8}")
    lines.append(f"cache_aware hit rate / random's: {result['hit_rate_ratio_vs_random']}x")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
