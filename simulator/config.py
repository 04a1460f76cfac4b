"""Settings of one simulated worker, and the command-line flags that set them.

Defaults are the real server's (SGLang 0.5.23) wherever it has one: a 300 s bootstrap and KV
wait, 15 one-second bootstrap retries on decode, a 1 s ``/health`` probe. Tests shorten the ones
they exercise.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields, replace
from typing import Any

ROLES = ("prefill", "decode", "null")
APIS = ("0.5.23", "convert", "patched")  # patched: 0.5.23 with server_patches (both APIs)
VERSIONS = ("0.4.9", "0.5.6", "0.5.23")


@dataclass(frozen=True)
class Timing:
    """Simulated compute time; all zero means answers are as fast as the HTTP stack allows."""

    prefill_overhead_s: float = 0.0  # fixed cost of one prefill
    prefill_per_token_s: float = 0.0  # per input token
    decode_step_s: float = 0.0  # one decode step with a single running request
    decode_step_per_running_s: float = 0.0  # added per request decoding at the same time (batch cost)
    kv_transfer_s: float = 0.0  # prefill -> decode transfer of one room

    def prefill_time(self, input_tokens: int) -> float:
        return self.prefill_overhead_s + self.prefill_per_token_s * input_tokens

    def decode_step_time(self, running: int) -> float:
        return self.decode_step_s + self.decode_step_per_running_s * max(running, 1)

    @property
    def zero(self) -> bool:
        return not (self.prefill_overhead_s or self.prefill_per_token_s or self.decode_step_s
                    or self.decode_step_per_running_s or self.kv_transfer_s)


@dataclass(frozen=True)
class WorkerConfig:
    role: str = "prefill"
    host: str = "127.0.0.1"
    port: int = 0
    bootstrap_port: int | None = 8998  # None: no bootstrap listener (non-PD or decode without role switch)
    api: str = "0.5.23"
    sglang_version: str = "0.5.23"
    enable_pd_role_switch: bool = False
    model_path: str = "sim/tiny-llama"
    # SGLang's --api-key: every route but /health*, /ready*, /metrics* needs `Authorization: Bearer KEY`.
    api_key: str | None = None
    served_model_name: str | None = None
    context_length: int = 8192
    max_running_requests: int = 2048
    max_total_tokens: int = 262144
    default_max_new_tokens: int = 128
    # Prefill compute: forwards that run at once on this worker (0: unbounded); the others wait in the
    # waiting queue, so prefill throughput is bounded like a real server's (one batch at a time). A forward
    # takes the waiting requests in order up to max_prefill_tokens prompt tokens (SGLang's --max-prefill-tokens).
    prefill_concurrency: int = 0
    max_prefill_tokens: int = 16384
    # Data-parallel ranks (SGLang's --dp-size): each rank schedules its own requests (which rank: 0.5.23's rules,
    # simulator/dp_ranks.py) and /v1/loads has one row per rank; the token and running caps are per rank.
    dp_size: int = 1
    # Attention DP (--dp-size N --enable-dp-attention): the same N ranks, but /server_info says what 0.5.23
    # resolves them to: dp_size 1, attn_dp_size N, enable_dp_attention true.
    enable_dp_attention: bool = False
    # A decode server admits a request (prealloc) when its prompt plus this many tokens fit in its KV pool
    # (0.5.23's --num-reserved-decode-tokens); 0: its prompt plus max_new_tokens, like other roles.
    num_reserved_decode_tokens: int = 512
    # /v1/loads shows the row the scheduler last published (0.5.23's --load-snapshot-publish-interval): a decode
    # running batches publishes every this many steps, a prefill after every forward; a scheduler with no batch
    # running publishes at once. 1: a decode publishes after every step.
    load_snapshot_publish_interval: int = 15
    # Radix cache: tokens of computed prompt prefixes kept (0: none). A cached prefix is not computed again
    # (prefill time counts the uncached tokens) and is reported as meta_info.cached_tokens.
    prefix_cache_tokens: int = 0
    weight_version: str = "default"
    enable_metrics: bool = False
    timing: Timing = field(default_factory=Timing)
    # PD protocol deadlines (SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT / _WAITING_TIMEOUT)
    bootstrap_timeout_s: float = 300.0
    kv_wait_timeout_s: float = 300.0
    bootstrap_retries: int = 15
    bootstrap_retry_interval_s: float = 1.0
    # A decode leg aborted during its KV transfer holds its KV until the prefill acks the abort. A live
    # prefill acks at once; a stale registration (a listener whose server switched to decode) never does,
    # so the KV is released after SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT (30 s), and
    # until then the worker is not idle (role switch refused, flush_cache fails).
    deferred_release_s: float = 30.0
    # /health sends a 1-token probe and checks for progress after this long (1 s on real)
    health_check_s: float = 1.0
    health_timeout_s: float = 20.0
    # how often a waiting call checks that its client is still there (SGLang: every few seconds)
    disconnect_check_s: float = 0.5
    role_switch_s: float = 0.0  # how long a successful switch takes (0.1-0.6 s on real CPU servers)
    convert_bootstrap_base: int = 8998  # /convert_pd_role: first port tried for a new listener
    startup_s: float = 0.0  # /health answers 503 this long after start ("slow start")
    seed: int = 0

    def __post_init__(self) -> None:
        problems = []
        if self.role not in ROLES:
            problems.append(f"role must be one of {ROLES}, got {self.role!r}")
        if self.api not in APIS:
            problems.append(f"api must be one of {APIS}, got {self.api!r}")
        if self.sglang_version not in VERSIONS:
            problems.append(f"sglang_version must be one of {VERSIONS}, got {self.sglang_version!r}")
        if self.max_running_requests < 1 or self.max_total_tokens < 1:
            problems.append("max_running_requests and max_total_tokens must be positive")
        if self.prefill_concurrency < 0 or self.prefix_cache_tokens < 0:
            problems.append("prefill_concurrency and prefix_cache_tokens must not be negative")
        if self.max_prefill_tokens < 1 or self.dp_size < 1 or self.load_snapshot_publish_interval < 1:
            problems.append("max_prefill_tokens, dp_size and load_snapshot_publish_interval must be positive")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model_path

    @property
    def version_tuple(self) -> tuple[int, ...]:
        return tuple(int(p) for p in self.sglang_version.split("."))

    def at_least(self, version: str) -> bool:
        return self.version_tuple >= tuple(int(p) for p in version.split("."))

    def with_(self, **changes: Any) -> "WorkerConfig":
        timing_changes = {k: changes.pop(k) for k in list(changes) if k in _TIMING_FIELDS}
        cfg = replace(self, **changes)
        if timing_changes:
            cfg = replace(cfg, timing=replace(cfg.timing, **timing_changes))
        return cfg


_TIMING_FIELDS = {f.name for f in fields(Timing)}
_SKIP_FLAGS = {"timing"}


def add_worker_flags(parser: argparse.ArgumentParser, *, single: bool = True) -> None:
    """Flags for every WorkerConfig field (and Timing's); ``single`` adds role/host/port."""
    defaults = WorkerConfig()
    for f in fields(WorkerConfig):
        if f.name in _SKIP_FLAGS or (not single and f.name in ("role", "port", "bootstrap_port")):
            continue
        _add_flag(parser, f.name, getattr(defaults, f.name))
    for f in fields(Timing):
        _add_flag(parser, f.name, getattr(defaults.timing, f.name))


def _add_flag(parser: argparse.ArgumentParser, name: str, default: Any) -> None:
    flag = "--" + name.replace("_", "-")
    if name == "bootstrap_port":
        parser.add_argument(flag, "--disaggregation-bootstrap-port", type=_port_or_none, default=default,
                            dest=name, help="bootstrap listener port ('none': no listener)")
    elif name == "role":
        parser.add_argument(flag, "--disaggregation-mode", choices=ROLES, default=default, dest=name)
    elif name == "api":
        parser.add_argument(flag, choices=APIS, default=default, dest=name)
    elif name == "sglang_version":
        parser.add_argument(flag, choices=VERSIONS, default=default, dest=name)
    elif isinstance(default, bool):
        parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, dest=name)
    elif isinstance(default, float):
        parser.add_argument(flag, type=float, default=default, dest=name)
    elif isinstance(default, int):
        parser.add_argument(flag, type=int, default=default, dest=name)
    else:
        parser.add_argument(flag, default=default, dest=name)


def _port_or_none(value: str) -> int | None:
    return None if value.lower() in ("none", "null", "") else int(value)


def config_from_args(args: argparse.Namespace, **overrides: Any) -> WorkerConfig:
    values = {f.name: getattr(args, f.name) for f in fields(WorkerConfig) if hasattr(args, f.name)}
    timing = Timing(**{f.name: getattr(args, f.name) for f in fields(Timing) if hasattr(args, f.name)})
    values.update(overrides)
    values.pop("timing", None)
    return WorkerConfig(timing=timing, **values)
