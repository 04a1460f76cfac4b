"""What a server's launch facts say about its data-parallel ranks, and a client's rank fields, as SGLang 0.5.23
reads them (docs/DP_RANKS.md). Pure functions: discovery, the request path and the conversion flow use them.

- ranks = `dp_size x attn_dp_size` (`--dp-size N --enable-dp-attention` reports dp_size 1, attn_dp_size N);
- a role switch 0.5.23 refuses on an attention-DP server, in its own words;
- `routed_dp_rank` (or the deprecated `data_parallel_rank`) and `disagg_prefill_dp_rank` sent by a client.
"""

from __future__ import annotations

from typing import Any

from router.core.errors import BadRequest

# 0.5.23's `pd_disaggregation_hook`: features whose role-specific state a role switch does not rebuild.
_SWITCH_UNSUPPORTED = (
    ("ep_size", lambda v: isinstance(v, int) and v > 1, "expert parallelism (--ep-size {})"),
    ("moe_a2a_backend", lambda v: isinstance(v, str) and v != "none", "MoE all-to-all (--moe-a2a-backend {})"),
    ("pp_size", lambda v: isinstance(v, int) and v > 1, "pipeline parallelism (--pp-size {})"),
    ("enable_dp_attention_local_control_broadcast", lambda v: v is True, "DP attention local control broadcast"),
    ("dcp_size", lambda v: isinstance(v, int) and v > 1, "decode context parallelism (--dcp-size {})"),
    ("speculative_algorithm", lambda v: isinstance(v, str) and bool(v),
     "speculative decoding (--speculative-algorithm {})"),
)


def _size(info: dict, key: str) -> int:
    value = info.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else 1


def rank_count(server_info: Any) -> int:
    """`num_dp_ranks` of a server by its `/server_info` (1 when it does not say)."""
    if not isinstance(server_info, dict):
        return 1
    return _size(server_info, "dp_size") * _size(server_info, "attn_dp_size")


def attention_dp(server_info: Any) -> bool:
    return isinstance(server_info, dict) and (_size(server_info, "attn_dp_size") > 1
                                              or server_info.get("enable_dp_attention") is True)


def switch_refusal(server_info: Any) -> str | None:
    """Why 0.5.23 would refuse to switch this attention-DP server's role (None: it would try, or not DP)."""
    if not attention_dp(server_info):
        return None
    unsupported = [what.format(server_info.get(key)) for key, bad, what in _SWITCH_UNSUPPORTED
                   if bad(server_info.get(key))]
    if unsupported:
        return ("--enable-pd-role-switch does not rebuild role-specific state for the following features: "
                + ", ".join(unsupported) + " (SGLang 0.5.23; this server runs attention DP with them)")
    if server_info.get("enable_pd_role_switch") is not True:
        return ("--enable-pd-role-switch is not set on this server (an attention-DP server launched without it; "
                "SGLang 0.5.23 refuses the switch)")
    return None


def _rank_field(body: dict, name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"{name} must be an integer rank, not {value!r}"[:300], param=name)
    return value


def client_ranks(body: dict) -> tuple[int | None, int | None]:
    """(routed_dp_rank, disagg_prefill_dp_rank) a client sent; 400 for a value that is not a rank."""
    routed = _rank_field(body, "routed_dp_rank")
    alias = _rank_field(body, "data_parallel_rank")
    return (routed if routed is not None else alias), _rank_field(body, "disagg_prefill_dp_rank")


def check_rank(name: str, rank: int, ranks: int, url: str) -> None:
    """0.5.23's tokenizer check, made before the request reaches a server (one rank: 0 is ignored)."""
    if ranks <= 1 and rank == 0:
        return
    if rank < 0 or rank >= ranks:
        raise BadRequest(f"{name}={rank} out of range [0, {ranks}) for {url}", param=name)
