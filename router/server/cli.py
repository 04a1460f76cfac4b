"""Command line: every mini_lb launch form, sgl-router's common flags, and pd-router's own.

The launch forms' flags (workers, policies) are parsed here by hand; every other flag is a row of
`SETTING_FLAGS` / `POLICY_FLAGS`, whose default and type come from the config model.

Accepted forms (all may be mixed):
  --prefill URL [URL ...] --decode URL [URL ...] [--prefill-bootstrap-ports P [P ...]]   (launch_lb)
  --prefill URL [PORT|none] --prefill URL2 [PORT2] --decode URL --decode URL2             (sglang_router)
"""

from __future__ import annotations

import argparse
import os

from policies import available_policies
from router.core.config import DISCOVER, ConfigError, RouterConfig, WorkerSpec
from router.server.cli_flags import DEFAULTS, Flag, add_flags, config_with_flags, flag
from router.server.cli_groups import GroupedHelpFormatter, add_sections, section_of
from router.server.cli_peers import IGNORED_DEST, add_peer_flags, ignored_warning
from router.server.cli_policies import POLICY_FLAGS, RETIRED_DEST, add_retired_flags, retired_warning

# --log-level: Python's names and the peers' (warn).
LOG_LEVELS = ("debug", "info", "warn", "warning", "error", "critical")
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


# Every flag that sets one config field (sgl-router's names where it has one).
SETTING_FLAGS: list[Flag] = [
    flag("--host"),
    flag("--port"),
    flag("--timeout", "--request-timeout-secs", path="request_timeout_secs",
         help="deadline of one request, both legs, seconds"),
    flag("--api-key", help="require 'Authorization: Bearer KEY'", env="PD_ROUTER_API_KEY"),
    flag("--admin-api-key", help="key for admin/control endpoints only; defaults to --api-key",
         env="PD_ROUTER_ADMIN_API_KEY"),
    flag("--control-plane-api-keys", help="SMG's admin keys, id:name:role:key each: role admin opens the admin "
                                          "routes (as --admin-api-key), user the generation routes where "
                                          "--api-key closes them; the id names the caller in the audit log"),
    flag("--control-plane-audit-enabled",
         help="log one line per admin call (logger router.audit): method, path, caller (key id), address, status"),
    flag("--cors-allowed-origins", help="browsers on these origins (scheme://host[:port], or *) may call the "
                                        "router: CORS headers and preflights; default: none"),
    flag("--worker-api-key", help="key the workers (SGLang --api-key) require; sent on every call to them",
         env="PD_ROUTER_WORKER_API_KEY"),
    flag("--admin-allow-cidrs", help="admin routes only from these networks or addresses (others: 403); "
                                     "default: from anywhere"),
    flag("--worker-allow", help="workers may be registered (POST /workers, /add_worker, /register) only on these "
                                "networks, addresses, host names or .domains (others: 403); default: anywhere"),
    flag("--tls-cert-path", help="serve HTTPS with this certificate (PEM, chain first) ..."),
    flag("--tls-key-path", help="... and its private key (PEM)"),
    flag("--client-cert-path", help="https:// workers: present this client certificate (PEM) to them (mTLS) ..."),
    flag("--client-key-path", help="... with this private key (PEM)"),
    flag("--ca-cert-paths", nargs="*", help="https:// workers: trust these CA bundles (PEM) besides the system's "
                                            "store, to verify the workers' certificates; repeatable"),
    flag("--prometheus-port", help="also serve /metrics on this port"),
    flag("--prometheus-host"),
    flag("--prometheus-duration-buckets", help="the bounds (seconds) of pd_router_request_duration_seconds; "
                                               "default: 0.01 ... 1800"),
    flag("--log-level", choices=LOG_LEVELS, help="warn is the peers' spelling of warning"),
    flag("--log-json", help="log one JSON object per line (with request_id)"),
    flag("--log-dir", help="also write the log to a file in this directory (created if need be): pd-router.log, "
                           "one per process with --replicas"),
    flag("--request-id-headers", help="the request id (on every log line) is the first of these headers the client "
                                      "sent, echoed back as X-Request-Id; default: X-Request-Id, not echoed"),
    # worker start-up, connections
    flag("--worker-startup-timeout-secs",
         help="how long start-up waits to learn prefill bootstrap ports before serving"),
    flag("--worker-startup-check-interval", path="worker_startup_check_interval_secs",
         help="how often a worker not read yet (down, starting) is read again; default: the health-check interval"),
    flag("--connect-timeout-secs"),
    flag("--upstream-idle-timeout-secs",
         help="cut a leg whose server sends nothing for this long mid-answer (not while the fleet is paused in "
              "place), and a prefill leg still open this long after decode answered; 0: never"),
    flag("--max-connections", help="upstream connection pool size (legs in flight; capped by the open-files "
                                   "limit: docs/ROLLOUT_BURSTS.md)"),
    flag("--max-connections-per-worker",
         help="this router's legs on one server at once; more requests wait in the router's queue until their "
              "deadline; 0: no bound per worker"),
    # SMG's connection bounds (docs/guides/reliability.md: Limits); 0 turns each off
    flag("--upstream-pool-idle-timeout-secs", path="connections.upstream_pool_idle_timeout_secs",
         help="close pooled connections to the workers idle this long (below SGLang's 5 s keep-alive)"),
    flag("--header-read-timeout-secs", path="connections.header_read_timeout_secs",
         help="close a client connection whose request head is not in within this long of its accept (or of "
              "the next head's first byte)"),
    flag("--idle-connection-timeout-secs", path="connections.idle_connection_timeout_secs",
         help="close a keep-alive client connection with no request in flight for this long"),
    flag("--stream-body-stall-timeout-secs", path="connections.stream_body_stall_timeout_secs",
         help="a request body that stops arriving for this long: 408"),
    flag("--sse-keepalive-secs", path="connections.sse_keepalive_secs",
         help="write an SSE comment (': keep-alive') on a stream after this much silence, a long prefill before "
              "the first token included; 0: none (SGLang's bench_serving parses every line as an event)"),
    # workers listed outside the command line (docs/guides/workers.md)
    flag("--discovery-file", path="worker_sources.file",
         help="a YAML or JSON file listing workers (url, worker_type, bootstrap_port), watched: workers added to "
              "it are registered, removed ones removed; a bad version changes nothing"),
    flag("--discovery-provider", path="worker_sources.provider", choices=("file", "kubernetes"),
         help="SMG's: file is --discovery-file's watcher (given without it: on by default); kubernetes is "
              "--service-discovery"),
    flag("--service-discovery", path="worker_sources.service_discovery",
         help="Kubernetes pod discovery: pods matching the selectors, Running and Ready, are workers "
              "(docs/KUBERNETES.md; needs pip install 'pd-router[k8s]')"),
    flag("--prefill-selector", path="worker_sources.prefill_selector", nargs="*",
         help="key=value labels of the prefill pods"),
    flag("--decode-selector", path="worker_sources.decode_selector", nargs="*",
         help="key=value labels of the decode pods"),
    flag("--selector", path="worker_sources.selector", nargs="*",
         help="key=value labels of pods whose servers' live role names their pool"),
    flag("--service-discovery-port", path="worker_sources.service_discovery_port",
         help="the discovered pods' worker port"),
    flag("--service-discovery-namespace", path="worker_sources.service_discovery_namespace",
         help="the namespace of the pods; absent: every namespace (which needs a ClusterRole)"),
    flag("--bootstrap-port-annotation", path="worker_sources.bootstrap_port_annotation",
         help="the pod annotation holding a prefill's bootstrap port (absent: read from the server)"),
    flag("--discovery-file-interval-secs", "--discovery-check-interval-secs", path="worker_sources.file_interval_secs",
         help="how often the discovery file is looked at"),
    flag("--discovery-etcd-endpoints", path="worker_sources.etcd_endpoints",
         help="etcd client URLs: workers announced under /pd-router/NAME/v1/discovery/ (python -m "
              "router.cluster.announce) are registered, and removed when their key goes (its lease ended)"),
    flag("--discovery-cluster-name", path="worker_sources.etcd_cluster_name",
         help="NAME in the discovery keys' prefix"),
    # health and circuit breaker (sgl-router names)
    flag("--health-check-interval-secs", path="health.interval_secs"),
    flag("--health-check-timeout-secs", path="health.timeout_secs"),
    flag("--health-failure-threshold", path="health.failure_threshold"),
    flag("--health-success-threshold", path="health.success_threshold"),
    flag("--health-check-endpoint", path="health.endpoint"),
    flag("--disable-health-check", path="health.enabled"),
    flag("--cb-failure-threshold", path="breaker.failure_threshold"),
    flag("--cb-success-threshold", path="breaker.success_threshold"),
    flag("--cb-timeout-duration-secs", path="breaker.timeout_secs"),
    flag("--cb-window-duration-secs", path="breaker.window_secs",
         help="failures count toward --cb-failure-threshold only within this long of the first"),
    flag("--disable-circuit-breaker", path="breaker.enabled"),
    # retries
    flag("--retry-max-retries", path="retry.max_retries"),
    flag("--retry-initial-backoff-ms", path="retry.initial_backoff_ms"),
    flag("--retry-max-backoff-ms", path="retry.max_backoff_ms"),
    flag("--retry-backoff-multiplier", path="retry.backoff_multiplier"),
    flag("--retry-jitter-factor", path="retry.jitter_factor"),
    flag("--disable-retries", path="retry.enabled"),
    flag("--no-retry-aborted", path="retry.retry_aborted",
         help="do not re-send requests the router aborted for a conversion"),
    # admission
    flag("--max-concurrent-requests", path="admission.max_concurrent_requests",
         help="0 or -1 (the peers' default): unbounded"),
    flag("--rate-limit-tokens-per-second", path="admission.rate_limit_tokens_per_second",
         help="admit at most this many new requests per second, bursting up to --max-concurrent-requests; "
              "beyond: 429 with Retry-After; default: no limit"),
    flag("--queue-size", path="admission.queue_size"),
    flag("--queue-timeout-secs", path="admission.queue_timeout_secs"),
    # SMG's PD admission (docs/guides/reliability.md: Limits)
    flag("--prefill-max-inflight-requests-per-worker", path="pd_admission.prefill_max_inflight_requests_per_worker",
         help="at most this many requests on each prefill, the rest wait in one FIFO queue; <= 0: no bound"),
    flag("--prefill-queue-size", path="pd_admission.prefill_queue_size",
         help="requests waiting for a prefill below its bound: 429 beyond (default 100; 0: none wait)"),
    flag("--prefill-queue-timeout-secs", path="pd_admission.prefill_queue_timeout_secs",
         help="the longest wait for a prefill below its bound: 429 after (default 60)"),
    flag("--pd-admission-wait-secs", path="pd_admission.pd_admission_wait_secs",
         help="wait this long for a decode below its running window (its max_running_requests), then 503; "
              "0: 503 at once; default: no such gate"),
    flag("--max-payload-size", path="admission.max_payload_size", help="bytes"),
    flag("--max-admin-payload-size", path="admission.max_admin_payload_size",
         help="bytes; the bound of admin calls' bodies (but /update_weights_from_tensor's: --max-payload-size)"),
    flag("--max-n", path="admission.max_n", help="the largest n (parallel samples) a request may ask for: 400 beyond. Default 1: SGLang "
         "0.5.23 does not serve n > 1 across a prefill/decode pair (its decode waits for a warm-up's KV)"),
    flag("--max-batch-size", path="admission.max_batch_size",
         help="the most sequences (prompts x n) one request may ask for: 400 beyond"),
    # flows
    flag("--drain-timeout-secs"),
    flag("--switch-timeout-secs"),
    flag("--weight-update-timeout-secs"),
    flag("--abort-timeout-secs",
         help="how long an abort, pause or weight update waits for the aborted requests to end"),
    flag("--weight-update-retry-aborted",
         help="re-send requests a weight update aborted before their first token (default: abort answer)"),
    flag("--no-inject-rid", path="inject_rid", help="do not add a router-made rid to requests without one"),
    # replicas sharing one fleet through etcd (docs/CLUSTER.md)
    flag("--etcd-endpoints", path="cluster.etcd_endpoints",
         help="etcd client URLs: router replicas started with the same --cluster-name share one fleet through "
              "this etcd (membership, roles, holds, operations); without it the router runs alone"),
    flag("--cluster-name", path="cluster.name", help="the fleet's name in etcd (keys under /pd-router/NAME/v1/)"),
    flag("--etcd-lease-ttl-secs", path="cluster.lease_ttl_secs",
         help="a replica's lease: its membership and the operations it runs outlive it by at most this long"),
    # OpenTelemetry traces (SGLang's and sgl-router's flags; docs/guides/observability.md: Traces)
    flag("--enable-trace", path="trace.enabled",
         help="export a span per request (and per leg, conversion, fleet operation) over OTLP, and send each leg "
              "its traceparent so SGLang's own spans join the trace (needs pip install 'pd-router[trace]')"),
    flag("--otlp-traces-endpoint", path="trace.otlp_traces_endpoint",
         help="the OTLP collector: host:port for grpc, its URL for http/protobuf"),
    flag("--otlp-traces-protocol", path="trace.protocol", env="OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
         choices=("grpc", "http/protobuf"), help="the OTLP transport (default: grpc)"),
    flag("--otlp-service-name", path="trace.service_name", env="OTEL_SERVICE_NAME",
         help="service.name of the router's spans (default: pd-router)"),
    # process
    flag("--shutdown-grace-secs", "--shutdown-grace-period-secs",
         help="SIGTERM/SIGINT: stop accepting, let requests finish, abort what is left and exit 0 within this "
              "many seconds (a second signal aborts at once, a third exits at once)"),
    # SMG's RL control plane (/v1/rl)
    flag("--rl-control-timeout-secs", help="deadline of one engine call relayed through /v1/rl"),
    flag("--rl-fanout-concurrency", help="engine calls in flight in one /v1/rl fan-out"),
    # several router processes on this host (router/server/supervisor.py)
    flag("--replicas",
         help="router processes on this host serving one port (SO_REUSEPORT), started and restarted by this "
              "one; more than 1 makes them replicas of one cluster (docs/CLUSTER.md)"),
    flag("--etcd-data-dir",
         help="with --replicas N and no --etcd-endpoints: the data directory of the private etcd this process "
              "starts; without it, a temporary directory removed at exit"),
]
FLAGS = SETTING_FLAGS + POLICY_FLAGS


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pd-router",
        usage="%(prog)s --prefill URL [PORT] ... --decode URL ... [options]",
        # the pointer to ctl goes here, not in an epilog: an epilog would run on after the last option's help
        description="Router for SGLang prefill/decode disaggregation (drop-in for mini_lb). To see and act on "
                    "a running router: pd-router ctl --help",
        formatter_class=GroupedHelpFormatter,
    )
    sections = add_sections(p)

    def add(*names: str, **options) -> None:
        (sections.get(section_of(names[0])) or p).add_argument(*names, **options)

    # mini_lb / sglang_router forms
    add("--prefill", action="append", nargs="+", default=[], metavar="URL [PORT]",
        help="prefill server URL, optionally followed by its bootstrap port (or 'none'); repeatable")
    add("--decode", action="append", nargs="+", default=[], metavar="URL", help="decode server URL(s); repeatable")
    add("--prefill-bootstrap-ports", nargs="+", default=None, metavar="PORT",
        help="bootstrap ports: one for every prefill, or one per prefill URL ('none' allowed)")
    add("--pd-disaggregation", action="store_true", help="accepted for compatibility (always on)")
    add("--mini-lb", action="store_true", help="accepted for compatibility")
    add("--enable-rl", action="store_true",
        help="accepted for compatibility with SMG (pd-router always serves its RL control plane, /v1/rl)")
    names = ", ".join(sorted(available_policies()))
    add("--policy", default=None,
        help=f"policy for both pools: {names}; po2 and rr are short names (default: {DEFAULTS.prefill_policy})")
    add("--prefill-policy", default=None, help="the prefill pool's policy; overrides --policy")
    add("--decode-policy", default=None, help="the decode pool's policy; overrides --policy")
    add("--remove-unhealthy-workers", "--worker-auto-recovery", dest="remove_unhealthy_workers", default=None,
        action=argparse.BooleanOptionalAction,
        help="remove a worker its probes declare down, so that its worker source registers it again once its "
             "server answers (SMG's); --no-... (the default): hold it out and probe it until it answers")
    add_flags(p, FLAGS, lambda row: sections.get(section_of(row.names[0], row)))
    add_peer_flags(p)
    add_retired_flags(p)
    return p


def _policy(name: str | None) -> str | None:
    return POLICY_ALIASES.get(name, name) if name else None


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

    both = _policy(args.policy)
    prefill_policy = _policy(args.prefill_policy) or both or DEFAULTS.prefill_policy
    decode_policy = _policy(args.decode_policy) or both or DEFAULTS.decode_policy
    names = available_policies()
    for leg, name in (("prefill", prefill_policy), ("decode", decode_policy)):
        if name not in names:
            problems.append(f"unknown {leg} policy {name!r}; choose from {', '.join(sorted(names))}")

    config = config_with_flags(DEFAULTS, FLAGS, args, env).with_(
        prefill=tuple(WorkerSpec(url, port) for url, port in prefills),
        decode=tuple(WorkerSpec(url, None) for url in decodes),
        prefill_policy=prefill_policy,
        decode_policy=decode_policy,
        compat_warnings=tuple(w for w in (ignored_warning(tuple(getattr(args, IGNORED_DEST))),
                                          retired_warning(getattr(args, RETIRED_DEST))) if w),
    )
    if args.remove_unhealthy_workers is not None:
        config = config.with_(health=config.health.with_(remove_unhealthy=args.remove_unhealthy_workers))
    if config.log_level == "warn":
        config = config.with_(log_level="warning")
    problems.extend(config.problems())
    if problems:
        raise ConfigError(problems)
    return config
