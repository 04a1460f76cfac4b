"""Frozen configuration: every knob, its default and its validation, in one place."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field, fields, replace
from urllib.parse import urlsplit

from policies.params import PolicyParams
from policies.rebalance import RebalanceConfig
from router.core.allowlists import CallerAllowList, WorkerAllowList
from router.core.router_identity import is_own_address, literal_addresses
from router.core.tracing import missing_packages
from router.core.worker_url import identity, parse_worker_url, worker_url_problem

# A prefill whose bootstrap port was not given: ask the server (`disaggregation_bootstrap_port`).
DISCOVER = "discover"


class ConfigError(ValueError):
    """Every problem found, reported at once."""

    def __init__(self, problems: list[str]):
        super().__init__("; ".join(problems))
        self.problems = problems


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


def validate_port(value: object, what: str = "bootstrap_port") -> str | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        return f"{what} must be an integer in 1..65535 or null, got {value!r}"
    return None


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    url: str
    # An int, None (decode uses its own default), or DISCOVER (ask the server).
    bootstrap_port: int | None | str = None


@dataclass(frozen=True, slots=True)
class HealthConfig:
    interval_secs: float = 5.0
    timeout_secs: float = 5.0
    failure_threshold: int = 3
    success_threshold: int = 2
    endpoint: str = "/health"
    enabled: bool = True
    # SMG's --remove-unhealthy-workers / --worker-auto-recovery: a worker the probes declare down is removed, and
    # its worker source registers it again once its server answers. Off (SMG: on under service discovery), it is
    # held out and probed, and comes back by itself when it answers (its live state read again): no churn.
    remove_unhealthy: bool = False


@dataclass(frozen=True, slots=True)
class BreakerConfig:
    failure_threshold: int = 10
    success_threshold: int = 3
    timeout_secs: float = 30.0
    enabled: bool = True
    # Failures in a row count toward the threshold only within this long of the first (sgl-router's and SMG's
    # --cb-window-duration-secs): a fault now and then never opens the breaker.
    window_secs: float = 120.0


@dataclass(frozen=True, slots=True)
class RetryConfig:
    max_retries: int = 3
    initial_backoff_ms: float = 50
    max_backoff_ms: float = 2000
    backoff_multiplier: float = 2.0
    jitter_factor: float = 0.2
    enabled: bool = True
    # Re-send requests that the router itself aborted (conversion in abort mode, weight update) before the
    # client saw a token (a whole non-streaming answer, or a stream before its first token), so that the
    # client sees a normal answer.
    retry_aborted: bool = True


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    max_concurrent_requests: int = 0  # 0 or -1 (sgl-router's and SMG's default): unbounded
    # New requests per second, bursting up to max_concurrent_requests (dataplane/admission.py); None: no limit
    rate_limit_tokens_per_second: int | None = None
    queue_size: int = 1024  # requests waiting for a slot or for a fleet-wide hold to end
    queue_timeout_secs: float = 60.0
    max_payload_size: int = 256 * 1024 * 1024
    # Admin calls' bodies are small JSON objects: a lower bound keeps an anonymous caller (admin routes are open
    # without a key) from making the router buffer and parse 256 MiB. /update_weights_from_tensor, whose body
    # carries serialized tensors, keeps max_payload_size.
    max_admin_payload_size: int = 1024 * 1024
    # What one generation request may ask for, checked before anything is done per sequence: n (parallel
    # samples) and sequences (prompts x n: the batch SGLang runs, one bootstrap room each). SGLang, sgl-router
    # and SMG bound neither: 10^9 sequences would be built, then run. n is 1 by default: SGLang 0.5.23 does not
    # serve n > 1 across a prefill/decode pair (its decode server first runs a warm-up of the prompt and waits
    # for that warm-up's KV, which no prefill sends: a 500 after the KV timeout, whatever the router does), so
    # a client asking for it gets a 400 saying so; --max-n raises it for servers that serve it (OpenAI's 128).
    max_n: int = 1
    max_batch_size: int = 4096


@dataclass(frozen=True, slots=True)
class LoadMonitorConfig:
    """Polling of the servers' own load reports (for power_of_two, cache_aware and the rebalancer)."""

    enabled: bool = True
    interval_secs: float = 1.0
    timeout_secs: float = 2.0
    # SMG's --disable-load-monitoring: poll only when a policy or the rebalancer reads the reports.
    on_demand: bool = False

    def problems(self) -> list[str]:
        found = []
        if not self.interval_secs > 0:
            found.append(f"--load-poll-interval-secs must be positive, got {self.interval_secs}")
        if not self.timeout_secs > 0:
            found.append(f"--load-poll-timeout-secs must be positive, got {self.timeout_secs}")
        return found


DP_RANK_POLICIES = ("least_loaded", "round_robin", "random")


@dataclass(frozen=True, slots=True)
class DpRanksConfig:
    """`--dp-aware`: the router chooses each leg's data-parallel rank (docs/DP_RANKS.md)."""

    aware: bool = False
    prefill_policy: str = "least_loaded"
    decode_policy: str = "least_loaded"

    def problems(self) -> list[str]:
        return [f"--{leg}-dp-rank-policy must be one of {', '.join(DP_RANK_POLICIES)}, got {value!r}"
                for leg, value in (("prefill", self.prefill_policy), ("decode", self.decode_policy))
                if value not in DP_RANK_POLICIES]


@dataclass(frozen=True, slots=True)
class PdAdmissionConfig:
    """SMG's PD admission (dataplane/pd_admission.py): at most `prefill_max_inflight_requests_per_worker` requests
    on each prefill (<= 0: no bound), the rest waiting in one FIFO queue; with `pd_admission_wait_secs`, a
    request waits that long for a decode below its running window (`max_running_requests`), else 503."""

    prefill_max_inflight_requests_per_worker: int = -1
    prefill_queue_size: int | None = None  # None: 100 (SMG's) when the bound is on; 0: no waiting (429 at once)
    prefill_queue_timeout_secs: float | None = None  # None: 60 (SMG's)
    pd_admission_wait_secs: float | None = None  # None: no decode gate (SMG: 30); 0: shed at once

    @property
    def prefill_bounded(self) -> bool:
        return self.prefill_max_inflight_requests_per_worker > 0

    def problems(self) -> list[str]:
        found = []
        if not self.prefill_bounded and (self.prefill_queue_size is not None
                                         or self.prefill_queue_timeout_secs is not None):
            found.append("--prefill-queue-size and --prefill-queue-timeout-secs need "
                         "--prefill-max-inflight-requests-per-worker to be positive (as SMG's)")
        if self.prefill_queue_size is not None and self.prefill_queue_size < 0:
            found.append("--prefill-queue-size must not be negative (0: no waiting)")
        if self.prefill_queue_timeout_secs is not None and not self.prefill_queue_timeout_secs > 0:
            found.append("--prefill-queue-timeout-secs must be positive")
        if self.pd_admission_wait_secs is not None and self.pd_admission_wait_secs < 0:
            found.append("--pd-admission-wait-secs must not be negative (0: shed at once)")
        return found


@dataclass(frozen=True, slots=True)
class ConnectionTimeouts:
    """SMG's connection bounds, seconds; 0 turns each off (docs/guides/reliability.md: Limits)."""

    # Pooled connections to the workers (the legs' and the control plane's) idle this long are closed: below
    # SGLang's own keep-alive (uvicorn's 5 s), so that the router never reuses one the server is closing.
    upstream_pool_idle_timeout_secs: float = 4.0
    # A client connection must send a whole request head within this long of being accepted (a keep-alive one:
    # of its next head's first byte), else it is closed.
    header_read_timeout_secs: float = 30.0
    # A keep-alive client connection with no request in flight for this long is closed.
    idle_connection_timeout_secs: float = 90.0
    # A request body that stops arriving for this long: 408.
    stream_body_stall_timeout_secs: float = 300.0
    # An SSE comment on a client's stream after this much silence, before decode's first event too (0: none:
    # SGLang's own bench_serving, and mini_lb-style clients, parse every non-empty line as a data event).
    sse_keepalive_secs: float = 0.0

    def problems(self) -> list[str]:
        return [f"--{f.name.replace('_', '-')} must not be negative (0: off)" for f in fields(self)
                if not getattr(self, f.name) >= 0]


CLUSTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def etcd_endpoint_problems(flag: str, endpoints: tuple[str, ...]) -> list[str]:
    """What is wrong with etcd client URLs given to `flag` (each must be http(s)://host:port)."""
    found = []
    for endpoint in endpoints:
        try:
            parts = urlsplit(endpoint)
            parts.port  # noqa: B018 (raises on a bad port)
        except ValueError as exc:
            found.append(f"{flag}: invalid URL {endpoint!r}: {exc}")
            continue
        if parts.scheme not in ("http", "https") or not parts.hostname:
            found.append(f"{flag}: {endpoint!r} must be http(s)://host:port")
    return found


def selector_labels(items: tuple[str, ...]) -> tuple[dict[str, str], list[str]]:
    """`key=value` items (one argv item may hold several, space-separated as SMG's launcher allows, or
    comma-joined as kubectl's `-l` takes them: no label value holds a comma) as a label map, and the items that
    are not `key=value`."""
    labels: dict[str, str] = {}
    bad: list[str] = []
    for token in " ".join(items).replace(",", " ").split():
        key, sep, value = token.partition("=")
        if not sep or not key:
            bad.append(token)
        else:
            labels[key] = value
    return labels, bad


@dataclass(frozen=True, slots=True)
class WorkerSourcesConfig:
    """Workers listed outside the command line and the API (router/control/worker_sources.py)."""

    file: str | None = None  # a YAML or JSON file of workers, polled
    provider: str | None = None  # SMG's --discovery-provider: "file" (the file above) or "kubernetes"
    file_interval_secs: float = 1.0
    # etcd keys that workers (or their sidecars) write under a lease: /pd-router/<name>/v1/discovery/<url>
    etcd_endpoints: tuple[str, ...] = ()
    etcd_cluster_name: str = "pd-router"
    # Kubernetes pod discovery (sgl-router's and SMG's flags; router/control/kubernetes_pods.py)
    service_discovery: bool = False  # SMG's other spelling: --discovery-provider kubernetes
    selector: tuple[str, ...] = ()  # key=value: pods whose server's live role names their pool
    prefill_selector: tuple[str, ...] = ()
    decode_selector: tuple[str, ...] = ()
    service_discovery_port: int = 80
    service_discovery_namespace: str | None = None  # None: every namespace
    bootstrap_port_annotation: str = "sglang.ai/bootstrap-port"

    @property
    def pod_discovery(self) -> bool:
        return self.service_discovery or self.provider == "kubernetes"

    def problems(self) -> list[str]:
        found = []
        if not self.file_interval_secs > 0:
            found.append(f"--discovery-file-interval-secs must be positive, got {self.file_interval_secs}")
        if self.file is not None and not self.file:
            found.append("--discovery-file must name a file")
        if self.provider == "file" and not self.file:
            found.append("--discovery-provider file needs --discovery-file")
        if self.provider == "file" and self.service_discovery:
            found.append("--service-discovery is --discovery-provider kubernetes: give one provider")
        for flag_name, items in (("--selector", self.selector), ("--prefill-selector", self.prefill_selector),
                                 ("--decode-selector", self.decode_selector)):
            bad = selector_labels(items)[1]
            if bad:
                found.append(f"{flag_name}: expected key=value, got {', '.join(map(repr, bad))}")
        if self.pod_discovery:
            if not (self.selector or self.prefill_selector or self.decode_selector):
                found.append("--service-discovery needs --prefill-selector and --decode-selector (or --selector: "
                             "the pods' servers say their role)")
            problem = validate_port(self.service_discovery_port, "--service-discovery-port")
            if problem is not None:
                found.append(problem.replace(" or null", ""))
            if not self.bootstrap_port_annotation:
                found.append("--bootstrap-port-annotation must name an annotation")
        elif self.selector or self.prefill_selector or self.decode_selector:
            found.append("--selector, --prefill-selector and --decode-selector need --service-discovery "
                         "(or --discovery-provider kubernetes)")
        found += etcd_endpoint_problems("--discovery-etcd-endpoints", self.etcd_endpoints)
        if not CLUSTER_NAME.fullmatch(self.etcd_cluster_name):
            found.append(f"--discovery-cluster-name must be letters, digits, '.', '_' or '-', "
                         f"got {self.etcd_cluster_name!r}")
        return found


@dataclass(frozen=True, slots=True)
class TraceConfig:
    """OpenTelemetry traces over OTLP (router/obs/otel_tracing.py): SGLang's and sgl-router's flags."""

    enabled: bool = False
    otlp_traces_endpoint: str = "localhost:4317"  # gRPC: host:port; http/protobuf: the collector's URL
    # OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, as SGLang reads it; None: grpc
    protocol: str | None = None
    service_name: str | None = None  # None: OTEL_SERVICE_NAME, else pd-router

    def problems(self) -> list[str]:
        found = []
        if self.enabled and self.protocol is not None and self.protocol not in ("grpc", "http/protobuf"):
            found.append(f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL must be grpc or http/protobuf (as SGLang's), got "
                         f"{self.protocol!r}")
        if self.enabled and not self.otlp_traces_endpoint.strip():
            found.append("--otlp-traces-endpoint must name the collector (host:port)")
        if self.enabled and (missing := missing_packages(self.protocol or "grpc")):
            found.append(missing)
        return found


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """Router replicas sharing one fleet through etcd (docs/CLUSTER.md). No endpoints: a lone router."""

    etcd_endpoints: tuple[str, ...] = ()
    name: str = "pd-router"  # the key prefix /pd-router/<name>/v1/: one fleet per name
    # A replica's keys (membership, the operations it runs) outlive it by at most this: the takeover delay.
    lease_ttl_secs: int = 5

    @property
    def enabled(self) -> bool:
        return bool(self.etcd_endpoints)

    def problems(self) -> list[str]:
        found = []
        found += etcd_endpoint_problems("--etcd-endpoints", self.etcd_endpoints)
        if not CLUSTER_NAME.fullmatch(self.name):
            found.append(f"--cluster-name must be letters, digits, '.', '_' or '-', got {self.name!r}")
        if not 2 <= self.lease_ttl_secs <= 300:
            found.append(f"--etcd-lease-ttl-secs must be in 2..300, got {self.lease_ttl_secs}")
        return found


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


@dataclass(frozen=True, slots=True)
class RouterConfig:
    prefill: tuple[WorkerSpec, ...] = ()
    decode: tuple[WorkerSpec, ...] = ()
    host: str = "0.0.0.0"
    port: int = 30000
    request_timeout_secs: float = 1800.0
    connect_timeout_secs: float = 10.0
    worker_startup_timeout_secs: float = 10.0
    # How often a worker not read yet (pending: down, starting) is read again; None: --health-check-interval-secs
    # (sgl-router's and SMG's --worker-startup-check-interval, their default 30 s).
    worker_startup_check_interval_secs: float | None = None
    prefill_policy: str = "random"
    decode_policy: str = "random"
    api_key: str | None = None
    admin_api_key: str | None = None
    # SMG's --control-plane-api-keys: "id:name:role:key" entries (role admin or user; see api/access.py).
    control_plane_api_keys: tuple[str, ...] = ()
    # One log line per admin call (router.audit): who (the key's id), what, from where, the outcome.
    control_plane_audit_enabled: bool = False
    # Admin callers allowed by source network, and the hosts/networks registered workers may point to (see
    # core/allowlists.py); empty: anyone, anywhere (mini_lb's behaviour).
    admin_allow_cidrs: tuple[str, ...] = ()
    worker_allow: tuple[str, ...] = ()
    # Sent as `Authorization: Bearer KEY` on every call to the workers (SGLang's --api-key), both legs and
    # the control plane; without it a client's Authorization header is passed through on the legs.
    worker_api_key: str | None = None
    max_connections: int = 8192
    # This router's legs on one server at once (the rest wait in its leg queue); 0: no bound but the total.
    max_connections_per_worker: int = 4096
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
    request_id_headers: tuple[str, ...] = ()
    # Browsers on these origins may call the router ("*": any; api/cors.py); empty: no CORS headers.
    cors_allowed_origins: tuple[str, ...] = ()
    prometheus_port: int | None = None
    prometheus_host: str | None = None
    # The bounds of pd_router_request_duration_seconds, seconds, increasing (empty: obs/metrics.py's)
    prometheus_duration_buckets: tuple[float, ...] = ()
    health: HealthConfig = field(default_factory=HealthConfig)
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    retry: RetryConfig = field(default_factory=RetryConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    policy_params: PolicyParams = field(default_factory=PolicyParams)
    load_monitor: LoadMonitorConfig = field(default_factory=LoadMonitorConfig)
    dp_ranks: DpRanksConfig = field(default_factory=DpRanksConfig)
    rebalance: RebalanceConfig = field(default_factory=RebalanceConfig)
    # Deadlines of the admin flows.
    drain_timeout_secs: float = 300.0
    switch_timeout_secs: float = 120.0
    weight_update_timeout_secs: float = 600.0
    # An abort (endpoint, pause, weight update) waits this long for the aborted requests to end.
    abort_timeout_secs: float = 30.0
    # Re-send requests a weight update aborted before their first token (else: SGLang's abort answer).
    weight_update_retry_aborted: bool = False
    # A leg whose server sends nothing for this long in the middle of its answer (after its head: a whole
    # answer's head comes only when it is ready) is cut, and a prefill leg still open this long after its
    # decode answered is cut too; 0: never. Longer than SGLang's own waits (PD bootstrap and KV transfer,
    # 300 s each, one after the other at worst); not counted while the fleet is paused in place.
    upstream_idle_timeout_secs: float = 900.0
    connections: ConnectionTimeouts = field(default_factory=ConnectionTimeouts)
    pd_admission: PdAdmissionConfig = field(default_factory=PdAdmissionConfig)
    # Inject a router-made `rid` when the client gave none, so both legs can be aborted by id.
    inject_rid: bool = True
    # SIGTERM/SIGINT: the whole shutdown, from the signal to the exit (Kubernetes' default grace period). Requests
    # in flight finish until its last fifth (at most 5 s) is left; then what is left is aborted and answered.
    shutdown_grace_secs: float = 30.0
    # SMG's RL control plane (/v1/rl): the deadline of one relayed engine call, and how many calls one
    # fan-out has in flight (SMG's flags and defaults; fleet operations run the flows and their deadlines).
    rl_control_timeout_secs: float = 600.0
    rl_fanout_concurrency: int = 32
    # Router replicas on this host: N processes serving one port (SO_REUSEPORT) under a supervising parent,
    # sharing the fleet through etcd (router/server/supervisor.py). 1: this process serves, alone.
    replicas: int = 1
    # `--replicas N` without --etcd-endpoints: where the private etcd keeps its data (default: a temporary
    # directory, removed at exit; given: the fleet's state outlives a restart of the whole group).
    etcd_data_dir: str | None = None
    worker_sources: WorkerSourcesConfig = field(default_factory=WorkerSourcesConfig)
    # What the command line accepted for compatibility but does not act on (the peers' flags of parts pd-router
    # does not have: router/server/cli_peers.py), one line each: logged at start-up with the other warnings.
    compat_warnings: tuple[str, ...] = ()
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    trace: TraceConfig = field(default_factory=TraceConfig)

    def with_(self, **changes) -> "RouterConfig":
        return replace(self, **changes)

    def control_plane_keys(self) -> tuple["ControlPlaneKey", ...]:
        """--control-plane-api-keys parsed (entries that do not parse are left out: problems() names them)."""
        out = []
        for entry in self.control_plane_api_keys:
            parts = entry.split(":", 3)
            if len(parts) == 4 and parts[0] and parts[3] and parts[2].lower() in ("admin", "user"):
                out.append(ControlPlaneKey(parts[0], parts[1], parts[2].lower(), parts[3]))
        return tuple(out)

    def problems(self) -> list[str]:
        found: list[str] = []
        parsed = len(self.control_plane_keys())
        if parsed != len(self.control_plane_api_keys):
            found.append("--control-plane-api-keys: each entry is id:name:role:key with role admin or user "
                         f"({len(self.control_plane_api_keys) - parsed} not)")
        for role, specs in (("prefill", self.prefill), ("decode", self.decode)):
            seen: set[str] = set()
            for spec in specs:
                if (problem := validate_worker_url(spec.url)) is not None:
                    found.append(f"--{role}: {problem}")
                elif self._is_this_router(spec.url):
                    found.append(f"--{role} {identity(spec.url)} is this router itself (--host {self.host} "
                                 f"--port {self.port}): a worker must be a SGLang server")
                if identity(spec.url) in seen:
                    found.append(f"--{role}: {identity(spec.url)} given twice")
                seen.add(identity(spec.url))
                if spec.bootstrap_port is not DISCOVER and (p := validate_port(spec.bootstrap_port)):
                    found.append(f"--{role} {spec.url}: {p}")
        both = {identity(s.url) for s in self.prefill} & {identity(s.url) for s in self.decode}
        for url in sorted(both):
            found.append(f"{url} is given as both prefill and decode")
        if not 0 < self.port <= 65535:
            found.append(f"--port must be in 1..65535, got {self.port}")
        for name in ("request_timeout_secs", "connect_timeout_secs", "drain_timeout_secs",
                     "switch_timeout_secs", "weight_update_timeout_secs", "abort_timeout_secs",
                     "rl_control_timeout_secs"):
            if getattr(self, name) <= 0:
                found.append(f"{name} must be positive")
        if (self.tls_cert_path is None) != (self.tls_key_path is None):
            found.append("--tls-cert-path and --tls-key-path go together (HTTPS needs both)")
        if (self.client_cert_path is None) != (self.client_key_path is None):
            found.append("--client-cert-path and --client-key-path go together (mTLS toward the workers needs both)")
        buckets = self.prometheus_duration_buckets
        if buckets and not (all(0 < b < float("inf") for b in buckets)
                            and all(a < b for a, b in zip(buckets, buckets[1:]))):
            found.append(f"--prometheus-duration-buckets must be positive, finite and increasing, got {list(buckets)}")
        if self.worker_startup_check_interval_secs is not None and not self.worker_startup_check_interval_secs > 0:
            found.append("--worker-startup-check-interval must be positive")
        if self.upstream_idle_timeout_secs < 0:
            found.append("--upstream-idle-timeout-secs must not be negative (0: never)")
        if self.shutdown_grace_secs < 0:
            found.append("--shutdown-grace-secs must not be negative")
        if self.max_connections < 1:
            found.append("--max-connections must be at least 1")
        if self.max_connections_per_worker < 0:
            found.append("--max-connections-per-worker must not be negative (0: no bound per worker)")
        if self.rl_fanout_concurrency < 1:
            found.append("--rl-fanout-concurrency must be at least 1")
        if self.replicas < 1:
            found.append(f"--replicas must be at least 1, got {self.replicas}")
        if self.etcd_data_dir is not None and self.replicas < 2:
            found.append("--etcd-data-dir is for the private etcd of --replicas N (N > 1)")
        if self.replicas > 1 and self.prometheus_port is not None:
            # each replica serves its own /metrics on the next port: --prometheus-port + its index
            last = self.prometheus_port + self.replicas - 1
            if last > 65535:
                found.append(f"--prometheus-port {self.prometheus_port} with --replicas {self.replicas}: the "
                             f"replicas' metrics ports would reach {last} (> 65535)")
            elif self.prometheus_port <= self.port <= last:
                found.append(f"--prometheus-port {self.prometheus_port} with --replicas {self.replicas}: the "
                             f"replicas' metrics ports {self.prometheus_port}-{last} include --port {self.port}")
        for group in (self.health, self.breaker, self.retry, self.admission):
            for f in fields(group):
                value = getattr(group, f.name)
                if f.name == "max_concurrent_requests" and value == -1:
                    continue  # the peers' "no limit"
                if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
                    found.append(f"{type(group).__name__}.{f.name} must not be negative")
        if self.admission.max_payload_size < 1:
            found.append("--max-payload-size must be at least 1")
        if self.admission.max_admin_payload_size < 1:
            found.append("--max-admin-payload-size must be at least 1")
        if self.admission.rate_limit_tokens_per_second is not None and self.admission.rate_limit_tokens_per_second < 1:
            found.append("--rate-limit-tokens-per-second must be at least 1 (leave it out for no limit)")
        if self.admission.max_n < 1:
            found.append(f"--max-n must be at least 1, got {self.admission.max_n}")
        if self.admission.max_batch_size < 1:
            found.append(f"--max-batch-size must be at least 1, got {self.admission.max_batch_size}")
        for group in (self.policy_params, self.load_monitor, self.dp_ranks, self.rebalance, self.worker_sources,
                      self.cluster, self.trace, self.connections, self.pd_admission):
            found.extend(group.problems())
        found.extend(f"--request-id-headers: {name!r} is not an HTTP header name" for name in self.request_id_headers
                     if not name or not all(c.isalnum() or c in "!#$%&'*+-.^_`|~" for c in name))
        found.extend(f"--cors-allowed-origins: {origin!r} is not an origin (scheme://host[:port], or *)"
                     for origin in self.cors_allowed_origins if origin != "*" and not _is_origin(origin))
        found.extend(CallerAllowList.problems(self.admin_allow_cidrs))
        found.extend(WorkerAllowList.problems(self.worker_allow))
        return found

    def _is_this_router(self, url: str) -> bool:
        """A command-line worker at this router's own address (an IP or localhost; names are found out when the
        worker is read: a pd-router answers as one, core/router_identity.py)."""
        parsed = parse_worker_url(url)
        addresses = literal_addresses(parsed.host)
        listening = literal_addresses(self.host) if self.host else None
        return addresses is not None and is_own_address(addresses, parsed.port, self.host, self.port, listening)

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

    def validated(self) -> "RouterConfig":
        if found := self.problems():
            raise ConfigError(found)
        return self
