"""Engine calls relayed as they are: one server (`/v1/rl/workers/{id}/engine/{path}`), or every selected
server for the paths that are not fleet operations (`/v1/rl/engine/{path}`), in SMG's result shapes.

Only SGLang's control and info routes are relayed (`RELAYED_PATHS`): generation goes through the router's
own routes (a P/D request needs a pair), role switches through the conversion flow, and a path SGLang does
not serve is a 404 here rather than one per server. Calls skip routing, retries, breakers and load counts,
as SMG's do; the caller's Authorization is never forwarded (the router's worker key is, when it has one).
"""

from __future__ import annotations

import asyncio
import re
import time
from urllib.parse import urlencode

from aiohttp import web

from router.control.upstream import NoAnswer, Reply, Upstream
from router.core.errors import RouterError
from router.core.redact import redact, redact_text
from router.core.registry import Worker
from router.core.request_shape import GENERATE_ROUTES
from router.flows.weight_updates import UPDATE_KINDS

MAX_BODY_CHARS = 1 << 20  # SMG's 1 MiB cut of an engine's answer
SEGMENT = re.compile(r"[A-Za-z0-9._-]+")
FORWARDED_HEADERS = ("X-Request-Id", "traceparent", "tracestate")
# SGLang 0.5.23's control and info routes (and 0.5.6's names) that a trainer may call on a server.
RELAYED_PATHS = frozenset({
    "health", "health_generate", "model_info", "get_model_info", "server_info", "get_server_info",
    "v1/loads", "get_load", "get_weight_version", "weight_version", "v1/models", "metrics",
    "flush_cache", "abort_request", "pause_generation", "continue_generation",
    "update_weights_from_disk", "update_weights_from_tensor", "update_weights_from_distributed",
    "update_weight_version", "init_weights_update_group", "destroy_weights_update_group",
    "begin_weight_update", "end_weight_update", "get_weights_by_name",
    "release_memory_occupation", "resume_memory_occupation",
    "start_profile", "stop_profile", "slow_down", "get_internal_state", "set_internal_state",
    "configure_logging", "start_expert_distribution_record", "stop_expert_distribution_record",
    "dump_expert_distribution_record",
})
ROLE_SWITCHES = frozenset({"pd_role_switch", "convert_pd_role"})
GENERATION_PATHS = frozenset(route.strip("/") for route in GENERATE_ROUTES)
# What changes which weights a server serves, or whether it serves: the router runs these for the whole
# fleet (hold, quiesce, verify, release), never on one server behind the fleet's back.
FLEET_ONLY_PATHS = frozenset({*UPDATE_KINDS, "pause_generation", "continue_generation",
                              "release_memory_occupation", "resume_memory_occupation"})


def rl_error(status: int, code: str, message: str, **details) -> RouterError:
    """An error of the RL routes: the router's error object, with SMG's error code as its `type`."""
    error = RouterError(message, status=status, **details)
    error.type = code
    return error


def engine_path(raw: str) -> str:
    """The engine path of a route (SMG's rules: 1 to 4 segments of `A-Z a-z 0-9 . _ -`, no `.` or `..`),
    limited to the routes the router relays."""
    path = raw.lstrip("/")
    segments = path.split("/")
    if not 1 <= len(segments) <= 4 or any(not SEGMENT.fullmatch(s) or s in (".", "..") for s in segments):
        raise rl_error(400, "invalid_engine_path", f"invalid engine path {raw!r}: 1 to 4 segments of letters, "
                                                   "digits, '.', '_' and '-'", path=raw)
    if path in RELAYED_PATHS:
        return path
    if path in ROLE_SWITCHES:
        hint = "role switches go through the router's conversion flow: POST /admin/workers/{id}/convert"
    elif path in GENERATION_PATHS:
        hint = "generation goes through the router's own routes (a P/D request needs a prefill-decode pair)"
    else:
        hint = "pd-router relays SGLang's control and info routes: " + ", ".join(sorted(RELAYED_PATHS))
    raise rl_error(404, "unknown_engine_path", f"engine path {path!r} is not relayed: {hint}", path=path)


def forwarded_headers(request: web.Request) -> dict[str, str]:
    return {name: request.headers[name] for name in FORWARDED_HEADERS if name in request.headers}


def query_without_selector(request: web.Request) -> str:
    pairs = [(k, v) for k, v in request.query.items() if k != "selector"]
    return "?" + urlencode(pairs) if pairs else ""


def body_of(reply: Reply) -> tuple[object, bool]:
    """The engine's answer fit to relay (parsed JSON, else text; secrets redacted) and whether it was cut."""
    if reply.data is not None:
        if len(reply.text) <= MAX_BODY_CHARS:
            return redact(reply.data), False
        return redact_text(reply.text[:MAX_BODY_CHARS]), True
    if not reply.text:
        return None, False
    return redact_text(reply.text[:MAX_BODY_CHARS]), len(reply.text) > MAX_BODY_CHARS


def failure_code(reply: Reply) -> str:
    """SMG's code for a call that got no answer."""
    return "upstream_timeout" if reply.no_answer is NoAnswer.TIMEOUT else "upstream_unreachable"


class Relay:
    """One engine call to a server, as SMG's call envelope `{worker_id, url, status, latency_ms, body}`."""

    def __init__(self, upstream: Upstream, timeout: float, concurrency: int) -> None:
        self.upstream = upstream
        self.timeout = timeout
        self.concurrency = concurrency

    async def call(self, worker: Worker, method: str, path_and_query: str, body: dict | None,
                   headers: dict[str, str]) -> tuple[Reply, dict]:
        started = time.monotonic()
        reply = await self.upstream.call(method, worker.url, "/" + path_and_query, body, timeout=self.timeout,
                                         headers=headers)
        envelope = {"worker_id": worker.id, "url": worker.url, "status": reply.status,
                    "latency_ms": round((time.monotonic() - started) * 1000)}
        envelope["body"], truncated = body_of(reply)
        if truncated:
            envelope["body_truncated"] = True
        return reply, envelope

    async def one(self, worker: Worker, method: str, path_and_query: str, body: dict | None,
                  headers: dict[str, str]) -> tuple[int, dict]:
        """The per-worker route: the engine's status and envelope, or SMG's 502/504 when it did not answer."""
        reply, envelope = await self.call(worker, method, path_and_query, body, headers)
        if reply.status == 0:
            code = failure_code(reply)
            raise rl_error(504 if code == "upstream_timeout" else 502, code,
                           f"{worker.url} did not answer {method} /{path_and_query}: {redact_text(reply.text)}",
                           worker_id=worker.id, url=worker.url)
        return reply.status, envelope

    async def many(self, workers: list[Worker], method: str, path_and_query: str, body: dict | None,
                   headers: dict[str, str]) -> tuple[int, dict]:
        """SMG's fan-out: every target called (at most `concurrency` at once), one answer: 200 when all
        returned 2xx, else 207 with the others in `failed`."""
        gate = asyncio.Semaphore(self.concurrency)

        async def bounded(worker: Worker) -> tuple[Reply, dict]:
            async with gate:
                return await self.call(worker, method, path_and_query, body, headers)

        outcomes = await asyncio.gather(*(bounded(w) for w in workers))
        results, failed = {}, []
        for worker, (reply, envelope) in zip(workers, outcomes):
            if reply.status == 0:
                failed.append({"worker_id": worker.id, "url": worker.url, "error": failure_code(reply),
                               "message": redact_text(reply.text)})
                continue
            results[worker.id] = envelope
            if not reply.ok:
                failed.append({"worker_id": worker.id, "url": worker.url, "status": reply.status,
                               "error": "upstream_error", "message": f"HTTP {reply.status}"})
        return fanout_answer(results, failed, len(workers))


def fanout_answer(results: dict, failed: list[dict], total: int, **extra) -> tuple[int, dict]:
    failed.sort(key=lambda f: f["worker_id"])
    answer = {"results": results, "failed": failed, "total": total, "succeeded": total - len(failed), **extra}
    return (207 if failed else 200), answer


RELAY = web.AppKey("rl_relay", Relay)
