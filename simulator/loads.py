"""The load report: ``GET /v1/loads`` as SGLang 0.5.23 renders it, and ``/get_load`` of 0.4.9 and 0.5.6.

One row per data-parallel rank, each the rank's scheduler's ``SchedulerLoadInquirer.get_loads``
(``srt/managers/scheduler_components/load_inquirer.py``; docs/SGLANG_LOADS.md has the whole mapping):

- ``num_running_reqs``: the running batch. A prefill server never has one (its forward's requests are in no
  queue), so a prefill reports 0 running; here a request in its forward is still counted as waiting, as the
  report a real forward leaves behind (published before it) shows it.
- ``num_waiting_reqs``: prefill: waiting queue + bootstrap queue (waiting for the decode side to take the
  room); decode: waiting queue (KV arrived, no place in the batch) + prealloc queue (handshake, or waiting for
  KV room) + transfer queue (KV room taken, waiting for the prefill's KV) + retracted queue.
- the ``disaggregation`` section names each PD queue; ``queues.waiting`` is the waiting queue alone and
  ``queues.prealloc_ready`` the prealloc requests whose handshake is done (waiting for the decode's KV room).
- ``num_used_tokens`` / ``token_usage``: KV in use (a decode's transfers hold theirs already);
  ``num_total_tokens`` adds the prompts still queued without KV; ``num_active_tokens`` leaves out the tokens
  whose KV has not arrived from the prefill yet.
- ``total_prefill_busy_us``, ``total_prefill_uncached_tokens`` and ``decode_moments`` are the scheduler's
  cumulative counters (capacity.py).

Query: ``include`` (comma-separated sections: core, memory, spec, lora, disagg, queues, all; an unknown one is
an error 0.5.23 raises outside its handler: 500 "Internal Server Error"), ``dp_rank`` (one rank; none beyond
the last; not an integer: 400) and ``format=prometheus``.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from aiohttp import web

from .httputil import json_response
from .requests import BOOTSTRAP, DECODE, FORWARD, HANDSHAKE, QUEUED, RETRACTED, TRANSFER, WAITING

if TYPE_CHECKING:
    from .engine import Engine
    from .server import Server

SECTIONS = ("core", "memory", "spec", "lora", "disagg", "queues", "all")
PROMETHEUS_TYPE = "text/plain; version=0.0.4; charset=utf-8"
MEMORY = {"weight_gb": 0.001, "kv_cache_gb": 0.001, "graph_gb": 0.0}  # what the tiny real model reports


@dataclass
class RankCounts:
    """One rank's requests, per queue of 0.5.23's scheduler."""

    running: int = 0
    waiting_queue: int = 0  # prefill: waiting for a forward; decode: KV arrived, waiting for the batch
    bootstrap: int = 0
    inflight: int = 0
    prealloc: int = 0
    prealloc_ready: int = 0
    transfer: int = 0
    retracted: int = 0
    used_tokens: int = 0
    pending_tokens: int = 0  # prompts of queued requests that hold no KV yet
    awaiting_kv_tokens: int = 0  # decode: prompts whose KV has not arrived
    waiting_uncached_tokens: int = 0
    prealloc_ready_tokens: int = 0

    @property
    def waiting(self) -> int:
        return self.waiting_queue + self.bootstrap + self.prealloc + self.transfer + self.retracted


def count(engine: "Engine") -> list[RankCounts]:
    ranks = [RankCounts() for _ in range(engine.config.dp_size)]
    role = engine.role
    for req in engine.requests.values():
        if not req.dispatched:
            continue
        c = ranks[req.dp_rank]
        phase = req.phase
        seqlen = len(req.input_ids) + len(req.gen.output_ids)
        if role == "decode":
            if phase == DECODE:
                c.running += 1
                c.used_tokens += seqlen
            elif phase == QUEUED:
                c.waiting_queue += 1
                c.used_tokens += seqlen
            elif phase == TRANSFER or (phase == HANDSHAKE and req.kv_tokens):
                c.transfer += 1
                c.used_tokens += seqlen
                c.awaiting_kv_tokens += seqlen
            elif phase in (HANDSHAKE, WAITING):  # before its KV room: the prealloc queue
                c.prealloc += 1
                c.pending_tokens += seqlen
                c.awaiting_kv_tokens += seqlen
                if phase == WAITING:  # handshake done, waiting for KV room
                    c.prealloc_ready += 1
                    c.prealloc_ready_tokens += seqlen
            elif phase == RETRACTED:
                c.retracted += 1
                c.pending_tokens += seqlen
        elif role == "prefill":
            if phase == BOOTSTRAP:
                c.bootstrap += 1
                c.pending_tokens += seqlen
            elif phase == FORWARD and req.forward_done:  # its forward ended: the inflight queue
                c.inflight += 1
                c.used_tokens += seqlen
            elif phase in (WAITING, FORWARD):
                c.waiting_queue += 1
                if phase == FORWARD:
                    c.used_tokens += seqlen
                else:
                    c.pending_tokens += seqlen
                    c.waiting_uncached_tokens += len(req.input_ids) - req.cached_tokens
            elif phase == TRANSFER:
                c.inflight += 1
                c.used_tokens += seqlen
        else:
            if phase in (DECODE, FORWARD):
                c.running += 1
                c.used_tokens += seqlen
            elif phase in (WAITING, RETRACTED):
                c.waiting_queue += 1
                c.pending_tokens += seqlen
                c.waiting_uncached_tokens += len(req.input_ids) - req.cached_tokens
    return ranks


def summary(engine: "Engine") -> dict[str, int]:
    """Every rank together: what /metrics and /get_load show."""
    ranks = count(engine)
    total = RankCounts()
    for c in ranks:
        for name in total.__dataclass_fields__:
            setattr(total, name, getattr(total, name) + getattr(c, name))
    return {"running": total.running, "waiting": total.waiting, "used_tokens": total.used_tokens,
            "pending_tokens": total.pending_tokens,
            "prefill_bootstrap_queue_reqs": total.bootstrap, "prefill_inflight_queue_reqs": total.inflight,
            "decode_prealloc_queue_reqs": total.prealloc, "decode_transfer_queue_reqs": total.transfer,
            "decode_retracted_queue_reqs": total.retracted}


def rows(worker: "Server") -> list[dict[str, Any]]:
    """Every rank's row as /v1/loads shows it: the one its scheduler last published. 0.5.23 publishes after
    every prefill forward, every `load_snapshot_publish_interval` decode steps, and every 50 ms while the
    scheduler runs no batch (queued work, or idle): here a rank running no batch (no forward in progress on
    a prefill, an empty running batch on a decode) publishes at every read, one running a batch shows what it
    published last (capacity.py publishes after each forward and every N decode steps)."""
    engine = worker.engine
    fresh = None
    out = []
    for rank in range(engine.config.dp_size):
        published = engine.published_rows[rank]
        if published is None or not running_a_batch(engine, rank):
            fresh = fresh or build_rows(engine)
            published = engine.published_rows[rank] = fresh[rank]
        out.append(published)
    return out


def running_a_batch(engine: "Engine", rank: int) -> bool:
    if engine.role == "prefill":
        return engine.forwards[rank].running > 0
    if engine.role == "decode":
        return engine.batches[rank].size > 0
    return False


def publish(engine: "Engine", rank: int) -> None:
    """What the scheduler of `rank` does after a forward (prefill) or every N steps (decode)."""
    engine.published_rows[rank] = build_rows(engine)[rank]


def build_rows(engine: "Engine") -> list[dict[str, Any]]:
    """Every rank's full row (all sections) now, in 0.5.23's key order."""
    cfg = engine.config
    role = engine.role
    capacity = cfg.max_total_tokens
    out = []
    for rank, c in enumerate(count(engine)):
        forwards, batch = engine.forwards[rank], engine.batches[rank]
        total = c.used_tokens + c.pending_tokens
        moments = batch.moments
        out.append({
            "timestamp": time.time(),
            "dp_rank": rank,
            "num_running_reqs": c.running,
            "num_waiting_reqs": c.waiting,
            "num_waiting_uncached_tokens": 0 if role == "decode" else c.waiting_uncached_tokens,
            "num_used_tokens": c.used_tokens,
            "num_total_tokens": total,
            "num_active_tokens": max(0, total - c.awaiting_kv_tokens),
            "num_prealloc_ready_tokens": c.prealloc_ready_tokens,
            "max_total_num_tokens": capacity,
            "max_running_requests": cfg.max_running_requests,
            "token_usage": round(c.used_tokens / capacity, 4),
            "gen_throughput": engine.last_gen_throughput,
            "cache_hit_rate": round(engine.counters.cached_tokens / engine.counters.prefill_tokens, 4)
            if engine.counters.prefill_tokens else 0.0,
            "utilization": 0.0,
            "total_prefill_uncached_tokens": forwards.uncached_tokens,
            "total_prefill_busy_us": forwards.busy_us,
            "decode_moments": [round(m, 1) for m in moments] if moments[0] > 0 else None,
            "memory": {**MEMORY, "token_capacity": capacity},
            "disaggregation": {
                "mode": role,
                "prefill_bootstrap_queue_reqs": c.bootstrap,
                "prefill_inflight_queue_reqs": c.inflight,
                "decode_prealloc_queue_reqs": c.prealloc,
                "decode_transfer_queue_reqs": c.transfer,
                "decode_retracted_queue_reqs": c.retracted,
                "kv_transfer_speed_gb_s": 0.0,
                "kv_transfer_latency_ms": 0.0,
            },
            "queues": {"waiting": c.waiting_queue, "grammar": 0, "paused": 0, "retracted": c.retracted,
                       "prealloc_ready": c.prealloc_ready},
        })
    return out


_SECTION_KEYS = {"memory": "memory", "spec": "speculative", "lora": "lora", "disagg": "disaggregation",
                 "queues": "queues"}


def select(row: dict[str, Any], include: set[str] | None) -> dict[str, Any]:
    """`LoadSnapshot.to_dict(include)`: the core keys always, the sections asked for (all by default)."""
    if include is None or "all" in include:
        return row
    keep = {key for name, key in _SECTION_KEYS.items() if name in include}
    return {k: v for k, v in row.items() if not isinstance(v, dict) or k in keep}


async def handle_v1_loads(request: web.Request, worker: "Server") -> web.Response:
    query = request.query
    include = None
    if query.get("include"):
        include = {part.strip() for part in query["include"].split(",")}
        if not include <= set(SECTIONS):  # 0.5.23 raises this outside its try: a bare 500
            return web.Response(text="Internal Server Error", status=500, content_type="text/plain")
    rank = None
    if "dp_rank" in query:
        try:
            rank = int(query["dp_rank"])
        except ValueError:
            return _bad_rank(query["dp_rank"])
    all_rows = rows(worker)
    if rank is not None:
        all_rows = [r for r in all_rows if r["dp_rank"] == rank]
    selected = [select(r, include) for r in all_rows]
    if query.get("format") == "prometheus":
        return web.Response(body=prometheus(selected).encode(), headers={"Content-Type": PROMETHEUS_TYPE})
    return json_response({
        "timestamp": datetime.now(timezone.utc).isoformat(),
        "version": worker.config.sglang_version,
        "accelerator": None,
        "num_accelerators": 1,
        "loads": selected,
    })


def _bad_rank(value: str) -> web.Response:
    detail = {"type": "int_parsing", "loc": ("query", "dp_rank"),
              "msg": "Input should be a valid integer, unable to parse string as an integer", "input": value}
    message = (f"1 validation error:\n  {detail!r}\n\n  File \"sglang/srt/entrypoints/v1_loads.py\", line 96, in "
               f"get_loads\n    GET /v1/loads [{detail!r}]")
    return json_response({"object": "error", "message": message, "type": "Bad Request", "param": None,
                          "code": 400}, 400)


def prometheus(selected: list[dict[str, Any]]) -> str:
    """0.5.23's `_format_loads_prometheus`: one gauge per numeric field, sections prefixed, per dp_rank."""
    prefixes = {"speculative": "spec", "disaggregation": "disagg"}
    samples: dict[str, list[tuple[int, Any]]] = {}
    for row in selected:
        row = copy.copy(row)
        rank = row.pop("dp_rank")
        for key, value in row.items():
            if isinstance(value, dict):
                prefix = prefixes.get(key, key)
                for sub, sub_value in value.items():
                    if isinstance(sub_value, (int, float)) and not isinstance(sub_value, bool):
                        samples.setdefault(f"sglang_{prefix}_{sub}", []).append((rank, sub_value))
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                samples.setdefault(f"sglang_{key}", []).append((rank, value))
    lines = []
    for name, values in samples.items():
        lines.append(f"# TYPE {name} gauge")
        lines.extend(f'{name}{{dp_rank="{rank}"}} {value}' for rank, value in values)
    return "\n".join(lines) + "\n"


def get_load(worker: "Server") -> Any:
    """``/get_load`` of 0.4.9 (tokens) and 0.5.6 (one row per DP rank); 0.5.23 has none (404)."""
    load = summary(worker.engine)
    if worker.config.sglang_version == "0.4.9":
        return {"load": load["used_tokens"] + load["pending_tokens"]}
    return [{"rid": None, "http_worker_ipc": None, "dp_rank": 0, "num_reqs": load["running"] + load["waiting"],
             "num_waiting_reqs": load["waiting"], "num_tokens": load["used_tokens"] + load["pending_tokens"]}]
