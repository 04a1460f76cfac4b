"""Flags of the policies (sgl-router's names), the load monitor and the rebalancer."""

from __future__ import annotations

import argparse
from dataclasses import fields

from policies.params import PolicyParams
from policies.rebalance import Mode, RebalanceConfig
from router.core.config import LoadMonitorConfig

_POLICY_HELP = {
    "cache_threshold": "cache_aware: minimum share of the prompt its cached prefix must cover (0..1)",
    "balance_abs_threshold": "cache_aware: imbalanced when max load - min load exceeds this ...",
    "balance_rel_threshold": "... and max load exceeds this times min load: then the least loaded wins",
    "max_tree_size": "cache_aware: prompt characters remembered per worker",
    "eviction_interval_secs": "cache_aware: seconds between evictions down to --max-tree-size",
    "prefix_chunk_chars": "cache_aware: granularity of prefix matching, in characters",
}


_REBALANCE_HELP = {
    "interval_secs": "seconds between two observations and decisions",
    "window_secs": "latency samples older than this are forgotten",
    "warmup_secs": "no conversion this long after start",
    "confirmations": "consecutive intervals a proposal must hold",
    "cooldown_secs": "no conversion this long after the last one ended",
    "failure_cooldown_secs": "no conversion this long after one failed",
    "min_prefill": "never shrink the prefill pool below this",
    "min_decode": "never shrink the decode pool below this",
    "min_pressure": "act only when the hot pool's pressure (1.0 = at target) reaches this",
    "min_improvement": "act only when the worst pressure is predicted to fall by this share",
    "ttft_target_secs": "TTFT target (p90 measured by the router): the prefill pool's latency pressure",
    "itl_target_secs": "inter-token latency target (p90): the decode pool's latency pressure",
    "queue_target": "waiting requests per server that count as full pressure",
    "kv_target": "KV cache usage that counts as full pressure",
    "min_samples": "finished requests a latency figure needs in the window",
    "conversion_mode": "how a conversion empties the server: drain (requests finish) or abort (re-sent elsewhere)",
}


def _flag(name: str, prefix: str = "") -> str:
    return "--" + prefix + name.replace("_", "-")


def add_flags(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    for f in fields(PolicyParams):
        default = getattr(PolicyParams(), f.name)
        add(_flag(f.name), type=type(default), default=default, help=_POLICY_HELP.get(f.name))
    monitor = LoadMonitorConfig()
    add("--load-poll-interval-secs", type=float, default=monitor.interval_secs,
        help="how often each server's /v1/loads is read (power_of_two, cache_aware, the rebalancer)")
    add("--load-poll-timeout-secs", type=float, default=monitor.timeout_secs)
    add("--disable-load-poll", action="store_true", help="policies use the router's own counts only")
    rebalance = RebalanceConfig()
    add("--rebalance", choices=[m.value for m in Mode], default=rebalance.mode.value,
        help="automatic P/D conversion: off, advisory (record what it would do; the default) or enabled")
    for f in fields(RebalanceConfig):
        if f.name in ("mode", "history"):
            continue
        default = getattr(rebalance, f.name)
        add(_flag(f.name, "rebalance-"), type=type(default), default=default, dest=f"rebalance_{f.name}",
            help=_REBALANCE_HELP.get(f.name))


def policy_params_from_args(args: argparse.Namespace) -> PolicyParams:
    return PolicyParams(**{f.name: getattr(args, f.name) for f in fields(PolicyParams)})


def load_monitor_from_args(args: argparse.Namespace) -> LoadMonitorConfig:
    return LoadMonitorConfig(enabled=not args.disable_load_poll, interval_secs=args.load_poll_interval_secs,
                             timeout_secs=args.load_poll_timeout_secs)


def rebalance_from_args(args: argparse.Namespace) -> RebalanceConfig:
    values = {f.name: getattr(args, f"rebalance_{f.name}") for f in fields(RebalanceConfig)
              if f.name not in ("mode", "history")}
    return RebalanceConfig(mode=args.rebalance, **values)
