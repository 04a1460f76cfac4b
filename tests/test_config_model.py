"""The configuration model (router/core/config_model.py): unknown keys refused at once, every problem reported
in one pass in its flag's words, a bad value in each group found, configs frozen."""

import pytest
from pydantic import ValidationError

from policies.params import PolicyParams
from policies.rebalance import RebalanceConfig
from router.core.config import (AdmissionConfig, ClusterConfig, ConfigError, ConnectionTimeouts, DpRanksConfig,
                                HealthConfig, LoadMonitorConfig, PdAdmissionConfig, RouterConfig, TraceConfig,
                                WorkerSourcesConfig, WorkerSpec)


def test_an_unknown_key_is_refused_at_once_with_the_other_problems():
    with pytest.raises(ConfigError) as refused:
        RouterConfig(prefil=(WorkerSpec("http://a:1"),), port=0)
    assert refused.value.problems == ["--port must be in 1..65535, got 0", "unknown field 'prefil'"]


def test_an_unknown_key_of_a_group_is_refused_too():
    with pytest.raises(ConfigError, match="unknown field 'interval'"):
        HealthConfig(interval=1.0)
    with pytest.raises(ConfigError, match="health: unknown field 'interval'"):
        RouterConfig(health={"interval": 1.0})
    with pytest.raises(ConfigError, match="unknown field 'prot'"):
        RouterConfig().with_(prot=1)


def test_every_problem_is_reported_at_once():
    config = RouterConfig(
        prefill=(WorkerSpec("http://p:0"),), port=70000, tls_cert_path="cert.pem", max_connections=0,
        health=HealthConfig(interval_secs=-1), load_monitor=LoadMonitorConfig(interval_secs=0),
        pd_admission=PdAdmissionConfig(prefill_queue_size=-1), cluster=ClusterConfig(lease_ttl_secs=1),
        policy_params=PolicyParams(cache_threshold=2), rebalance=RebalanceConfig(min_gain=2),
        worker_allow=("bad host",))
    problems = config.problems()
    for says in ("--prefill: invalid worker url", "--port must be in 1..65535, got 70000",
                 "--tls-cert-path and --tls-key-path go together", "--max-connections must be at least 1",
                 "HealthConfig.interval_secs must not be negative", "--load-poll-interval-secs must be positive",
                 "--prefill-queue-size must not be negative", "need --prefill-max-inflight-requests-per-worker",
                 "--etcd-lease-ttl-secs must be in 2..300, got 1", "--cache-threshold must be in [0, 1]",
                 "rebalance min_gain must be in [0, 1]", "--worker-allow: 'bad host'"):
        assert sum(says in problem for problem in problems) == 1, (says, problems)
    assert len(problems) == 12, problems
    with pytest.raises(ConfigError) as refused:
        config.validated()
    assert refused.value.problems == problems


def test_a_rule_over_several_fields_is_checked_when_another_field_fails():
    """The tls pair's rule sits on tls_key_path; the failing port and group do not hide it."""
    problems = RouterConfig(port=0, tls_key_path="key.pem", connections=ConnectionTimeouts(-1)).problems()
    assert problems == ["--port must be in 1..65535, got 0",
                        "--tls-cert-path and --tls-key-path go together (HTTPS needs both)",
                        "--upstream-pool-idle-timeout-secs must not be negative (0: off)"]


@pytest.mark.parametrize("group,says", [
    (LoadMonitorConfig(timeout_secs=0), "--load-poll-timeout-secs must be positive, got 0"),
    (DpRanksConfig(decode_policy="fastest"),
     "--decode-dp-rank-policy must be one of least_loaded, round_robin, random, got 'fastest'"),
    (PdAdmissionConfig(prefill_queue_timeout_secs=5.0),
     "--prefill-queue-size and --prefill-queue-timeout-secs need --prefill-max-inflight-requests-per-worker"),
    (PdAdmissionConfig(pd_admission_wait_secs=-1), "--pd-admission-wait-secs must not be negative (0: shed at once)"),
    (ConnectionTimeouts(sse_keepalive_secs=-1), "--sse-keepalive-secs must not be negative (0: off)"),
    (WorkerSourcesConfig(file_interval_secs=0), "--discovery-file-interval-secs must be positive, got 0"),
    (WorkerSourcesConfig(provider="file"), "--discovery-provider file needs --discovery-file"),
    (WorkerSourcesConfig(etcd_endpoints=("ftp://e",)), "--discovery-etcd-endpoints: 'ftp://e' must be http(s)"),
    (WorkerSourcesConfig(service_discovery=True, selector=("a=b",), bootstrap_port_annotation=""),
     "--bootstrap-port-annotation must name an annotation"),
    (WorkerSourcesConfig(service_discovery=True, selector=("a=b",), service_discovery_port=0),
     "--service-discovery-port must be an integer in 1..65535, got 0"),
    (WorkerSourcesConfig(decode_selector=("a=b",)), "need --service-discovery"),
    (TraceConfig(enabled=True, otlp_traces_endpoint=" "), "--otlp-traces-endpoint must name the collector"),
    (TraceConfig(enabled=True, protocol="udp"), "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL must be grpc or http/protobuf"),
    (ClusterConfig(name="a/b"), "--cluster-name must be letters, digits, '.', '_' or '-', got 'a/b'"),
    (ClusterConfig(etcd_endpoints=("http://e:x",)), "--etcd-endpoints: invalid URL 'http://e:x'"),
    (AdmissionConfig(max_concurrent_requests=-2), "AdmissionConfig.max_concurrent_requests must not be negative"),
    (AdmissionConfig(rate_limit_tokens_per_second=0), "--rate-limit-tokens-per-second must be at least 1"),
])
def test_a_bad_value_in_each_group_is_named_there_and_in_the_router_config(group, says):
    assert any(says in problem for problem in group.problems()), group.problems()
    field = {LoadMonitorConfig: "load_monitor", DpRanksConfig: "dp_ranks", PdAdmissionConfig: "pd_admission",
             ConnectionTimeouts: "connections", WorkerSourcesConfig: "worker_sources", TraceConfig: "trace",
             ClusterConfig: "cluster", AdmissionConfig: "admission"}[type(group)]
    with pytest.raises(ConfigError) as refused:
        RouterConfig(**{field: group}).validated()
    assert any(says in problem for problem in refused.value.problems), refused.value.problems


@pytest.mark.parametrize("settings,says", [
    ({"prefill": (WorkerSpec("http://p:1"),), "decode": (WorkerSpec("http://P:1/"),)},
     "http://p:1 is given as both prefill and decode"),
    ({"prefill": (WorkerSpec("http://127.0.0.1:30000"),), "host": "127.0.0.1"},
     "--prefill http://127.0.0.1:30000 is this router itself"),
    ({"prefill": (WorkerSpec("http://p:1", 0),)}, "--prefill http://p:1: bootstrap_port must be an integer"),
    ({"control_plane_api_keys": ("k1:x:root:secret",)}, "each entry is id:name:role:key"),
    ({"client_key_path": "k.pem"}, "--client-cert-path and --client-key-path go together"),
    ({"prometheus_duration_buckets": (1.0, 0.5)}, "--prometheus-duration-buckets must be positive, finite and"),
    ({"worker_startup_check_interval_secs": 0}, "--worker-startup-check-interval must be positive"),
    ({"abort_timeout_secs": 0}, "abort_timeout_secs must be positive"),
    ({"replicas": 0}, "--replicas must be at least 1, got 0"),
    ({"etcd_data_dir": "/tmp/etcd"}, "--etcd-data-dir is for the private etcd of --replicas N"),
    ({"replicas": 2, "prometheus_port": 29999}, "metrics ports 29999-30000 include --port 30000"),
    ({"request_id_headers": ("X Id",)}, "--request-id-headers: 'X Id' is not an HTTP header name"),
    ({"cors_allowed_origins": ("example.org",)}, "--cors-allowed-origins: 'example.org' is not an origin"),
    ({"admin_allow_cidrs": ("10.0.0.0/33",)}, "--admin-allow-cidrs: '10.0.0.0/33' is not a network"),
    ({"port": "http"}, "port: Input should be a valid integer"),
])
def test_a_bad_router_setting_is_named(settings, says):
    with pytest.raises(ConfigError) as refused:
        RouterConfig(**settings).validated()
    assert [problem for problem in refused.value.problems if says in problem], refused.value.problems


def test_configs_are_frozen_and_changed_only_into_checked_copies():
    config = RouterConfig().validated()
    with pytest.raises(ValidationError):
        config.port = 1  # type: ignore[misc]
    with pytest.raises(ValidationError):
        config.health.interval_secs = 1.0  # type: ignore[misc]
    moved = config.with_(port=8080)
    assert (moved.port, config.port, moved.problems()) == (8080, 30000, [])
    assert config.with_(port=0).problems() == ["--port must be in 1..65535, got 0"]
    assert HealthConfig(5.0, 2.0) == HealthConfig(interval_secs=5.0, timeout_secs=2.0)  # in the fields' order
