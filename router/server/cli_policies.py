"""Flags of the policies (sgl-router's names), the load monitor and the rebalancer."""

from __future__ import annotations

import argparse

from policies.params import PolicyParams
from policies.rebalance import RebalanceMode, RebalanceConfig
from router.core.config import DP_RANK_POLICIES
from router.server.cli_flags import Flag, field_flags, flag
from router.server.cli_peers import NameGiven

_POLICY_HELP = {
    "cache_threshold": "cache_aware: minimum share of the prompt its cached prefix must cover (0..1)",
    "balance_abs_threshold": "cache_aware: imbalanced when max load - min load exceeds this ...",
    "balance_rel_threshold": "... and max load exceeds this times min load: then the least loaded wins",
    "max_tree_size": "cache_aware: prompt characters remembered per worker",
    "eviction_interval_secs": "cache_aware: seconds between evictions down to --max-tree-size",
    "prefix_chunk_chars": "cache_aware: granularity of prefix matching, in characters",
    "routing_key_override": "sticky sessions on any policy (SMG's): a request naming a routing key "
                            "(--routing-key-headers) goes where its key went while that worker is routable; new "
                            "keys and requests without one go where the policy says",
}


_REBALANCE_HELP = {
    "interval_secs": "seconds between two observations and decisions",
    "window_secs": "the fleet model is fitted on the servers' and the router's counters of this many last seconds",
    "warmup_secs": "no conversion this long after start",
    "ttft_target_secs": "the SLO's time to first token: the model predicts the share of requests within it",
    "itl_target_secs": "the SLO's time per output token (the mean gap between a request's tokens)",
    "attainment_target": "the share of requests meeting both SLO targets that is enough: a split predicted to "
                         "reach it is kept",
    "horizon_secs": "how far ahead a split is valued (how long a measured mix is expected to last)",
    "min_gain": "the least predicted attainment gain over the horizon worth a conversion",
    "conversion_secs": "a conversion's duration (drain and switch) before any was measured; then the recent "
                       "ones' mean per direction",
    "failure_cooldown_secs": "no conversion this long after one failed",
    "min_prefill": "never shrink the prefill pool below this",
    "min_decode": "never shrink the decode pool below this",
    "min_samples": "requests (finished, failed or abandoned) the latency figures shown need; with fewer in the "
                   "window, the newest ones from up to four windows back",
    "conversion_mode": "how a conversion empties the server: drain (requests finish) or abort (re-sent elsewhere)",
    "refill_empty_pool": "refill a pool left without a routable server from the other pool at once (always on with "
                         "--rebalance enabled; this alone turns it on with advisory or off: recovery without ratio "
                         "changes)",
}

# The pressure-ratio rules' knobs, retired with them: accepted (a command line that names them still starts),
# named in one start-up warning, without effect.
RETIRED_REBALANCE_FLAGS = ("--rebalance-confirmations", "--rebalance-urgent-pressure", "--rebalance-cooldown-secs",
                           "--rebalance-step-cooldown-secs", "--rebalance-min-pressure",
                           "--rebalance-min-improvement", "--rebalance-queue-target", "--rebalance-kv-target",
                           "--rebalance-busy-target")
RETIRED_DEST = "rebalance_flags_retired"


def add_retired_flags(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(**{RETIRED_DEST: []})
    for name in RETIRED_REBALANCE_FLAGS:
        parser.add_argument(name, action=NameGiven, record_into=RETIRED_DEST, dest=argparse.SUPPRESS,
                            default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def retired_warning(flags: list[str]) -> str | None:
    """The start-up line naming the retired rebalancer flags given."""
    if not flags:
        return None
    return (f"no effect: {', '.join(flags)} (the pressure-ratio rules' knobs; the rebalancer now chooses the split "
            f"its fleet model predicts serves the SLOs best: --rebalance-ttft-target-secs, "
            f"--rebalance-itl-target-secs, --rebalance-horizon-secs, --rebalance-min-gain)")

# SMG 1.13's names of the same knobs.
_POLICY_ALIASES = {
    "cache_threshold": ("--cache-match-threshold",),
    "balance_abs_threshold": ("--spill-abs-threshold",),
    "balance_rel_threshold": ("--spill-rel-threshold",),
    "max_idle_secs": ("--sticky-key-idle-secs",),
    "routing_key_override": ("--sticky-sessions",),
}

POLICY_FLAGS: list[Flag] = [
    *field_flags("policy_params", PolicyParams, helps=_POLICY_HELP, aliases=_POLICY_ALIASES),
    flag("--load-poll-interval-secs", "--load-monitor-interval", path="load_monitor.interval_secs",
         help="how often each server's /v1/loads is read (power_of_two, cache_aware, the rebalancer)"),
    flag("--load-poll-timeout-secs", path="load_monitor.timeout_secs"),
    flag("--disable-load-poll", path="load_monitor.enabled", help="policies use the router's own counts only"),
    flag("--dp-aware", path="dp_ranks.aware",
         help="choose each leg's data-parallel rank (SGLang --dp-size/--enable-dp-attention servers) and send "
              "routed_dp_rank and disagg_prefill_dp_rank so both legs agree (docs/DP_RANKS.md)"),
    flag("--prefill-dp-rank-policy", path="dp_ranks.prefill_policy", choices=DP_RANK_POLICIES,
         help="how --dp-aware chooses a prefill server's rank"),
    flag("--decode-dp-rank-policy", path="dp_ranks.decode_policy", choices=DP_RANK_POLICIES,
         help="how --dp-aware chooses a decode server's rank"),
    flag("--disable-load-monitoring", path="load_monitor.on_demand",
         help="SMG's: read the servers' loads only when something uses them (a load-aware policy, the rebalancer)"),
    flag("--rebalance", path="rebalance.mode", choices=tuple(m.value for m in RebalanceMode),
         help="automatic P/D conversion: off, advisory (record what it would do) or enabled"),
    # `history` is the admin API's memory, not a knob of the command line.
    *field_flags("rebalance", RebalanceConfig, prefix="rebalance-", helps=_REBALANCE_HELP,
                 skip=("mode", "history")),
]
