"""Data-parallel ranks on the request path (docs/DP_RANKS.md).

`--dp-aware` (`RankPlacer`): each attempt chooses a prefill rank P and a decode rank D (least loaded by
default: the server's own row for the rank from `/v1/loads` plus what the router routed there since, never
less than the router's own count) and writes the legs SGLang 0.5.23 needs to agree: prefill
`routed_dp_rank: P, disagg_prefill_dp_rank: P` (so its follow_bootstrap_room conflict check passes), decode
`routed_dp_rank: D, disagg_prefill_dp_rank: P` (so it pulls the KV from the rank that computed it). A client's
own `routed_dp_rank` is kept (on both legs), range-checked against both servers.

Without `--dp-aware` the body goes out as the client sent it (ranks follow the bootstrap room), except that a
client's `routed_dp_rank` is range-checked and completed with `disagg_prefill_dp_rank` (`complete_client_ranks`).
"""

from __future__ import annotations

import random
from typing import Callable

import orjson

from router.core.config import DP_RANK_POLICIES as RANK_POLICIES
from router.core.dp_ranks import check_rank, client_ranks
from router.core.registry import Worker



def has_client_ranks(body: dict) -> bool:
    return "routed_dp_rank" in body or "data_parallel_rank" in body or "disagg_prefill_dp_rank" in body


def rank_load(worker: Worker, rank: int) -> int:
    """Requests on one rank: the server's row plus what the router sent there since, at least the router's."""
    inflight = worker.rank_inflight[rank] if rank < len(worker.rank_inflight) else 0
    load = worker.server_load
    report = load.report if load is not None else None
    if report is None or rank >= len(report.ranks) or report.ranks[rank].dp_rank != rank:
        return inflight
    at = load.rank_inflight_at[rank] if rank < len(load.rank_inflight_at) else 0
    return max(inflight, report.ranks[rank].requests + inflight - at)


def _client_choice(body: dict, prefill: Worker, decode: Worker) -> tuple[int | None, int | None]:
    """The client's ranks for (prefill, decode), checked against both servers (400 out of range)."""
    routed, prefill_rank = client_ranks(body)
    if prefill_rank is not None:
        check_rank("disagg_prefill_dp_rank", prefill_rank, prefill.dp_ranks, prefill.url)
    if routed is not None:
        check_rank("routed_dp_rank", routed, prefill.dp_ranks, prefill.url)
        check_rank("routed_dp_rank", routed, decode.dp_ranks, decode.url)
    p_rank = prefill_rank if prefill_rank is not None else routed
    return p_rank, routed


def complete_client_ranks(body: dict, prefill: Worker, decode: Worker) -> None:
    """Without --dp-aware: a client's rank fields, checked, and the prefill rank named for both legs."""
    p_rank, routed = _client_choice(body, prefill, decode)
    body.pop("data_parallel_rank", None)
    if routed is not None:
        body["routed_dp_rank"] = routed
    if p_rank is not None:
        body["disagg_prefill_dp_rank"] = p_rank


class RankPlacer:
    """`--dp-aware`: one rank per leg, both legs' bodies, the router's in-flight count per rank."""

    def __init__(self, prefill_policy: str = "least_loaded", decode_policy: str = "least_loaded", *,
                 rng: random.Random | None = None) -> None:
        self._choosers: dict[str, Callable[[Worker], int]] = {}
        self._random = (rng or random.Random()).randrange
        self._turn: dict[str, int] = {}  # per worker: round robin, and where least-loaded ties start
        self.policies = {"prefill": prefill_policy, "decode": decode_policy}
        self._choose = {"prefill": self._chooser(prefill_policy), "decode": self._chooser(decode_policy)}

    def _chooser(self, policy: str) -> Callable[[Worker], int]:
        if policy not in RANK_POLICIES:
            raise ValueError(f"unknown DP rank policy {policy!r}; choose from {', '.join(RANK_POLICIES)}")
        return {"least_loaded": self._least_loaded, "round_robin": self._round_robin,
                "random": lambda w: self._random(w.dp_ranks)}[policy]

    def _next_turn(self, worker: Worker) -> int:
        turn = self._turn.get(worker.id, 0)
        self._turn[worker.id] = turn + 1
        return turn

    def _round_robin(self, worker: Worker) -> int:
        return self._next_turn(worker) % worker.dp_ranks

    def _least_loaded(self, worker: Worker) -> int:
        ranks = worker.dp_ranks
        start = self._next_turn(worker) % ranks  # ties go round, not always to rank 0
        best, best_load = start, rank_load(worker, start)
        for step in range(1, ranks):
            rank = (start + step) % ranks
            load = rank_load(worker, rank)
            if load < best_load:
                best, best_load = rank, load
        return best

    def place(self, body: dict, prefill: Worker, decode: Worker) -> tuple[bytes, bytes, int, int]:
        """(prefill payload, decode payload, prefill rank, decode rank); `body` is the attempt's own copy."""
        p_client, routed = _client_choice(body, prefill, decode) if has_client_ranks(body) else (None, None)
        p_rank = p_client if p_client is not None else (
            self._choose["prefill"](prefill) if prefill.dp_ranks > 1 else 0)
        d_rank = routed if routed is not None else (self._choose["decode"](decode) if decode.dp_ranks > 1 else 0)
        body.pop("data_parallel_rank", None)
        body["routed_dp_rank"] = p_rank
        body["disagg_prefill_dp_rank"] = p_rank
        prefill_payload = orjson.dumps(body)
        body["routed_dp_rank"] = d_rank
        return prefill_payload, orjson.dumps(body), p_rank, d_rank

    @staticmethod
    def enter(worker: Worker, rank: int) -> None:
        counts = worker.rank_inflight
        if len(counts) < worker.dp_ranks:
            counts.extend([0] * (worker.dp_ranks - len(counts)))
        if rank < len(counts):
            counts[rank] += 1

    @staticmethod
    def leave(worker: Worker, rank: int) -> None:
        counts = worker.rank_inflight
        if rank < len(counts) and counts[rank] > 0:
            counts[rank] -= 1
