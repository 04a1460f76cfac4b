"""Every mini_lb launch form is accepted unchanged and means the same thing."""

from __future__ import annotations

import pytest

from router.server.cli import config_from_args
from router.core.config import DISCOVER, ConfigError


def ports(config):
    return [(s.url, s.bootstrap_port) for s in config.prefill]


def test_launch_lb_form_with_one_port_copied_to_every_prefill():
    c = config_from_args("--prefill http://a:1 http://b:2 --decode http://c:3 http://d:4 "
                         "--prefill-bootstrap-ports 8998 --host 127.0.0.1 --port 8000 --timeout 60".split(), env={})
    assert ports(c) == [("http://a:1", 8998), ("http://b:2", 8998)]
    assert [s.url for s in c.decode] == ["http://c:3", "http://d:4"]
    assert (c.host, c.port, c.request_timeout_secs) == ("127.0.0.1", 8000, 60)


def test_launch_lb_form_with_one_port_per_prefill_and_none():
    c = config_from_args("--prefill http://a:1 http://b:2 --decode http://c:3 "
                         "--prefill-bootstrap-ports 8998 none".split(), env={})
    assert ports(c) == [("http://a:1", 8998), ("http://b:2", None)]


def test_launch_lb_form_without_ports_discovers_them():
    c = config_from_args("--prefill http://a:1 --decode http://c:3".split(), env={})
    assert ports(c) == [("http://a:1", DISCOVER)]


def test_sglang_router_repeatable_form():
    c = config_from_args("--pd-disaggregation --mini-lb --prefill http://a:1 8998 --prefill http://b:2 none "
                         "--prefill http://e:5 --decode http://c:3 --decode http://d:4 "
                         "--request-timeout-secs 1800 --policy po2".split(), env={})
    assert ports(c) == [("http://a:1", 8998), ("http://b:2", None), ("http://e:5", DISCOVER)]
    assert [s.url for s in c.decode] == ["http://c:3", "http://d:4"]
    assert c.prefill_policy == "power_of_two" and c.decode_policy == "power_of_two"


def test_separate_policies_and_keys_from_env():
    c = config_from_args("--prefill http://a:1 --decode http://c:3 --prefill-policy round_robin "
                         "--decode-policy random".split(), env={"PD_ROUTER_API_KEY": "k"})
    assert (c.prefill_policy, c.decode_policy, c.api_key) == ("round_robin", "random", "k")


@pytest.mark.parametrize("argv,fragment", [
    ("--prefill ftp://a:1 --decode http://c:3", "scheme"),
    ("--prefill http://a --decode http://c:3", "no port"),
    ("--prefill http://a:1 --decode http://a:1", "both prefill and decode"),
    ("--prefill http://a:1 x --decode http://c:3", "bootstrap port"),
    ("--prefill http://a:1 --decode http://c:3 --policy nope", "unknown prefill policy"),
    ("--prefill http://a:1 http://b:2 --decode http://c:3 --prefill-bootstrap-ports 1 2 3", "3 ports for 2"),
    ("--prefill http://a:1 99999 --decode http://c:3", "1..65535"),
])
def test_bad_flags_are_reported(argv, fragment):
    with pytest.raises(ConfigError) as info:
        config_from_args(argv.split(), env={})
    assert fragment in str(info.value)


def test_all_problems_reported_at_once():
    with pytest.raises(ConfigError) as info:
        config_from_args("--prefill ftp://a:1 --decode http://c --policy nope".split(), env={})
    assert len(info.value.problems) >= 3


def test_smg_rl_flags_are_accepted():
    """SMG's RL control plane flags: --enable-rl changes nothing (pd-router always serves /v1/rl)."""
    config = config_from_args("--enable-rl --rl-control-timeout-secs 30 --rl-fanout-concurrency 4".split(), env={})
    assert (config.rl_control_timeout_secs, config.rl_fanout_concurrency) == (30.0, 4)
    assert config_from_args(["--enable-rl"], env={}) == config_from_args([], env={})
    with pytest.raises(ConfigError, match="--rl-fanout-concurrency must be at least 1"):
        config_from_args(["--rl-fanout-concurrency", "0"], env={})


def test_max_connections_per_worker_bounds_each_servers_legs_and_0_turns_it_off():
    base = "--prefill http://a:1 --decode http://c:3".split()
    assert config_from_args(base, env={}).max_connections_per_worker == 4096
    assert config_from_args(base + ["--max-connections-per-worker", "64"], env={}).max_connections_per_worker == 64
    assert config_from_args(base + ["--max-connections-per-worker", "0"], env={}).max_connections_per_worker == 0
    with pytest.raises(ConfigError, match="--max-connections-per-worker must not be negative"):
        config_from_args(base + ["--max-connections-per-worker", "-1"], env={})
