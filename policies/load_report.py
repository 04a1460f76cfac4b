"""A server's own load report (SGLang 0.5.23's `GET /v1/loads`), read into the terms the router decides on.

0.5.23 answers one row per data-parallel rank (docs/SGLANG_LOADS.md has the whole mapping, from
`srt/managers/scheduler_components/load_inquirer.py`). What each figure counts depends on the server's role:

- prefill: `num_running_reqs` is always 0 (a prefill keeps no running batch); `num_waiting_reqs` = the waiting
  queue (bootstrapped, waiting for a forward: prefill compute) + the bootstrap queue (waiting for the decode
  side to take the room: decode KV room); the inflight queue (KV being sent) is in neither.
- decode: `num_running_reqs` = the running batch; `num_waiting_reqs` = the waiting queue (KV arrived, no place
  in the batch) + prealloc queue (handshake, or waiting for decode KV room; `queues.prealloc_ready` are those
  whose handshake is done) + transfer queue (KV room taken, waiting for the prefill's KV: prefill compute) +
  retracted queue.
- `num_waiting_uncached_tokens`: the prefill work queued (0 on decode); `gen_throughput`: tokens/s generated
  (least_load's drain time, lightseekorg/smg policies/least_load.rs).
- `num_used_tokens` / `token_usage`: KV in use, a decode's transfers included (their room is reserved);
  `num_active_tokens` leaves out the tokens whose KV has not arrived yet.
- cumulative: `total_prefill_busy_us` (prefill forward time) and `total_prefill_uncached_tokens`; on decode
  `decode_moments` = [steps, sum of batch sizes, sum of step times (us), sum of squares, sum of batch x time,
  tokens] (None before the first step).

- `age_s`: how old the row was when the server answered (the answer's `timestamp` less the row's own, both the
  server's clock). A row is published, not computed per request: after every prefill forward, every
  `--load-snapshot-publish-interval` (15) decode steps, and every 50 ms while the scheduler has queued work
  but no batch to run. During a long prefill forward the row is the one published before it; while a decode
  runs batches it lags by up to 15 steps (seconds on a slow machine).

`parse_loads` sums the ranks; a field a server does not report stays None, so that the rebalancer can tell
"zero" from "unknown" (a server without the `disaggregation` section gives no PD breakdown).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any


@dataclass(frozen=True, slots=True)
class RankLoad:
    """One data-parallel rank's row: its own scheduler's queues (`--dp-aware` chooses ranks by them)."""

    dp_rank: int
    running: int
    waiting: int
    token_usage: float | None = None

    @property
    def requests(self) -> int:
        return self.running + self.waiting


@dataclass(frozen=True, slots=True)
class LoadReport:
    running: int
    waiting: int  # num_waiting_reqs: what it counts depends on the role (see the module docstring)
    used_tokens: int | None = None
    capacity_tokens: int | None = None  # max_total_num_tokens, summed over ranks
    running_window: int | None = None  # max_running_requests, summed over ranks: the most it runs at once
    token_usage: float | None = None  # the highest of the ranks
    active_tokens: int | None = None
    waiting_uncached_tokens: int | None = None  # prompt tokens of the prefill waiting queue not in the prefix cache
    gen_throughput: float | None = None  # tokens/s generated, summed over the ranks (0 on a prefill)
    mode: str | None = None  # disaggregation.mode: the live role ("prefill", "decode", "null")
    # The PD queues (None: not reported).
    waiting_queue: int | None = None  # queues.waiting
    bootstrap: int | None = None
    inflight: int | None = None
    prealloc: int | None = None
    prealloc_ready: int | None = None
    transfer: int | None = None
    retracted: int | None = None
    # Cumulative counters (None: not reported).
    prefill_busy_us: int | None = None
    prefill_tokens: int | None = None
    decode_moments: tuple[float, ...] | None = None
    age_s: float | None = None  # how old the (oldest rank's) row was when the server answered
    ranks: tuple[RankLoad, ...] = ()  # every row, in dp_rank order

    @property
    def pd_queued(self) -> int:
        """Requests in the PD queues that are in neither running nor the waiting queue proper: a server with
        any of them is not idle (a role switch refuses)."""
        return sum(v or 0 for v in (self.bootstrap, self.inflight, self.prealloc, self.transfer, self.retracted))

    @property
    def own_kv_usage(self) -> float | None:
        """KV in use by requests whose KV is on this server (a decode's transfers reserve room for KV that a
        prefill has not computed yet: that share is the prefill's doing)."""
        if self.active_tokens is not None and self.capacity_tokens:
            return min(1.0, self.active_tokens / self.capacity_tokens)
        return self.token_usage


def _int(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return int(value)


def _sum(rows: list[dict], key: str, section: str | None = None) -> int | None:
    """`key` summed over the ranks that report it (in `section` when given); None when none does."""
    known = []
    for row in rows:
        source = row.get(section) if section else row
        if isinstance(source, dict) and (value := _int(source.get(key))) is not None:
            known.append(value)
    return sum(known) if known else None


def _row_age(data: Any, ranks: list[dict]) -> float | None:
    """The answer's `timestamp` (ISO-8601) less the oldest row's (epoch seconds): the same server's clock, so no
    skew between machines enters. None when either is missing or unreadable."""
    answered = data.get("timestamp") if isinstance(data, dict) else None
    published = [r.get("timestamp") for r in ranks]
    if not isinstance(answered, str) or not published or not all(
            isinstance(t, (int, float)) and not isinstance(t, bool) and t > 0 for t in published):
        return None
    try:
        answered_at = datetime.fromisoformat(answered).timestamp()
    except ValueError:
        return None
    return max(0.0, answered_at - min(published))


def _fsum(rows: list[dict], key: str) -> float | None:
    known = [float(r[key]) for r in rows if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]
    return sum(known) if known else None


def parse_loads(data: Any) -> LoadReport | None:
    """`/v1/loads`'s answer (or a bare list or row), summed over its ranks; None if it holds no rank."""
    ranks = data.get("loads", data) if isinstance(data, dict) else data
    if isinstance(ranks, dict):
        ranks = [ranks]
    if not isinstance(ranks, list) or not ranks or not all(isinstance(r, dict) for r in ranks):
        return None
    if not any("num_running_reqs" in r or "num_waiting_reqs" in r for r in ranks):
        return None
    usage = [float(r["token_usage"]) for r in ranks
             if isinstance(r.get("token_usage"), (int, float)) and not isinstance(r.get("token_usage"), bool)]
    modes = {r["disaggregation"].get("mode") for r in ranks if isinstance(r.get("disaggregation"), dict)}
    moments = None
    rows = [r.get("decode_moments") for r in ranks]
    if any(isinstance(m, list) and len(m) == 6 for m in rows):
        moments = tuple(sum(float(m[i]) for m in rows if isinstance(m, list) and len(m) == 6) for i in range(6))
    return LoadReport(
        running=_sum(ranks, "num_running_reqs") or 0,
        waiting=_sum(ranks, "num_waiting_reqs") or 0,
        used_tokens=_sum(ranks, "num_used_tokens"),
        capacity_tokens=_sum(ranks, "max_total_num_tokens"),
        running_window=_sum(ranks, "max_running_requests"),
        token_usage=max(usage) if usage else None,
        active_tokens=_sum(ranks, "num_active_tokens"),
        waiting_uncached_tokens=_sum(ranks, "num_waiting_uncached_tokens"),
        gen_throughput=_fsum(ranks, "gen_throughput"),
        mode=modes.pop() if len(modes) == 1 else None,
        waiting_queue=_sum(ranks, "waiting", "queues"),
        bootstrap=_sum(ranks, "prefill_bootstrap_queue_reqs", "disaggregation"),
        inflight=_sum(ranks, "prefill_inflight_queue_reqs", "disaggregation"),
        prealloc=_sum(ranks, "decode_prealloc_queue_reqs", "disaggregation"),
        prealloc_ready=_sum(ranks, "prealloc_ready", "queues"),
        transfer=_sum(ranks, "decode_transfer_queue_reqs", "disaggregation"),
        retracted=_sum(ranks, "decode_retracted_queue_reqs", "disaggregation"),
        prefill_busy_us=_sum(ranks, "total_prefill_busy_us"),
        prefill_tokens=_sum(ranks, "total_prefill_uncached_tokens"),
        decode_moments=moments,
        age_s=_row_age(data, ranks),
        ranks=_rank_rows(ranks),
    )


def _rank_rows(rows: list[dict]) -> tuple[RankLoad, ...]:
    out = []
    for index, row in enumerate(rows):
        rank = _int(row.get("dp_rank"))
        usage = row.get("token_usage")
        if isinstance(usage, bool) or not isinstance(usage, (int, float)):
            usage = None
        out.append(RankLoad(dp_rank=index if rank is None else rank, running=_int(row.get("num_running_reqs")) or 0,
                            waiting=_int(row.get("num_waiting_reqs")) or 0,
                            token_usage=None if usage is None else float(usage)))
    return tuple(sorted(out, key=lambda r: r.dp_rank))
