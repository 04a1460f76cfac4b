"""Flags of the policies (sgl-router's names), the load monitor and the rebalancer."""

from __future__ import annotations

from policies.params import PolicyParams
from policies.rebalance import RebalanceMode, RebalanceConfig
from router.core.config import DP_RANK_POLICIES
from router.server.cli_flags import Flag, field_flags, flag

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
    "core": "the decision core: model (the split a fitted fleet model predicts serves the SLOs best) or rules "
            "(the pressure-ratio rules)",
    "attainment_target": "model: the share of requests meeting both SLO targets that is enough (a split "
                         "predicted to reach it holds)",
    "horizon_secs": "model: how far ahead a split is valued (how long a measured mix is expected to last)",
    "min_gain": "model: the least predicted attainment gain over the horizon worth a conversion",
    "conversion_secs": "model: a conversion's duration before any was measured (then the recent ones' mean)",
    "interval_secs": "seconds between two observations and decisions",
    "window_secs": "latency samples older than this are forgotten",
    "warmup_secs": "no conversion this long after start",
    "confirmations": "intervals a proposal must hold (past the margin) before it converts",
    "urgent_pressure": "a hot pool at least this pressured converts on one sighting (0: never), unless that "
                       "undoes the last conversion within twice the cooldown",
    "cooldown_secs": "no conversion the other way this long after the last one ended (no flapping)",
    "step_cooldown_secs": "no conversion the same way this long after the last one ended (let it act first; "
                          "default: a quarter of --rebalance-cooldown-secs)",
    "failure_cooldown_secs": "no conversion this long after one failed",
    "min_prefill": "never shrink the prefill pool below this",
    "min_decode": "never shrink the decode pool below this",
    "min_pressure": "act only when the hot pool's pressure (1.0 = at target) reaches this",
    "min_improvement": "act only when the worst pressure is predicted to fall by this share",
    "ttft_target_secs": "TTFT target (p90 measured by the router, failed and abandoned requests included), "
                        "charged to the pool whose waiting requests clearly dominate",
    "itl_target_secs": "inter-token latency target: the decode servers' own mean step, else the router's p90",
    "queue_target": "requests waiting on a pool's capacity per server that count as full pressure",
    "kv_target": "decode KV usage (the servers' own work) that counts as full pressure",
    "busy_target": "a prefill's share of time in forwards that counts as full pressure",
    "min_samples": "requests (finished, failed or abandoned) a latency figure needs; with fewer in the window, the "
                   "newest ones from up to four windows back",
    "conversion_mode": "how a conversion empties the server: drain (requests finish) or abort (re-sent elsewhere)",
    "refill_empty_pool": "refill a pool left without a routable server from the other pool at once (always on with "
                         "--rebalance enabled; this alone turns it on with advisory or off: recovery without ratio "
                         "changes)",
}

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
