"""Command line: every mini_lb launch form, sgl-router's common flags, and pd-router's own.

Accepted forms (all may be mixed):
  --prefill URL [URL ...] --decode URL [URL ...] [--prefill-bootstrap-ports P [P ...]]   (launch_lb)
  --prefill URL [PORT|none] --prefill URL2 [PORT2] --decode URL --decode URL2             (sglang_router)
"""

from __future__ import annotations

import argparse
import os

from policies import available_policies
from router.core.config import (
    DISCOVER,
    AdmissionConfig,
    BreakerConfig,
    ConfigError,
    HealthConfig,
    RetryConfig,
    RouterConfig,
    WorkerSpec,
)
from router.server import cli_policies

# launch_lb's short names.
POLICY_ALIASES = {"po2": "power_of_two", "rr": "round_robin"}


def _is_url(token: str) -> bool:
    return "://" in token


def _parse_port_token(token: str) -> int | None:
    if token.lower() in ("none", "null"):
        return None
    try:
        return int(token)
    except ValueError:
        raise ConfigError([f"--prefill: expected a URL, a bootstrap port or 'none', got {token!r}"]) from None


def parse_prefill_groups(groups: list[list[str]]) -> list[tuple[str, int | None | str]]:
    """Flatten repeated `--prefill` groups into (url, port) pairs; a port token belongs to the URL before it."""
    out: list[tuple[str, int | None | str]] = []
    for group in groups:
        for token in group:
            if _is_url(token):
                out.append((token, DISCOVER))
            elif not out or out[-1][1] is not DISCOVER:
                raise ConfigError([f"--prefill: bootstrap port {token!r} does not follow a URL"])
            else:
                out[-1] = (out[-1][0], _parse_port_token(token))
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pd-router",
        description="Router for SGLang prefill/decode disaggregation (drop-in for mini_lb).",
    )
    add = p.add_argument
    # mini_lb / sglang_router forms
    add("--prefill", action="append", nargs="+", default=[], metavar="URL [PORT]",
        help="prefill server URL, optionally followed by its bootstrap port (or 'none'); repeatable")
    add("--decode", action="append", nargs="+", default=[], metavar="URL", help="decode server URL(s); repeatable")
    add("--prefill-bootstrap-ports", nargs="+", default=None, metavar="PORT",
        help="bootstrap ports: one for every prefill, or one per prefill URL ('none' allowed)")
    add("--pd-disaggregation", action="store_true", help="accepted for compatibility (always on)")
    add("--mini-lb", action="store_true", help="accepted for compatibility")
    add("--host", default="0.0.0.0")
    add("--port", type=int, default=30000)
    add("--timeout", "--request-timeout-secs", dest="request_timeout_secs", type=float, default=1800.0,
        help="deadline of one request, both legs, seconds")
    add("--policy", default=None, help="policy for both pools")
    add("--prefill-policy", default=None)
    add("--decode-policy", default=None)
    add("--api-key", default=None, help="require 'Authorization: Bearer KEY' (env PD_ROUTER_API_KEY)")
    add("--admin-api-key", default=None,
        help="key for admin/control endpoints only (env PD_ROUTER_ADMIN_API_KEY); defaults to --api-key")
    add("--worker-api-key", default=None,
        help="key the workers (SGLang --api-key) require; sent on every call to them (env PD_ROUTER_WORKER_API_KEY)")
    add("--prometheus-port", type=int, default=None, help="also serve /metrics on this port")
    add("--prometheus-host", default=None)
    add("--log-level", default="info", choices=["debug", "info", "warning", "error", "critical"])
    add("--log-json", action="store_true", help="log one JSON object per line (with request_id)")
    # worker start-up, connections
    add("--worker-startup-timeout-secs", type=float, default=10.0,
        help="how long start-up waits to learn prefill bootstrap ports before serving")
    add("--connect-timeout-secs", type=float, default=10.0)
    add("--max-connections", type=int, default=8192, help="upstream connection pool size")
    # health and circuit breaker (sgl-router names)
    add("--health-check-interval-secs", type=float, default=5.0)
    add("--health-check-timeout-secs", type=float, default=5.0)
    add("--health-failure-threshold", type=int, default=3)
    add("--health-success-threshold", type=int, default=2)
    add("--health-check-endpoint", default="/health")
    add("--disable-health-check", action="store_true")
    add("--cb-failure-threshold", type=int, default=10)
    add("--cb-success-threshold", type=int, default=3)
    add("--cb-timeout-duration-secs", type=float, default=30.0)
    add("--disable-circuit-breaker", action="store_true")
    # retries
    add("--retry-max-retries", type=int, default=3)
    add("--retry-initial-backoff-ms", type=float, default=50)
    add("--retry-max-backoff-ms", type=float, default=2000)
    add("--retry-backoff-multiplier", type=float, default=2.0)
    add("--retry-jitter-factor", type=float, default=0.2)
    add("--disable-retries", action="store_true")
    add("--no-retry-aborted", action="store_true",
        help="do not re-send requests the router aborted for a conversion")
    # admission
    add("--max-concurrent-requests", type=int, default=0, help="0: unbounded")
    add("--queue-size", type=int, default=1024)
    add("--queue-timeout-secs", type=float, default=60.0)
    add("--max-payload-size", type=int, default=256 * 1024 * 1024, help="bytes")
    # flows
    add("--drain-timeout-secs", type=float, default=300.0)
    add("--switch-timeout-secs", type=float, default=120.0)
    add("--weight-update-timeout-secs", type=float, default=600.0)
    add("--abort-timeout-secs", type=float, default=30.0,
        help="how long an abort, pause or weight update waits for the aborted requests to end")
    add("--weight-update-retry-aborted", action="store_true",
        help="re-send requests a weight update aborted before their first token (default: abort answer)")
    add("--no-inject-rid", action="store_true", help="do not add a router-made rid to requests without one")
    cli_policies.add_flags(p)
    return p


def _policy(name: str | None, fallback: str) -> str:
    name = POLICY_ALIASES.get(name, name) if name else fallback
    return name


def config_from_args(argv: list[str] | None = None, env: dict | None = None) -> RouterConfig:
    args = build_parser().parse_args(argv)
    env = os.environ if env is None else env
    problems: list[str] = []

    try:
        prefills = parse_prefill_groups(args.prefill)
    except ConfigError as exc:
        problems.extend(exc.problems)
        prefills = []
    decodes = [url for group in args.decode for url in group]

    if args.prefill_bootstrap_ports is not None:
        try:
            ports = [_parse_port_token(t) for t in args.prefill_bootstrap_ports]
        except ConfigError as exc:
            problems.extend(exc.problems)
            ports = []
        if len(ports) == 1:
            ports = ports * len(prefills)
        if ports and len(ports) != len(prefills):
            problems.append(f"--prefill-bootstrap-ports: {len(ports)} ports for {len(prefills)} prefill URLs")
        else:
            prefills = [(url, port if given is DISCOVER else given)
                        for (url, given), port in zip(prefills, ports)]

    fallback = _policy(args.policy, "random")
    prefill_policy = _policy(args.prefill_policy, fallback)
    decode_policy = _policy(args.decode_policy, fallback)
    names = available_policies()
    for leg, name in (("prefill", prefill_policy), ("decode", decode_policy)):
        if name not in names:
            problems.append(f"unknown {leg} policy {name!r}; choose from {', '.join(sorted(names))}")

    api_key = args.api_key or env.get("PD_ROUTER_API_KEY") or None
    admin_key = args.admin_api_key or env.get("PD_ROUTER_ADMIN_API_KEY") or None
    worker_key = args.worker_api_key or env.get("PD_ROUTER_WORKER_API_KEY") or None

    config = RouterConfig(
        prefill=tuple(WorkerSpec(url, port) for url, port in prefills),
        decode=tuple(WorkerSpec(url, None) for url in decodes),
        host=args.host,
        port=args.port,
        request_timeout_secs=args.request_timeout_secs,
        connect_timeout_secs=args.connect_timeout_secs,
        worker_startup_timeout_secs=args.worker_startup_timeout_secs,
        prefill_policy=prefill_policy,
        decode_policy=decode_policy,
        api_key=api_key,
        admin_api_key=admin_key,
        worker_api_key=worker_key,
        max_connections=args.max_connections,
        log_level=args.log_level,
        log_json=args.log_json,
        prometheus_port=args.prometheus_port,
        prometheus_host=args.prometheus_host,
        health=HealthConfig(
            interval_secs=args.health_check_interval_secs,
            timeout_secs=args.health_check_timeout_secs,
            failure_threshold=args.health_failure_threshold,
            success_threshold=args.health_success_threshold,
            endpoint=args.health_check_endpoint,
            enabled=not args.disable_health_check,
        ),
        breaker=BreakerConfig(
            failure_threshold=args.cb_failure_threshold,
            success_threshold=args.cb_success_threshold,
            timeout_secs=args.cb_timeout_duration_secs,
            enabled=not args.disable_circuit_breaker,
        ),
        retry=RetryConfig(
            max_retries=args.retry_max_retries,
            initial_backoff_ms=args.retry_initial_backoff_ms,
            max_backoff_ms=args.retry_max_backoff_ms,
            backoff_multiplier=args.retry_backoff_multiplier,
            jitter_factor=args.retry_jitter_factor,
            enabled=not args.disable_retries,
            retry_aborted=not args.no_retry_aborted,
        ),
        admission=AdmissionConfig(
            max_concurrent_requests=args.max_concurrent_requests,
            queue_size=args.queue_size,
            queue_timeout_secs=args.queue_timeout_secs,
            max_payload_size=args.max_payload_size,
        ),
        drain_timeout_secs=args.drain_timeout_secs,
        switch_timeout_secs=args.switch_timeout_secs,
        weight_update_timeout_secs=args.weight_update_timeout_secs,
        abort_timeout_secs=args.abort_timeout_secs,
        weight_update_retry_aborted=args.weight_update_retry_aborted,
        inject_rid=not args.no_inject_rid,
        policy_params=cli_policies.policy_params_from_args(args),
        load_monitor=cli_policies.load_monitor_from_args(args),
        rebalance=cli_policies.rebalance_from_args(args),
    )
    problems.extend(config.problems())
    if problems:
        raise ConfigError(problems)
    return config
