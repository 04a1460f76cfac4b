"""The peers' command lines (sglang-router 0.3.2, SMG 1.13) as pd-router reads them: their spellings of
pd-router's settings, their values, the flags of features pd-router lacks (exit 2, one line) and of parts it
does not need (accepted, one warning). Parsing only: tests/test_cli_peers_process.py starts processes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from router.core.config import ConfigError, RouterConfig
from router.server.cli import config_from_args
from router.server.cli_peers import PEER_DEFAULTS, ignored_flags, refused_flags

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "peers"
HANDLING = json.loads((FIXTURES / "pd_router.json").read_text())
PEER_ACTIONS = {flag: action for peer in ("sglang_router-0.3.2", "smg-1.13.0")
                for action in json.loads((FIXTURES / f"{peer}.json").read_text())["actions"]
                for flag in action["flags"]}
BASE = ["--prefill", "http://p:1", "9000", "--decode", "http://d:2"]


def parse(*argv: str) -> RouterConfig:
    return config_from_args([*BASE, *argv], env={})


def _a_value(flag: str) -> list[str]:
    """A value the peer's parser takes for the flag (not its default: that one asks for nothing)."""
    action = PEER_ACTIONS[flag]
    if action["nargs"] == 0:
        return []
    if action["type"] == "float":
        return ["0.5"]
    return ["7"] if action["type"] == "int" else ["x"]


def test_the_tables_are_the_reference_handling():
    assert set(refused_flags()) == {f for f, h in HANDLING.items() if h["class"] in ("refuse", "build")}
    assert set(ignored_flags()) == {f for f, h in HANDLING.items() if h["class"] == "ignored"}
    for flag, note in {**refused_flags(), **ignored_flags()}.items():
        assert len(note) > 20, flag


@pytest.mark.parametrize("flag", sorted(refused_flags()))
def test_a_feature_pd_router_lacks_exits_2_with_one_line(flag, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse(flag, *_a_value(flag))
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"pd-router: error: {flag}: not supported: "), err
    assert refused_flags()[flag] in err


@pytest.mark.parametrize("flag,value", sorted(PEER_DEFAULTS.items()))
def test_a_refused_flag_given_the_peers_default_asks_for_nothing(flag, value):
    assert parse(flag, value) == parse()


def test_ignored_flags_are_accepted_and_named_in_one_warning():
    flags = sorted(ignored_flags())
    argv = [token for flag in flags for token in (flag, *_a_value(flag))]
    config = parse(*argv)
    (line,) = config.compat_warnings
    assert all(flag in line for flag in flags)
    assert config.with_(compat_warnings=()) == parse()
    assert line in config.warnings()
    assert parse().compat_warnings == ()


@pytest.mark.parametrize("peer,ours", [
    (["--shutdown-grace-period-secs", "7"], ["--shutdown-grace-secs", "7"]),
    (["--load-monitor-interval", "4"], ["--load-poll-interval-secs", "4"]),
    (["--discovery-check-interval-secs", "3"], ["--discovery-file-interval-secs", "3"]),
    (["--cache-match-threshold", "0.7"], ["--cache-threshold", "0.7"]),
    (["--spill-abs-threshold", "5"], ["--balance-abs-threshold", "5"]),
    (["--spill-rel-threshold", "2.5"], ["--balance-rel-threshold", "2.5"]),
    (["--sticky-key-idle-secs", "60"], ["--max-idle-secs", "60"]),
    (["--log-level", "warn"], ["--log-level", "warning"]),
    (["--max-concurrent-requests", "-1"], ["--max-concurrent-requests", "0"]),
])
def test_the_peers_names_and_values_mean_what_ours_do(peer, ours):
    got, want = parse(*peer), parse(*ours)
    if peer[0] == "--max-concurrent-requests":  # -1 and 0 are both "no limit"; the admission makes them one
        from router.dataplane.admission import Admission
        assert Admission(got.admission).state()["max_concurrent_requests"] == 0
        assert Admission(want.admission).state()["max_concurrent_requests"] == 0
        return
    assert got == want and got != parse()


@pytest.mark.parametrize("level", ["debug", "info", "warn", "error"])
def test_every_peer_log_level_is_accepted(level):
    assert parse("--log-level", level).log_level == {"warn": "warning"}.get(level, level)


def test_max_concurrent_requests_below_minus_one_is_refused():
    with pytest.raises(ConfigError, match="max_concurrent_requests must not be negative"):
        parse("--max-concurrent-requests", "-2")


def test_discovery_provider():
    config = parse("--discovery-provider", "file", "--discovery-file", "/tmp/w.yaml")
    assert config.worker_sources.file == "/tmp/w.yaml" and config.worker_sources.provider == "file"
    with pytest.raises(ConfigError, match="needs --discovery-file"):
        parse("--discovery-provider", "file")
    with pytest.raises(ConfigError, match="--service-discovery needs --prefill-selector"):
        parse("--discovery-provider", "kubernetes")


# the peers' Kubernetes PD command lines, as their users write them
SGL_ROUTER_PODS = ["--pd-disaggregation", "--service-discovery", "--prefill-selector", "app=sglang-prefill",
                   "--decode-selector", "app=sglang-decode", "--service-discovery-port", "30000",
                   "--service-discovery-namespace", "llm", "--bootstrap-port-annotation", "sglang.ai/bootstrap-port"]
SMG_PODS = ["--pd-disaggregation", "--discovery-provider", "kubernetes", "--prefill-selector", "app=p", "tier=gpu",
            "--decode-selector", "app=d", "--service-discovery-port", "30000"]


def test_the_peers_pod_discovery_command_lines_parse_to_pod_discovery():
    from router.control.kubernetes_pods import PodDiscovery

    sources = config_from_args(SGL_ROUTER_PODS, env={}).worker_sources
    assert sources.pod_discovery
    assert PodDiscovery.of(sources) == PodDiscovery({}, {"app": "sglang-prefill"}, {"app": "sglang-decode"}, 30000,
                                                    "llm", "sglang.ai/bootstrap-port")
    smg = PodDiscovery.of(config_from_args(SMG_PODS, env={}).worker_sources)
    assert (smg.prefill_selector, smg.decode_selector, smg.namespace) == ({"app": "p", "tier": "gpu"},
                                                                          {"app": "d"}, None)
    any_role = config_from_args(["--service-discovery", "--selector", "app=sglang", "--selector", "tier=a"],
                                env={}).worker_sources
    assert PodDiscovery.of(any_role).selector == {"app": "sglang", "tier": "a"}  # each given adds (extend)


@pytest.mark.parametrize("argv, says", [
    (["--service-discovery"], "--service-discovery needs --prefill-selector"),
    (["--service-discovery", "--selector", "app"], "--selector: expected key=value, got 'app'"),
    (["--prefill-selector", "app=p"], "need --service-discovery"),
    (["--service-discovery", "--selector", "a=b", "--service-discovery-port", "0"], "--service-discovery-port must"),
    (["--service-discovery", "--discovery-provider", "file", "--discovery-file", "f", "--selector", "a=b"],
     "give one provider"),
])
def test_pod_discovery_flags_that_cannot_work_are_refused_saying_why(argv, says):
    with pytest.raises(ConfigError) as refused:
        config_from_args(argv, env={})
    assert any(says in problem for problem in refused.value.problems), refused.value.problems


def test_control_plane_api_keys_parse_and_bad_entries_are_named():
    config = parse("--control-plane-api-keys", "k1:Service Account:admin:s3:cret", "k2:Read Only:user:abc")
    keys = config.control_plane_keys()
    assert [(k.id, k.role, k.key) for k in keys] == [("k1", "admin", "s3:cret"), ("k2", "user", "abc")]
    assert "s3:cret" not in repr(keys)
    with pytest.raises(ConfigError, match="id:name:role:key"):
        parse("--control-plane-api-keys", "k1:x:root:secret")
