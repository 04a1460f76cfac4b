"""Frozen configuration: every knob, its default and its rules, in one pydantic model (core/config_model.py:
unknown keys refused, every problem reported at once, each naming its flag)."""

import ipaddress
from dataclasses import dataclass
from typing import Annotated
from urllib.parse import urlsplit

from pydantic import Field, InstanceOf, ValidationInfo, field_validator

from policies.params import PolicyParams
from policies.rebalance import RebalanceConfig
from router.core.allowlists import is_host_pattern, parse_network
# Callers import the groups, DP_RANK_POLICIES, selector_labels and ConfigError from here, with RouterConfig.
from router.core.config_groups import (DP_RANK_POLICIES, AdmissionConfig, BreakerConfig, ClusterConfig,  # noqa: F401
                                       ConnectionTimeouts, DpRanksConfig, HealthConfig, LoadMonitorConfig,
                                       PdAdmissionConfig, RetryConfig, TraceConfig, WorkerSourcesConfig,
                                       selector_labels, validate_port)
from router.core.config_model import (FAILED, ConfigError, ConfigModel, checked_by, earlier,  # noqa: F401
                                      refuse, rule)
from router.core.router_identity import is_own_address, literal_addresses
from router.core.worker_url import identity, parse_worker_url, worker_url_problem

# A prefill whose bootstrap port was not given: ask the server (`disaggregation_bootstrap_port`).
DISCOVER = "discover"


def validate_worker_url(url: object) -> str | None:
    """Return a problem description, or None when the URL is a usable worker address (core/worker_url.py)."""
    return worker_url_problem(url)


def is_loopback(host: str | None) -> bool:
    """Whether listening on `host` keeps the router to this machine (an empty host means every interface)."""
    if not host:
        return False
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name: it may be any interface


class WorkerSpec(ConfigModel):
    """A command-line worker; its URL and port are checked by RouterConfig, whose messages name the role's flag."""

    url: str
    # An int, None (decode uses its own default), or DISCOVER (ask the server).
    bootstrap_port: int | None | str = None


def _is_origin(origin: str) -> bool:
    parts = urlsplit(origin.rstrip("/"))
    return parts.scheme in ("http", "https") and bool(parts.hostname) and not parts.path and not parts.query


@dataclass(frozen=True, slots=True)
class ControlPlaneKey:
    id: str
    name: str
    role: str  # admin | user
    key: str

    def __repr__(self) -> str:  # never the key
        return f"ControlPlaneKey(id={self.id!r}, name={self.name!r}, role={self.role!r})"


def _positive(name: str):
    return rule(lambda value: value > 0, f"{name} must be positive")


def _control_plane_key(entry: str) -> ControlPlaneKey | None:
    parts = entry.split(":", 3)
    if len(parts) == 4 and parts[0] and parts[3] and parts[2].lower() in ("admin", "user"):
        return ControlPlaneKey(parts[0], parts[1], parts[2].lower(), parts[3])
    return None


def _control_plane_key_problems(entries: tuple[str, ...]) -> list[str]:
    bad = sum(_control_plane_key(entry) is None for entry in entries)
    return [f"--control-plane-api-keys: each entry is id:name:role:key with role admin or user ({bad} not)"
            ] if bad else []


def _increasing(buckets: tuple[float, ...]) -> bool:
    return all(0 < b < float("inf") for b in buckets) and all(a < b for a, b in zip(buckets, buckets[1:]))


def _is_header_name(name: str) -> bool:
    return bool(name) and all(c.isalnum() or c in "!#$%&'*+-.^_`|~" for c in name)


class RouterConfig(ConfigModel):
    """Every knob of a router. The rules over several fields sit on the last of them (config_model.py)."""

    prefill: tuple[WorkerSpec, ...] = ()
    decode: tuple[WorkerSpec, ...] = ()
    host: str = "0.0.0.0"
    port: int = 30000
    request_timeout_secs: Annotated[float, _positive("request_timeout_secs")] = 1800.0
    connect_timeout_secs: Annotated[float, _positive("connect_timeout_secs")] = 10.0
    worker_startup_timeout_secs: float = 10.0
    # How often a worker not read yet (pending: down, starting) is read again; None: --health-check-interval-secs
    # (sgl-router's and SMG's --worker-startup-check-interval, their default 30 s).
    worker_startup_check_interval_secs: Annotated[float | None, rule(
        lambda value: value is None or value > 0, "--worker-startup-check-interval must be positive")] = None
    prefill_policy: str = "random"
    decode_policy: str = "random"
    api_key: str | None = None
    admin_api_key: str | None = None
    # SMG's --control-plane-api-keys: "id:name:role:key" entries (role admin or user; see api/access.py).
    control_plane_api_keys: Annotated[tuple[str, ...], checked_by(_control_plane_key_problems)] = ()
    # One log line per admin call (router.audit): who (the key's id), what, from where, the outcome.
    control_plane_audit_enabled: bool = False
    # Admin callers allowed by source network, and the hosts/networks registered workers may point to (see
    # core/allowlists.py); empty: anyone, anywhere (mini_lb's behaviour).
    admin_allow_cidrs: Annotated[tuple[str, ...], checked_by(lambda entries: [
        f"--admin-allow-cidrs: {entry!r} is not a network (CIDR) or an address"
        for entry in entries if parse_network(entry) is None])] = ()
    worker_allow: Annotated[tuple[str, ...], checked_by(lambda entries: [
        f"--worker-allow: {entry!r} is neither a network (CIDR), an address, a host name nor a .domain"
        for entry in entries if parse_network(entry) is None and not is_host_pattern(entry)])] = ()
    # Sent as `Authorization: Bearer KEY` on every call to the workers (SGLang's --api-key), both legs and
    # the control plane; without it a client's Authorization header is passed through on the legs.
    worker_api_key: str | None = None
    max_connections: Annotated[int, rule(lambda value: value >= 1, "--max-connections must be at least 1")] = 8192
    # This router's legs on one server at once (the rest wait in its leg queue); 0: no bound but the total.
    max_connections_per_worker: Annotated[int, rule(
        lambda value: value >= 0, "--max-connections-per-worker must not be negative (0: no bound per worker)")] = 4096
    log_level: str = "info"
    log_json: bool = False  # one JSON object per log line
    # Serve HTTPS with this certificate (chain) and key (sgl-router's, SMG's --tls-cert-path/--tls-key-path)
    tls_cert_path: str | None = None
    tls_key_path: str | None = None
    # TLS toward https:// workers (the peers' flags; core/worker_tls.py): a client certificate and its key
    # presented to workers that ask (mTLS), CA bundles trusted besides the system's store.
    client_cert_path: str | None = None
    client_key_path: str | None = None
    ca_cert_paths: tuple[str, ...] = ()
    log_dir: str | None = None  # the log lines also go to a file there (obs/logs.py: log_file_name)
    # The headers a request id is read from, first present wins, echoed back (obs/logs.py); empty: X-Request-Id
    request_id_headers: Annotated[tuple[str, ...], checked_by(lambda names: [
        f"--request-id-headers: {name!r} is not an HTTP header name" for name in names
        if not _is_header_name(name)])] = ()
    # Browsers on these origins may call the router ("*": any; api/cors.py); empty: no CORS headers.
    cors_allowed_origins: Annotated[tuple[str, ...], checked_by(lambda origins: [
        f"--cors-allowed-origins: {origin!r} is not an origin (scheme://host[:port], or *)" for origin in origins
        if origin != "*" and not _is_origin(origin)])] = ()
    prometheus_port: int | None = None
    prometheus_host: str | None = None
    # The bounds of pd_router_request_duration_seconds, seconds, increasing (empty: obs/metrics.py's)
    prometheus_duration_buckets: Annotated[tuple[float, ...], checked_by(lambda buckets: [
        f"--prometheus-duration-buckets must be positive, finite and increasing, got {list(buckets)}"]
        if not _increasing(buckets) else [])] = ()
    health: HealthConfig = Field(default_factory=HealthConfig)
    breaker: BreakerConfig = Field(default_factory=BreakerConfig)
    retry: RetryConfig = Field(default_factory=RetryConfig)
    admission: AdmissionConfig = Field(default_factory=AdmissionConfig)
    # The policies' and the rebalancer's own frozen dataclasses (policies/), checked by their problems()
    policy_params: Annotated[InstanceOf[PolicyParams], checked_by(PolicyParams.problems)] = Field(
        default_factory=PolicyParams)
    load_monitor: LoadMonitorConfig = Field(default_factory=LoadMonitorConfig)
    dp_ranks: DpRanksConfig = Field(default_factory=DpRanksConfig)
    rebalance: Annotated[InstanceOf[RebalanceConfig], checked_by(RebalanceConfig.problems)] = Field(
        default_factory=RebalanceConfig)
    # Deadlines of the admin flows.
    drain_timeout_secs: Annotated[float, _positive("drain_timeout_secs")] = 300.0
    switch_timeout_secs: Annotated[float, _positive("switch_timeout_secs")] = 120.0
    weight_update_timeout_secs: Annotated[float, _positive("weight_update_timeout_secs")] = 600.0
    # An abort (endpoint, pause, weight update) waits this long for the aborted requests to end.
    abort_timeout_secs: Annotated[float, _positive("abort_timeout_secs")] = 30.0
    # Re-send requests a weight update aborted before their first token (else: SGLang's abort answer).
    weight_update_retry_aborted: bool = False
    # A leg whose server sends nothing for this long in the middle of its answer (after its head: a whole
    # answer's head comes only when it is ready) is cut, and a prefill leg still open this long after its
    # decode answered is cut too; 0: never. Longer than SGLang's own waits (PD bootstrap and KV transfer,
    # 300 s each, one after the other at worst); not counted while the fleet is paused in place.
    upstream_idle_timeout_secs: Annotated[float, rule(
        lambda value: value >= 0, "--upstream-idle-timeout-secs must not be negative (0: never)")] = 900.0
    connections: ConnectionTimeouts = Field(default_factory=ConnectionTimeouts)
    pd_admission: PdAdmissionConfig = Field(default_factory=PdAdmissionConfig)
    # Inject a router-made `rid` when the client gave none, so both legs can be aborted by id.
    inject_rid: bool = True
    # SIGTERM/SIGINT: the whole shutdown, from the signal to the exit (Kubernetes' default grace period). Requests
    # in flight finish until its last fifth (at most 5 s) is left; then what is left is aborted and answered.
    shutdown_grace_secs: Annotated[float, rule(lambda value: value >= 0,
                                               "--shutdown-grace-secs must not be negative")] = 30.0
    # SMG's RL control plane (/v1/rl): the deadline of one relayed engine call, and how many calls one
    # fan-out has in flight (SMG's flags and defaults; fleet operations run the flows and their deadlines).
    rl_control_timeout_secs: Annotated[float, _positive("rl_control_timeout_secs")] = 600.0
    rl_fanout_concurrency: Annotated[int, rule(lambda value: value >= 1,
                                               "--rl-fanout-concurrency must be at least 1")] = 32
    # Router replicas on this host: N processes serving one port (SO_REUSEPORT) under a supervising parent,
    # sharing the fleet through etcd (router/server/supervisor.py). 1: this process serves, alone.
    replicas: int = 1
    # `--replicas N` without --etcd-endpoints: where the private etcd keeps its data (default: a temporary
    # directory, removed at exit; given: the fleet's state outlives a restart of the whole group).
    etcd_data_dir: str | None = None
    worker_sources: WorkerSourcesConfig = Field(default_factory=WorkerSourcesConfig)
    # What the command line accepted for compatibility but does not act on (the peers' flags of parts pd-router
    # does not have: router/server/cli_peers.py), one line each: logged at start-up with the other warnings.
    compat_warnings: tuple[str, ...] = ()
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    trace: TraceConfig = Field(default_factory=TraceConfig)

    def control_plane_keys(self) -> tuple[ControlPlaneKey, ...]:
        """--control-plane-api-keys parsed (entries that do not parse are left out: problems() names them)."""
        return tuple(key for key in map(_control_plane_key, self.control_plane_api_keys) if key is not None)

    @field_validator("prefill", "decode")
    @classmethod
    def _workers_of_a_role(cls, specs: tuple[WorkerSpec, ...], info: ValidationInfo) -> tuple[WorkerSpec, ...]:
        role, found, seen = info.field_name, [], set()
        for spec in specs:
            if (problem := validate_worker_url(spec.url)) is not None:
                found.append(f"--{role}: {problem}")
            if identity(spec.url) in seen:
                found.append(f"--{role}: {identity(spec.url)} given twice")
            seen.add(identity(spec.url))
            if spec.bootstrap_port != DISCOVER and (problem := validate_port(spec.bootstrap_port)):
                found.append(f"--{role} {spec.url}: {problem}")
        if role == "decode" and (prefill := earlier(info, "prefill")) is not FAILED:
            found += [f"{url} is given as both prefill and decode"
                      for url in sorted({identity(s.url) for s in prefill} & seen)]
        if found:
            refuse(*found)
        return specs

    @field_validator("port")
    @classmethod
    def _a_port_no_worker_has(cls, port: int, info: ValidationInfo) -> int:
        if not 0 < port <= 65535:
            refuse(f"--port must be in 1..65535, got {port}")
        host = earlier(info, "host")
        found = [f"--{role} {identity(spec.url)} is this router itself (--host {host} --port {port}): a worker must "
                 "be a SGLang server"
                 for role in ("prefill", "decode") if (specs := earlier(info, role)) is not FAILED
                 for spec in specs if host is not FAILED and _is_router_at(spec.url, host, port)]
        if found:
            refuse(*found)
        return port

    @field_validator("tls_key_path", "client_key_path")
    @classmethod
    def _with_its_certificate(cls, key: str | None, info: ValidationInfo) -> str | None:
        cert = earlier(info, info.field_name.replace("_key_", "_cert_"))
        if cert is not FAILED and (cert is None) != (key is None):
            refuse("--tls-cert-path and --tls-key-path go together (HTTPS needs both)"
                   if info.field_name == "tls_key_path" else
                   "--client-cert-path and --client-key-path go together (mTLS toward the workers needs both)")
        return key

    @field_validator("replicas")
    @classmethod
    def _replicas_and_their_metrics_ports(cls, replicas: int, info: ValidationInfo) -> int:
        if replicas < 1:
            refuse(f"--replicas must be at least 1, got {replicas}")
        metrics, port = earlier(info, "prometheus_port"), earlier(info, "port")
        if replicas > 1 and metrics not in (None, FAILED) and port is not FAILED:
            # each replica serves its own /metrics on the next port: --prometheus-port + its index
            last = metrics + replicas - 1
            if last > 65535:
                refuse(f"--prometheus-port {metrics} with --replicas {replicas}: the replicas' metrics ports would "
                       f"reach {last} (> 65535)")
            if metrics <= port <= last:
                refuse(f"--prometheus-port {metrics} with --replicas {replicas}: the replicas' metrics ports "
                       f"{metrics}-{last} include --port {port}")
        return replicas

    @field_validator("etcd_data_dir")
    @classmethod
    def _only_for_a_private_etcd(cls, data_dir: str | None, info: ValidationInfo) -> str | None:
        replicas = earlier(info, "replicas")
        if data_dir is not None and replicas is not FAILED and replicas < 2:
            refuse("--etcd-data-dir is for the private etcd of --replicas N (N > 1)")
        return data_dir

    def warnings(self) -> list[str]:
        """What is unsafe but allowed (compatibility forbids refusing it): logged at start-up, shown by
        GET /admin/health."""
        found = list(self.compat_warnings)
        if self.health.remove_unhealthy and not (self.worker_sources.file or self.worker_sources.etcd_endpoints):
            found.append("--remove-unhealthy-workers without a worker source (--discovery-file, "
                         "--discovery-etcd-endpoints): a worker found down is removed for good (nothing registers "
                         "it again); without the flag it is held out and comes back when it answers")
        if self.api_key or self.admin_api_key or is_loopback(self.host):
            return found
        where = f"{self.host or '0.0.0.0'}:{self.port}"
        callers = (f"any caller from {', '.join(self.admin_allow_cidrs)}" if self.admin_allow_cidrs
                   else f"anyone who can reach {where}")
        workers = (f"a worker URL on {', '.join(self.worker_allow)}" if self.worker_allow
                   else "a worker URL pointing anywhere (users' prompts then go there)")
        return found + [f"admin routes need no key and are open to {callers}: they can register {workers}, update "
                        f"weights, release memory, abort requests. Set --admin-api-key (or --api-key), or "
                        f"--admin-allow-cidrs, --worker-allow, or --host 127.0.0.1"]


def _is_router_at(url: str, host: str, port: int) -> bool:
    """Whether a command-line worker is at this router's own address (an IP or localhost; names are found out when
    the worker is read: a pd-router answers as one, core/router_identity.py). False for a URL that is no worker's."""
    if worker_url_problem(url) is not None:
        return False
    parsed = parse_worker_url(url)
    addresses = literal_addresses(parsed.host)
    listening = literal_addresses(host) if host else None
    return addresses is not None and is_own_address(addresses, parsed.port, host, port, listening)
