"""Info answers: ``/server_info`` and ``/model_info`` (the load report is loads.py's).

The field sets come from a real 0.5.23 server (``data/sglang_0_5_23_info.json``); the simulator
fills in what it models. As on the real server, ``/server_info``'s top level is the launch
config (stale after a role switch) while ``internal_states[0]``, ``/model_info`` and
``/v1/loads`` show the live role and weight version.
"""

from __future__ import annotations

import copy
import json
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .server import Server

_DATA = Path(__file__).with_name("data") / "sglang_0_5_23_info.json"


@lru_cache(maxsize=1)
def _template() -> dict[str, Any]:
    return json.loads(_DATA.read_text())


def _launch_command(worker: "Server") -> str:
    cfg = worker.config
    parts = [f"--model-path {cfg.model_path}", f"--host {cfg.host}", f"--port {worker.port}",
             f"--max-total-tokens {cfg.max_total_tokens}"]
    if cfg.role != "null":
        parts.append(f"--disaggregation-mode {cfg.role}")
    if worker.launch_bootstrap_port is not None:
        parts.append(f"--disaggregation-bootstrap-port {worker.launch_bootstrap_port}")
    if cfg.enable_pd_role_switch:
        parts.append("--enable-pd-role-switch")
    if cfg.api_key is not None:
        parts.append(f"--api-key {cfg.api_key}")  # the real launch_command repeats the key in clear
    return " ".join(parts)


def server_args(worker: "Server") -> dict[str, Any]:
    """The launch arguments as ``/server_info`` reports them (never changed by a role switch)."""
    cfg = worker.config
    args = copy.deepcopy(_template()["server_args"])
    args.update({
        "model_path": cfg.model_path,
        "tokenizer_path": cfg.model_path,
        "served_model_name": cfg.model_name,
        "host": cfg.host,
        "port": worker.port,
        # launch flags the real reference deployment leaves unset (the model and memory decide them)
        "context_length": None,
        "max_running_requests": None,
        "max_total_tokens": cfg.max_total_tokens,
        "max_total_num_tokens": cfg.max_total_tokens,
        "weight_version": cfg.weight_version,
        "disaggregation_mode": cfg.role,
        "disaggregation_bootstrap_port": worker.launch_bootstrap_port,
        "enable_pd_role_switch": cfg.enable_pd_role_switch,
        "enable_metrics": cfg.enable_metrics,
        "api_key": cfg.api_key,  # SGLang reports its key in clear, like every other launch argument
        "launch_command": _launch_command(worker),
        "device": "sim",
        "random_seed": cfg.seed,
    })
    # what 0.5.23 resolves the DP layout to (docs/DP_RANKS.md): the ranks are dp_size x attn_dp_size
    if cfg.enable_dp_attention:
        args.update({"dp_size": 1, "attn_dp_size": cfg.dp_size, "enable_dp_attention": cfg.dp_size > 1})
    else:
        args.update({"dp_size": cfg.dp_size, "attn_dp_size": 1, "enable_dp_attention": False})
    # role-dependent launch defaults, as a real prefill / decode server reports them
    if cfg.role == "prefill":
        args.update({"hicache_ratio": 2.0, "disaggregation_decode_retraction_backup": None,
                     "disaggregation_decode_extra_slots": None, "load_balance_method": "follow_bootstrap_room"})
    if cfg.api == "convert":
        # the earlier design rewrites server_args on conversion: the top level follows the live role
        args["disaggregation_mode"] = worker.engine.role
        args["disaggregation_bootstrap_port"] = worker.bootstrap_port
    args["startup_time"] = {"load_weight": 0.0, "kv_cache_allocation": 0.0, "scheduler_e2e": 0.0,
                            "cuda_graph": args["startup_time"]["cuda_graph"], "tokenizer_e2e": 0.0} \
        if isinstance(args.get("startup_time"), dict) else args.get("startup_time")
    return args


def internal_state(worker: "Server", args: dict[str, Any]) -> dict[str, Any]:
    tpl = _template()
    engine = worker.engine
    top_only = set(tpl["top_level_only"])
    state = {k: v for k, v in args.items() if k not in top_only}
    state.update(copy.deepcopy(tpl["internal_state_overrides"]))
    if isinstance(state.get("startup_time"), dict):
        state["startup_time"] = {k: v for k, v in state["startup_time"].items() if k != "tokenizer_e2e"}
    state.update(copy.deepcopy(tpl["internal_state_extra"]))
    if worker.config.role == "prefill":
        state["disaggregation_decode_retraction_backup"] = "cpu_tensor"  # what a prefill's scheduler shows
    state.update({
        "model_path": engine.model_path,
        "weight_version": engine.weight_version,
        "disaggregation_mode": engine.role,
        "disaggregation_bootstrap_port": worker.bootstrap_port,
        "effective_max_running_requests_per_dp": worker.config.max_running_requests,
        "last_gen_throughput": engine.last_gen_throughput,
    })
    state["memory_usage"]["token_capacity"] = worker.config.max_total_tokens
    return state


def server_info(worker: "Server") -> dict[str, Any]:
    args = server_args(worker)
    out = dict(args)
    out["internal_states"] = [internal_state(worker, args) for _ in range(worker.config.dp_size)]  # one per rank
    out["version"] = worker.config.sglang_version
    if worker.config.at_least("0.5.23"):
        out["frontend"] = "python"
    return out


def model_info(worker: "Server") -> dict[str, Any]:
    cfg = worker.config
    engine = worker.engine
    if not cfg.at_least("0.5.23"):
        # 0.5.6 / 0.4.9: no live role, the launch weight_version
        return {"model_path": engine.model_path, "tokenizer_path": cfg.model_path, "is_generation": True,
                "preferred_sampling_params": None, "weight_version": engine.model_version,
                "has_image_understanding": False, "has_audio_understanding": False}
    info = copy.deepcopy(_template()["model_info"])
    info.update({
        "model_path": engine.model_path,
        "served_model_name": engine.model_path if engine.model_path != cfg.model_path else cfg.model_name,
        "tokenizer_path": cfg.model_path,
        "weight_version": engine.model_version,
        "disaggregation_mode": engine.role,
    })
    return info
