"""Data-parallel ranks as SGLang 0.5.23 assigns them (docs/DP_RANKS.md).

- A request's rank: its `routed_dp_rank` (or the deprecated `data_parallel_rank`) when it has one, else the
  server's `load_balance_method`: a prefill follows the bootstrap room (`room % ranks`), a decode and a
  non-PD server take the next rank round robin.
- `routed_dp_rank` outside `[0, ranks)` is the tokenizer's ValueError (a 400); with one rank, 0 is ignored.
- A prefill request moved off `room % ranks` by `routed_dp_rank` without `disagg_prefill_dp_rank` fails its
  bootstrap at once: the conflict check of `CommonKVSender`.
- The KV lives in the prefill rank that computed it; a decode pulls from `disagg_prefill_dp_rank` when the
  request has it, else from `room % prefill ranks` (the prefill follows the room).
"""

from __future__ import annotations

from typing import Any

RANK_FIELDS = ("routed_dp_rank", "data_parallel_rank", "disagg_prefill_dp_rank")


def _int_field(body: dict, name: str) -> tuple[int | None, dict | None]:
    value = body.get(name)
    if value is None:
        return None, None
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, str) and value.strip().lstrip("-").isdigit():
            return int(value), None  # pydantic's lax mode reads a numeric string
        return None, {"type": "int_type", "loc": ["body", name], "msg": "Input should be a valid integer",
                      "input": value}
    return value, None


def rank_fields(body: Any) -> tuple[int | None, int | None, list[dict]]:
    """(routed_dp_rank, disagg_prefill_dp_rank, schema errors) of a generate body; the alias folded in."""
    if not isinstance(body, dict):
        return None, None, []
    errors: list[dict] = []
    values = {}
    for name in RANK_FIELDS:
        values[name], error = _int_field(body, name)
        if error is not None:
            errors.append(error)
    routed = values["routed_dp_rank"]
    if routed is None:
        routed = values["data_parallel_rank"]
    return routed, values["disagg_prefill_dp_rank"], errors


def check_routed(routed: int | None, ranks: int) -> None:
    """The tokenizer's check (TokenizerManager, 0.5.23): raises ValueError, answered as a 400."""
    if routed is None or (ranks <= 1 and routed == 0):
        return
    if routed < 0 or routed >= ranks:
        raise ValueError(f"routed_dp_rank={routed} out of range [0, {ranks})")


class RankChooser:
    """One server's DataParallelController: which rank runs a request."""

    def __init__(self, ranks: int) -> None:
        self.ranks = ranks
        self._next = 0

    def choose(self, role: str, room: int | None, routed: int | None) -> int:
        if self.ranks <= 1:
            return 0
        if routed is not None:
            return routed
        if role == "prefill" and room is not None:  # follow_bootstrap_room (a prefill's `auto`)
            return room % self.ranks
        rank, self._next = self._next, (self._next + 1) % self.ranks  # round_robin
        return rank


def prefill_conflict(rank: int, room: int | None, ranks: int, disagg_prefill_dp_rank: int | None) -> str | None:
    """`CommonKVSender`'s follow_bootstrap_room conflict message, or None when the rank is the room's."""
    if ranks <= 1 or disagg_prefill_dp_rank is not None or room is None or rank == room % ranks:
        return None
    return (f"follow_bootstrap_room conflict: dispatched to dp_rank {rank} but bootstrap_room {room} implies "
            f"dp_rank {room % ranks}. Set SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK=1 to allow mixed "
            f"routing.")


def pulled_rank(room: int, ranks: int, disagg_prefill_dp_rank: int | None) -> int:
    """The prefill rank a decode pulls `room` from (decode's `_resolve_prefill_dp_rank`)."""
    if disagg_prefill_dp_rank is not None:
        return disagg_prefill_dp_rank
    return 0 if ranks <= 1 else room % ranks


def room_key(rank: int, room: int | None) -> Any:
    """Where a room's KV is kept on a prefill: per rank (rank 0 keeps the plain room id)."""
    return room if rank == 0 else (rank, room)


def sort_key(key: Any) -> tuple:
    return (0, key, 0) if not isinstance(key, tuple) else (1, key[1], key[0])
