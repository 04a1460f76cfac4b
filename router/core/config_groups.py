"""The configuration's groups (RouterConfig's parts, core/config.py): each knob with its default and its rules,
as pydantic validators in the words of the knob's flag (core/config_model.py)."""

import re
from typing import Annotated, ClassVar
from urllib.parse import urlsplit

from pydantic import ValidationInfo, field_validator

from router.core.config_model import FAILED, ConfigModel, checked_by, earlier, refuse, rule
from router.core.tracing import missing_packages


def validate_port(value: object, what: str = "bootstrap_port") -> str | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        return f"{what} must be an integer in 1..65535 or null, got {value!r}"
    return None


def _one_of(flag: str, choices: tuple[str, ...]):
    return rule(lambda value: value in choices, f"{flag} must be one of {', '.join(choices)}, got {{value!r}}")


class _NothingNegative(ConfigModel):
    """A group whose numbers (counts, durations, factors) are never negative, a value in `UNBOUNDED` aside."""

    UNBOUNDED: ClassVar[dict[str, int]] = {}

    @field_validator("*")
    @classmethod
    def _not_negative(cls, value, info: ValidationInfo):
        if (isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0
                and cls.UNBOUNDED.get(info.field_name) != value):
            refuse(f"{cls.__name__}.{info.field_name} must not be negative")
        return value


class HealthConfig(_NothingNegative):
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


class BreakerConfig(_NothingNegative):
    failure_threshold: int = 10
    success_threshold: int = 3
    timeout_secs: float = 30.0
    enabled: bool = True
    # Failures in a row count toward the threshold only within this long of the first (sgl-router's and SMG's
    # --cb-window-duration-secs): a fault now and then never opens the breaker.
    window_secs: float = 120.0


class RetryConfig(_NothingNegative):
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


class AdmissionConfig(_NothingNegative):
    UNBOUNDED = {"max_concurrent_requests": -1}  # the peers' "no limit"

    max_concurrent_requests: int = 0  # 0 or -1 (sgl-router's and SMG's default): unbounded
    # New requests per second, bursting up to max_concurrent_requests (dataplane/admission.py); None: no limit
    rate_limit_tokens_per_second: Annotated[int | None, rule(
        lambda value: value is None or value >= 1,
        "--rate-limit-tokens-per-second must be at least 1 (leave it out for no limit)")] = None
    queue_size: int = 1024  # requests waiting for a slot or for a fleet-wide hold to end
    queue_timeout_secs: float = 60.0
    max_payload_size: Annotated[int, rule(lambda value: value >= 1, "--max-payload-size must be at least 1")] = (
        256 * 1024 * 1024)
    # Admin calls' bodies are small JSON objects: a lower bound keeps an anonymous caller (admin routes are open
    # without a key) from making the router buffer and parse 256 MiB. /update_weights_from_tensor, whose body
    # carries serialized tensors, keeps max_payload_size.
    max_admin_payload_size: Annotated[int, rule(lambda value: value >= 1,
                                                "--max-admin-payload-size must be at least 1")] = 1024 * 1024
    # What one generation request may ask for, checked before anything is done per sequence: n (parallel
    # samples) and sequences (prompts x n: the batch SGLang runs, one bootstrap room each). SGLang, sgl-router
    # and SMG bound neither: 10^9 sequences would be built, then run. n is 1 by default: SGLang 0.5.23 does not
    # serve n > 1 across a prefill/decode pair (its decode server first runs a warm-up of the prompt and waits
    # for that warm-up's KV, which no prefill sends: a 500 after the KV timeout, whatever the router does), so
    # a client asking for it gets a 400 saying so; --max-n raises it for servers that serve it (OpenAI's 128).
    max_n: Annotated[int, rule(lambda value: value >= 1, "--max-n must be at least 1, got {value}")] = 1
    max_batch_size: Annotated[int, rule(lambda value: value >= 1,
                                        "--max-batch-size must be at least 1, got {value}")] = 4096


class LoadMonitorConfig(ConfigModel):
    """Polling of the servers' own load reports (for power_of_two, cache_aware and the rebalancer)."""

    enabled: bool = True
    interval_secs: Annotated[float, rule(lambda value: value > 0,
                                         "--load-poll-interval-secs must be positive, got {value}")] = 1.0
    timeout_secs: Annotated[float, rule(lambda value: value > 0,
                                        "--load-poll-timeout-secs must be positive, got {value}")] = 2.0
    # SMG's --disable-load-monitoring: poll only when a policy or the rebalancer reads the reports.
    on_demand: bool = False


DP_RANK_POLICIES = ("least_loaded", "round_robin", "random")


class DpRanksConfig(ConfigModel):
    """`--dp-aware`: the router chooses each leg's data-parallel rank (docs/DP_RANKS.md)."""

    aware: bool = False
    prefill_policy: Annotated[str, _one_of("--prefill-dp-rank-policy", DP_RANK_POLICIES)] = "least_loaded"
    decode_policy: Annotated[str, _one_of("--decode-dp-rank-policy", DP_RANK_POLICIES)] = "least_loaded"


class PdAdmissionConfig(ConfigModel):
    """SMG's PD admission (dataplane/pd_admission.py): at most `prefill_max_inflight_requests_per_worker` requests
    on each prefill (<= 0: no bound), the rest waiting in one FIFO queue; with `pd_admission_wait_secs`, a
    request waits that long for a decode below its running window (`max_running_requests`), else 503."""

    # None: 100 (SMG's) when the bound is on; 0: no waiting (429 at once)
    prefill_queue_size: Annotated[int | None, rule(lambda value: value is None or value >= 0,
                                                   "--prefill-queue-size must not be negative (0: no waiting)")] = None
    prefill_queue_timeout_secs: Annotated[float | None, rule(  # None: 60 (SMG's)
        lambda value: value is None or value > 0, "--prefill-queue-timeout-secs must be positive")] = None
    pd_admission_wait_secs: Annotated[float | None, rule(  # None: no decode gate (SMG: 30); 0: shed at once
        lambda value: value is None or value >= 0, "--pd-admission-wait-secs must not be negative (0: shed at once)")
    ] = None
    # Last: its rule reads the queue's fields (a queue field that failed its own rule counts as given).
    prefill_max_inflight_requests_per_worker: int = -1

    @property
    def prefill_bounded(self) -> bool:
        return self.prefill_max_inflight_requests_per_worker > 0

    @field_validator("prefill_max_inflight_requests_per_worker")
    @classmethod
    def _queue_needs_the_bound(cls, bound: int, info: ValidationInfo) -> int:
        if bound <= 0 and (earlier(info, "prefill_queue_size") is not None
                           or earlier(info, "prefill_queue_timeout_secs") is not None):
            refuse("--prefill-queue-size and --prefill-queue-timeout-secs need "
                   "--prefill-max-inflight-requests-per-worker to be positive (as SMG's)")
        return bound


class ConnectionTimeouts(ConfigModel):
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

    @field_validator("*")
    @classmethod
    def _not_negative(cls, value: float, info: ValidationInfo) -> float:
        if not value >= 0:
            refuse(f"--{info.field_name.replace('_', '-')} must not be negative (0: off)")
        return value


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


def _selector_problems(flag: str):
    def problems_of(items: tuple[str, ...]) -> list[str]:
        bad = selector_labels(items)[1]
        return [f"{flag}: expected key=value, got {', '.join(map(repr, bad))}"] if bad else []
    return checked_by(problems_of)


def _cluster_name(flag: str):
    return rule(lambda name: CLUSTER_NAME.fullmatch(name) is not None,
                f"{flag} must be letters, digits, '.', '_' or '-', got {{value!r}}")


class WorkerSourcesConfig(ConfigModel):
    """Workers listed outside the command line and the API (router/control/worker_sources.py)."""

    file: Annotated[str | None, rule(lambda file: file is None or file != "",  # a YAML or JSON file of workers, polled
                                     "--discovery-file must name a file")] = None
    provider: str | None = None  # SMG's --discovery-provider: "file" (the file above) or "kubernetes"
    file_interval_secs: Annotated[float, rule(lambda value: value > 0,
                                              "--discovery-file-interval-secs must be positive, got {value}")] = 1.0
    # etcd keys that workers (or their sidecars) write under a lease: /pd-router/<name>/v1/discovery/<url>
    etcd_endpoints: Annotated[tuple[str, ...], checked_by(
        lambda endpoints: etcd_endpoint_problems("--discovery-etcd-endpoints", endpoints))] = ()
    etcd_cluster_name: Annotated[str, _cluster_name("--discovery-cluster-name")] = "pd-router"
    # Kubernetes pod discovery (sgl-router's and SMG's flags; router/control/kubernetes_pods.py)
    service_discovery: bool = False  # SMG's other spelling: --discovery-provider kubernetes
    # key=value: pods whose server's live role names their pool
    selector: Annotated[tuple[str, ...], _selector_problems("--selector")] = ()
    prefill_selector: Annotated[tuple[str, ...], _selector_problems("--prefill-selector")] = ()
    decode_selector: Annotated[tuple[str, ...], _selector_problems("--decode-selector")] = ()
    service_discovery_port: int = 80
    service_discovery_namespace: str | None = None  # None: every namespace
    bootstrap_port_annotation: str = "sglang.ai/bootstrap-port"

    @property
    def pod_discovery(self) -> bool:
        return self.service_discovery or self.provider == "kubernetes"

    @field_validator("service_discovery")
    @classmethod
    def _one_provider(cls, service_discovery: bool, info: ValidationInfo) -> bool:
        found = []
        if earlier(info, "provider") == "file" and not earlier(info, "file"):
            found.append("--discovery-provider file needs --discovery-file")
        if earlier(info, "provider") == "file" and service_discovery:
            found.append("--service-discovery is --discovery-provider kubernetes: give one provider")
        if found:
            refuse(*found)
        return service_discovery

    @field_validator("service_discovery_port")
    @classmethod
    def _pods_need_selectors_and_a_port(cls, port: int, info: ValidationInfo) -> int:
        selectors = [earlier(info, name) for name in ("selector", "prefill_selector", "decode_selector")]
        if FAILED in selectors:
            selectors = [True]  # a selector that is given but wrong: reported as such
        if _pod_discovery(info):
            found = [] if any(selectors) else [
                "--service-discovery needs --prefill-selector and --decode-selector (or --selector: "
                "the pods' servers say their role)"]
            if problem := validate_port(port, "--service-discovery-port"):
                found.append(problem.replace(" or null", ""))
            if found:
                refuse(*found)
        elif any(selectors):
            refuse("--selector, --prefill-selector and --decode-selector need --service-discovery "
                   "(or --discovery-provider kubernetes)")
        return port

    @field_validator("bootstrap_port_annotation")
    @classmethod
    def _pods_need_an_annotation(cls, annotation: str, info: ValidationInfo) -> str:
        if _pod_discovery(info) and not annotation:
            refuse("--bootstrap-port-annotation must name an annotation")
        return annotation


def _pod_discovery(info: ValidationInfo) -> bool:
    return earlier(info, "service_discovery") is True or earlier(info, "provider") == "kubernetes"


class TraceConfig(ConfigModel):
    """OpenTelemetry traces over OTLP (router/obs/otel_tracing.py): SGLang's and sgl-router's flags."""

    enabled: bool = False
    otlp_traces_endpoint: str = "localhost:4317"  # gRPC: host:port; http/protobuf: the collector's URL
    # OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, as SGLang reads it; None: grpc
    protocol: str | None = None
    service_name: str | None = None  # None: OTEL_SERVICE_NAME, else pd-router

    @field_validator("otlp_traces_endpoint")
    @classmethod
    def _names_a_collector(cls, endpoint: str, info: ValidationInfo) -> str:
        if earlier(info, "enabled") is True and not endpoint.strip():
            refuse("--otlp-traces-endpoint must name the collector (host:port)")
        return endpoint

    @field_validator("protocol")
    @classmethod
    def _a_protocol_with_its_packages(cls, protocol: str | None, info: ValidationInfo) -> str | None:
        if earlier(info, "enabled") is not True:
            return protocol
        if protocol is not None and protocol not in ("grpc", "http/protobuf"):
            refuse(f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL must be grpc or http/protobuf (as SGLang's), got {protocol!r}")
        if missing := missing_packages(protocol or "grpc"):
            refuse(missing)
        return protocol


class ClusterConfig(ConfigModel):
    """Router replicas sharing one fleet through etcd (docs/CLUSTER.md). No endpoints: a lone router."""

    etcd_endpoints: Annotated[tuple[str, ...], checked_by(
        lambda endpoints: etcd_endpoint_problems("--etcd-endpoints", endpoints))] = ()
    # the key prefix /pd-router/<name>/v1/: one fleet per name
    name: Annotated[str, _cluster_name("--cluster-name")] = "pd-router"
    # A replica's keys (membership, the operations it runs) outlive it by at most this: the takeover delay.
    lease_ttl_secs: Annotated[int, rule(lambda ttl: 2 <= ttl <= 300,
                                        "--etcd-lease-ttl-secs must be in 2..300, got {value}")] = 5

    @property
    def enabled(self) -> bool:
        return bool(self.etcd_endpoints)
