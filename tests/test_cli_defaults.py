"""The command line and the config model cannot drift apart: what `--help` shows is what a run gets."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys

import pytest

from router.core.config import RouterConfig
from router.core.config_model import ConfigModel
from router.server.cli import FLAGS, config_from_args

# Value flags that show no default: the workers, per-pool policies (they fall back to --policy) and the
# optional ones whose default is "none".
NO_DEFAULT_SHOWN = {"--prefill", "--decode", "--prefill-bootstrap-ports", "--prefill-policy", "--decode-policy",
                    "--api-key", "--admin-api-key", "--worker-api-key", "--prometheus-port", "--prometheus-host",
                    "--admin-allow-cidrs", "--worker-allow", "--etcd-data-dir",
                    "--discovery-file", "--discovery-etcd-endpoints", "--etcd-endpoints",
                    "--tls-cert-path", "--tls-key-path", "--client-cert-path", "--client-key-path", "--ca-cert-paths",
                    "--prefill-queue-size", "--prefill-queue-timeout-secs", "--pd-admission-wait-secs",
                    "--rate-limit-tokens-per-second",
                    "--prometheus-duration-buckets",
                    "--worker-startup-check-interval",
                    "--log-dir",
                    "--cors-allowed-origins",
                    "--request-id-headers",
                    "--control-plane-api-keys", "--discovery-provider",
                    "--otlp-traces-protocol", "--otlp-service-name",  # OTel's env vars, else grpc / pd-router
                    "--selector", "--prefill-selector", "--decode-selector", "--service-discovery-namespace"}
# Switches that change nothing (mini_lb and SMG compatibility).
NO_OP_SWITCHES = {"-h", "--pd-disaggregation", "--mini-lb", "--enable-rl"}
# Config fields set by the launch forms rather than by a flag row, and the one field no flag sets.
SET_BY_LAUNCH_FORMS = {"prefill", "decode", "prefill_policy", "decode_policy",
                       "health.remove_unhealthy"}  # --remove-unhealthy-workers and its --no- form (by hand)
NOT_A_FLAG = {"rebalance.history", "compat_warnings"}


@pytest.fixture(scope="module")
def help_options() -> dict[str, tuple[bool, str | None]]:
    """flag -> (takes a value, the default shown or None), read from a real `python -m router --help`."""
    env = {**os.environ, "COLUMNS": "1000"}  # one line per option where possible
    proc = subprocess.run([sys.executable, "-m", "router", "--help"], capture_output=True, text=True, env=env,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    blocks: list[list[str]] = []
    for line in proc.stdout.split("options:", 1)[1].splitlines():
        if re.match(r"  -", line):
            blocks.append([line.strip()])
        elif line.startswith("   ") and blocks:  # an option's help goes on indented; a section's title does not
            blocks[-1].append(line.strip())
    options = {}
    for block in blocks:
        invocation = re.split(r"\s{2,}", block[0], maxsplit=1)[0]
        first = invocation.split(",")[0]
        shown = re.search(r"\(default: ([^)]*)\)$", " ".join(block))
        options[first.split()[0]] = (" " in first, shown.group(1) if shown else None)
    return options


def test_an_empty_command_line_gives_the_dataclass_defaults():
    assert config_from_args([], env={}) == RouterConfig()


def test_every_default_shown_in_help_is_the_config_default(help_options):
    shown = {name: default for name, (takes_value, default) in help_options.items() if takes_value and default}
    assert len(shown) > 50
    defaults = RouterConfig()
    for name, default in shown.items():
        assert config_from_args([name, default], env={}) == defaults, f"{name} shows default {default!r}"


def test_every_value_flag_shows_its_default_unless_it_has_none(help_options):
    without = {name for name, (takes_value, default) in help_options.items() if takes_value and default is None}
    assert without == NO_DEFAULT_SHOWN


def test_every_switch_moves_its_field_away_from_the_default(help_options):
    switches = {name for name, (takes_value, _) in help_options.items() if not takes_value} - NO_OP_SWITCHES
    assert {"--disable-health-check", "--log-json", "--no-inject-rid", "--disable-load-poll"} <= switches
    for name in switches - {"--service-discovery"}:
        assert config_from_args([name], env={}) != RouterConfig(), name
    # pod discovery means nothing without a selector (refused alone): given with one
    assert config_from_args(["--service-discovery", "--selector", "a=b"], env={}).worker_sources.service_discovery


def _field_names(group) -> list[str]:
    """A config group's fields: the model's, or a policies/ dataclass's (policy_params, rebalance)."""
    if isinstance(group, ConfigModel):
        return list(type(group).model_fields)
    return [f.name for f in dataclasses.fields(group)]


def _leaf_paths(config, prefix: str = "") -> set[str]:
    paths = set()
    for name in _field_names(config):
        value = getattr(config, name)
        if isinstance(value, ConfigModel) or dataclasses.is_dataclass(value):
            paths |= _leaf_paths(value, f"{prefix}{name}.")
        else:
            paths.add(prefix + name)
    return paths


def test_every_config_field_has_a_flag():
    flagged = [row.path for row in FLAGS]
    assert len(flagged) == len(set(flagged)), "two flags set one field"
    assert set(flagged) | SET_BY_LAUNCH_FORMS | NOT_A_FLAG == _leaf_paths(RouterConfig())
