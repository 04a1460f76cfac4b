"""The sections of `pd-router --help` (and of the generated command-line reference): which flag goes where.

A config row goes by its field's group (`rebalance.*` -> the autopilot), so a field added to a config
dataclass lands in its section without being listed here; the top-level fields and the launch forms' flags
are named one by one. A flag that matches nothing is shown under argparse's own "options" heading, which a
test keeps down to `-h`.
"""

from __future__ import annotations

import argparse

from router.server.cli_flags import Flag

PROCESS = "the router process"
WORKERS = "workers"
DISCOVERY = "worker discovery"
KUBERNETES = "Kubernetes pod discovery"
HEALTH = "health, circuit breaker and retries"
ROUTING = "routing and policies"
POLICY_TUNING = "policy parameters"
CACHE_AWARE_TUNING = "policy parameters: cache_aware"
CONVERSION = "conversion"
AUTOPILOT = "the autopilot"
AUTOPILOT_BOUNDS = "the autopilot's bounds"
RL = "weight updates and RL"
REPLICAS = "replicas and etcd"
SECURITY = "security: keys"
NETWORK_SECURITY = "security: networks and TLS"
OBSERVABILITY = "observability"
CONNECTIONS = "connections to the workers"
CLIENT_CONNECTIONS = "client connections"
ADMISSION = "admission and limits"
PEERS = "peer compatibility"

# (title, what the section is for), in the order --help shows them
SECTIONS: tuple[tuple[str, str], ...] = (
    (PROCESS, "where the router listens and how it stops"),
    (WORKERS, "the prefill and decode servers on the command line (the API adds and removes them too)"),
    (DISCOVERY, "workers listed in a watched file or announced in etcd"),
    (KUBERNETES, "workers found as Kubernetes pods by label selectors (sgl-router's and SMG's flags)"),
    (HEALTH, "when a worker is taken out of routing and when a request is tried again"),
    (ROUTING, "which server each leg of a request goes to"),
    (CACHE_AWARE_TUNING, "the prefix tree and the load balance of the cache_aware policy"),
    (POLICY_TUNING, "the knobs of the other policies (power_of_two, least_load, prefix_hash, manual, bucket) and "
                    "of sticky routing keys"),
    (CONVERSION, "moving a server between prefill and decode (pd-router ctl convert, the autopilot)"),
    (AUTOPILOT, "the rebalancer: converts servers when its fleet model predicts a better split for the SLOs"),
    (AUTOPILOT_BOUNDS, "what the rebalancer may never do, and how it empties a server"),
    (RL, "fleet-wide abort, pause and weight updates, and SMG's /v1/rl control plane"),
    (REPLICAS, "several router processes sharing one fleet"),
    (SECURITY, "who may call what: Bearer keys for clients, admins, the control plane and the workers"),
    (NETWORK_SECURITY, "who may connect and register: allowed networks, CORS, TLS to clients and to workers"),
    (OBSERVABILITY, "metrics, logs and traces"),
    (CONNECTIONS, "deadlines of requests and of the legs to the servers, connection bounds, upstream pools"),
    (CLIENT_CONNECTIONS, "how long a client's connection may idle or stall, and SSE keep-alives"),
    (ADMISSION, "how many requests get in, how big they may be"),
    (PEERS, "accepted so that mini_lb's, sgl-router's and SMG's command lines start unchanged (the peers' flags "
            "pd-router refuses or ignores are not listed: see the peers' reference)"),
)

# a config row's field group -> its section
BY_FIELD_GROUP = {
    "worker_sources": DISCOVERY,
    "health": HEALTH, "breaker": HEALTH, "retry": HEALTH,
    "policy_params": POLICY_TUNING, "load_monitor": ROUTING, "dp_ranks": ROUTING,
    "rebalance": AUTOPILOT,
    "cluster": REPLICAS,
    "trace": OBSERVABILITY,
    "connections": CONNECTIONS,
    "admission": ADMISSION, "pd_admission": ADMISSION,
}

# a flag by its first name -> its section (top-level config fields and the launch forms' flags)
BY_FLAG = {
    "--host": PROCESS, "--port": PROCESS, "--shutdown-grace-secs": PROCESS,
    "--prefill": WORKERS, "--decode": WORKERS, "--prefill-bootstrap-ports": WORKERS,
    "--worker-startup-timeout-secs": WORKERS, "--worker-startup-check-interval": WORKERS,
    "--remove-unhealthy-workers": HEALTH,
    "--policy": ROUTING, "--prefill-policy": ROUTING, "--decode-policy": ROUTING, "--no-inject-rid": ROUTING,
    "--drain-timeout-secs": CONVERSION, "--switch-timeout-secs": CONVERSION, "--no-retry-aborted": CONVERSION,
    "--weight-update-timeout-secs": RL, "--abort-timeout-secs": RL, "--weight-update-retry-aborted": RL,
    "--rl-control-timeout-secs": RL, "--rl-fanout-concurrency": RL,
    "--replicas": REPLICAS, "--etcd-data-dir": REPLICAS,
    "--api-key": SECURITY, "--admin-api-key": SECURITY, "--control-plane-api-keys": SECURITY,
    "--control-plane-audit-enabled": SECURITY, "--worker-api-key": SECURITY,
    "--cors-allowed-origins": NETWORK_SECURITY, "--admin-allow-cidrs": NETWORK_SECURITY,
    "--worker-allow": NETWORK_SECURITY, "--tls-cert-path": NETWORK_SECURITY, "--tls-key-path": NETWORK_SECURITY,
    "--client-cert-path": NETWORK_SECURITY, "--client-key-path": NETWORK_SECURITY,
    "--ca-cert-paths": NETWORK_SECURITY,
    "--service-discovery": KUBERNETES, "--prefill-selector": KUBERNETES, "--decode-selector": KUBERNETES,
    "--selector": KUBERNETES, "--service-discovery-port": KUBERNETES, "--service-discovery-namespace": KUBERNETES,
    "--bootstrap-port-annotation": KUBERNETES,
    "--header-read-timeout-secs": CLIENT_CONNECTIONS, "--idle-connection-timeout-secs": CLIENT_CONNECTIONS,
    "--stream-body-stall-timeout-secs": CLIENT_CONNECTIONS, "--sse-keepalive-secs": CLIENT_CONNECTIONS,
    "--cache-threshold": CACHE_AWARE_TUNING, "--balance-abs-threshold": CACHE_AWARE_TUNING,
    "--balance-rel-threshold": CACHE_AWARE_TUNING, "--max-tree-size": CACHE_AWARE_TUNING,
    "--eviction-interval-secs": CACHE_AWARE_TUNING, "--prefix-chunk-chars": CACHE_AWARE_TUNING,
    "--rebalance-failure-cooldown-secs": AUTOPILOT_BOUNDS, "--rebalance-min-prefill": AUTOPILOT_BOUNDS,
    "--rebalance-min-decode": AUTOPILOT_BOUNDS, "--rebalance-min-samples": AUTOPILOT_BOUNDS,
    "--rebalance-conversion-mode": AUTOPILOT_BOUNDS, "--rebalance-refill-empty-pool": AUTOPILOT_BOUNDS,
    "--prometheus-port": OBSERVABILITY, "--prometheus-host": OBSERVABILITY,
    "--prometheus-duration-buckets": OBSERVABILITY, "--log-level": OBSERVABILITY, "--log-json": OBSERVABILITY,
    "--log-dir": OBSERVABILITY, "--request-id-headers": OBSERVABILITY,
    "--timeout": CONNECTIONS, "--connect-timeout-secs": CONNECTIONS, "--upstream-idle-timeout-secs": CONNECTIONS,
    "--max-connections": CONNECTIONS, "--max-connections-per-worker": CONNECTIONS,
    "--pd-disaggregation": PEERS, "--mini-lb": PEERS, "--enable-rl": PEERS,
}


def section_of(first_name: str, row: Flag | None = None) -> str | None:
    """The section a flag belongs to (None: none, argparse's "options")."""
    if first_name in BY_FLAG:
        return BY_FLAG[first_name]
    if row is not None and "." in row.path:
        return BY_FIELD_GROUP.get(row.path.split(".", 1)[0])
    return None


def add_sections(parser: argparse.ArgumentParser) -> dict[str, argparse._ArgumentGroup]:
    return {title: parser.add_argument_group(title, description) for title, description in SECTIONS}


class GroupedHelpFormatter(argparse.HelpFormatter):
    """One name per option: the first; the others (the peers' spellings, a --no- form) go into its help as
    "also ...", before the default, so that each option is one entry however many names it answers to."""

    def __init__(self, prog: str, **kwargs) -> None:
        kwargs.setdefault("max_help_position", 40)
        super().__init__(prog, **kwargs)

    def _format_action_invocation(self, action: argparse.Action) -> str:
        if not action.option_strings:
            return super()._format_action_invocation(action)
        first = action.option_strings[0]
        if action.nargs == 0:
            return first
        return f"{first} {self._format_args(action, self._get_default_metavar_for_optional(action))}"

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return with_other_names(action.help, action.option_strings)


def with_other_names(help_text: str | None, names: list[str] | tuple[str, ...]) -> str | None:
    """`help_text` with "(also --x, --y)" before its "(default: ...)"; unchanged for a one-name option."""
    others = [name for name in names[1:] if name != "-h"]
    if not others or help_text in (None, argparse.SUPPRESS):
        return help_text
    also = "(also " + ", ".join(others) + ")"
    body, marker, default = help_text.rpartition(" (default: ")
    if marker:
        return f"{body} {also}{marker}{default}"
    if help_text.startswith("(default: "):
        return f"{also} {help_text}"
    return f"{help_text} {also}"
