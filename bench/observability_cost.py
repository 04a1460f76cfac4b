"""What health, metrics, access control and logging add to one generation request, in microseconds.

    python -m bench.observability_cost [--iterations 100000]

Each per-request hook is timed in a tight loop, next to a baseline measured in the same run: an empty
function call with the same arguments (for the plain hooks) and an empty middleware chain step (for the
middlewares). Prints one JSON object: microseconds per call for each hook, the ratio to its baseline, and
the total added to one request (two legs: two leg verdicts).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from router.obs import logs

from router.obs import metrics
from router.api import metrics_view
from router.api.access import make_access_middleware
from router.dataplane.admission import Admission
from router.core.config import AdmissionConfig, BreakerConfig, HealthConfig, RouterConfig
from router.control.health import HealthMonitor
from router.core.records import RequestRecord
from router.core.registry import Registry, Role


def per_call_us(fn, iterations: int) -> float:
    started = time.perf_counter_ns()
    for _ in range(iterations):
        fn()
    return (time.perf_counter_ns() - started) / iterations / 1000


async def per_await_us(make_coro, iterations: int) -> float:
    started = time.perf_counter_ns()
    for _ in range(iterations):
        await make_coro()
    return (time.perf_counter_ns() - started) / iterations / 1000


async def measure(iterations: int) -> dict:
    registry = Registry()
    prefill = registry.add("http://127.0.0.1:1", Role.PREFILL, 8998)
    decode = registry.add("http://127.0.0.1:2", Role.DECODE, None)
    admission = Admission(AdmissionConfig())
    router_metrics = metrics.RouterMetrics(registry, admission)
    monitor = HealthMonitor(registry, upstream=None, health=HealthConfig(enabled=False), breaker=BreakerConfig())
    monitor.start()
    record = RequestRecord(route="/generate", stream=True, status=200, started=0.0, e2e_s=0.25, ttft_s=0.05,
                           itl_s=0.01, attempts=1, prefill=prefill, decode=decode)

    def noop(*args) -> None:
        return None

    hooks = {
        "metrics.count_request": lambda: router_metrics.count_request("/generate", 200),
        "metrics.observe_request": lambda: router_metrics.observe_request(record),
        "logs.log_request (success, DEBUG off)": lambda: logs.log_request(record),
        "health.on_leg (served, breaker closed)": lambda: monitor.on_leg(decode, True),
    }
    baseline = per_call_us(lambda: noop(record), iterations)
    out: dict = {"iterations": iterations, "baseline_call_us": round(baseline, 4), "hooks": {}}
    for name, fn in hooks.items():
        us = per_call_us(fn, iterations)
        out["hooks"][name] = {"us": round(us, 4), "x_baseline_call": round(us / baseline, 2)}

    # Middlewares: each wraps a handler that returns a ready response; the baseline is a pass-through step.
    app = web.Application()
    response = web.Response(status=200)

    async def handler(request):
        return response

    app.router.add_post("/generate", handler)
    app.router.add_get("/workers", handler)
    app[metrics.METRICS] = router_metrics
    open_access = make_access_middleware(RouterConfig())
    keyed_access = make_access_middleware(RouterConfig(api_key="k" * 32))

    async def make_request(path: str, headers: dict | None = None):
        request = make_mocked_request("POST" if path == "/generate" else "GET", path, headers=headers, app=app)
        match = await app.router.resolve(request)
        request._match_info = match
        match.add_app(app)
        return request

    gen = await make_request("/generate")
    gen_keyed = await make_request("/generate", {"Authorization": "Bearer " + "k" * 32})

    @web.middleware
    async def passthrough(request, handler):
        return await handler(request)

    base_mw = await per_await_us(lambda: passthrough(gen, handler), iterations)
    out["baseline_middleware_us"] = round(base_mw, 4)
    middlewares = {
        "request_id_middleware": lambda: logs.request_id_middleware(gen, handler),
        "metrics_middleware": lambda: metrics_view.metrics_middleware(gen, handler),
        "access_middleware (no keys)": lambda: open_access(gen, handler),
        "access_middleware (--api-key, generation route)": lambda: keyed_access(gen_keyed, handler),
    }
    out["middlewares"] = {}
    for name, make in middlewares.items():
        us = await per_await_us(make, iterations)
        out["middlewares"][name] = {"us": round(us, 4), "x_passthrough": round(us / base_mw, 2)}

    h = out["hooks"]
    m = out["middlewares"]
    total = (m["request_id_middleware"]["us"] + m["metrics_middleware"]["us"] + m["access_middleware (no keys)"]["us"]
             + h["metrics.observe_request"]["us"] + h["logs.log_request (success, DEBUG off)"]["us"]
             + 2 * h["health.on_leg (served, breaker closed)"]["us"])
    out["added_per_request_us"] = round(total, 2)
    await monitor.close()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.observability_cost", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=100_000)
    args = parser.parse_args(argv)
    print(json.dumps(asyncio.run(measure(args.iterations)), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
