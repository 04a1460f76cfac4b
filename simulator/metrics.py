"""``GET /metrics`` (only with ``--enable-metrics``, as on SGLang): a few of SGLang's gauges and counters."""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

from .loads import summary

if TYPE_CHECKING:
    from .server import Server

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def add_routes(router: web.UrlDispatcher, worker: "Server") -> None:
    if worker.config.enable_metrics:
        async def metrics(request: web.Request) -> web.Response:
            return web.Response(body=render(worker).encode(), headers={"Content-Type": CONTENT_TYPE})

        router.add_get("/metrics", metrics)


def render(worker: "Server") -> str:
    engine = worker.engine
    load = summary(engine)  # what the load report counts over every DP rank
    counters = engine.counters
    labels = f'model_name="{worker.config.model_name}",engine_type="unified"'
    used = load["used_tokens"]
    gauges = {
        "sglang:num_running_reqs": load["running"],
        "sglang:num_queue_reqs": load["waiting"],
        "sglang:num_used_tokens": used,
        "sglang:token_usage": round(used / worker.config.max_total_tokens, 6),
        "sglang:gen_throughput": engine.last_gen_throughput,
        "sglang:num_prefill_bootstrap_queue_reqs": load["prefill_bootstrap_queue_reqs"],
        "sglang:num_prefill_inflight_queue_reqs": load["prefill_inflight_queue_reqs"],
        "sglang:num_decode_prealloc_queue_reqs": load["decode_prealloc_queue_reqs"],
        "sglang:num_decode_transfer_queue_reqs": load["decode_transfer_queue_reqs"],
    }
    totals = {
        "sglang:prompt_tokens_total": counters.prompt_tokens,
        "sglang:generation_tokens_total": counters.generation_tokens,
        "sglang:num_requests_total": counters.items_finished + counters.items_aborted,
        "sglang:num_aborted_requests_total": counters.items_aborted,
    }
    lines = []
    for name, value in gauges.items():
        lines += [f"# TYPE {name} gauge", f"{name}{{{labels}}} {float(value)}"]
    for name, value in totals.items():
        lines += [f"# TYPE {name} counter", f"{name}{{{labels}}} {float(value)}"]
    return "\n".join(lines) + "\n"
