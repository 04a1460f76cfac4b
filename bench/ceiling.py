"""The ceiling fleet: four SGLang look-alikes (2 prefill, 2 decode) that answer instantly, served by nginx.

Every answer is a fixed body, so the router under test is the only thing that costs time. Each server
answers what the routers ask at start-up (sgl-router: /health, /server_info, /model_info; pd-router and
mini_lb: /get_server_info, /get_model_info) with its own role and bootstrap port.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import orjson

from bench import procs
from bench.fleet import Fleet

# An absolute local path, like a real deployment's: sgl-router then looks for a tokenizer on disk, not on a hub.
MODEL_PATH = "/tmp/pd-router-bench/instant-model"

# A realistic non-streaming SGLang 0.5.23 /generate answer: 16 tokens, the meta_info keys it sends.
GENERATE_BODY = {
    "text": " jumps over the lazy dog, and the dog does not seem to mind at all.",
    "output_ids": [35308, 916, 279, 16053, 5679, 11, 323, 279, 5679, 1558, 539, 2873, 311, 4059, 520, 682],
    "meta_info": {
        "id": "6f1d2c3b4a5e4f60a7b8c9d0e1f2a3b4",
        "finish_reason": {"type": "length", "length": 16},
        "prompt_tokens": 24,
        "weight_version": "default",
        "num_retractions": 0,
        "reasoning_tokens": 0,
        "completion_tokens": 16,
        "cached_tokens": 0,
        "e2e_latency": 0.0412,
    },
}

CHAT_BODY = {
    "id": "6f1d2c3b4a5e4f60a7b8c9d0e1f2a3b4",
    "object": "chat.completion",
    "created": 1764400000,
    "model": MODEL_PATH,
    "choices": [{"index": 0, "message": {"role": "assistant", "content": GENERATE_BODY["text"]},
                 "logprobs": None, "finish_reason": "length", "matched_stop": None}],
    "usage": {"prompt_tokens": 24, "total_tokens": 40, "completion_tokens": 16},
}


def server_info(role: str, port: int, bootstrap_port: int) -> dict:
    return {
        "model_path": MODEL_PATH,
        "tokenizer_path": MODEL_PATH,
        "host": "127.0.0.1",
        "port": port,
        "tp_size": 1,
        "dp_size": 1,
        "disaggregation_mode": role,
        "disaggregation_bootstrap_port": bootstrap_port,
        "disaggregation_transfer_backend": "mooncake",
        "max_total_num_tokens": 65536,
        "internal_states": [{"disaggregation_mode": role, "weight_version": "default",
                             "last_gen_throughput": 0.0, "avg_spec_accept_length": None}],
        "version": "0.5.23",
    }


def model_info(role: str) -> dict:
    return {"model_path": MODEL_PATH, "tokenizer_path": MODEL_PATH, "is_generation": True,
            "preferred_sampling_params": None, "weight_version": "default", "has_image_understanding": False,
            "has_audio_understanding": False, "model_type": "llama", "architectures": ["LlamaForCausalLM"],
            "disaggregation_mode": role}


def models_list() -> dict:
    return {"object": "list", "data": [{"id": MODEL_PATH, "object": "model", "created": 1764400000,
                                         "owned_by": "sglang", "root": MODEL_PATH, "max_model_len": 4096}]}


def loads(role: str) -> dict:
    return {"loads": [{"dp_rank": 0, "num_running_reqs": 0, "num_waiting_reqs": 0, "num_used_tokens": 0,
                       "max_total_num_tokens": 65536, "token_usage": 0.0,
                       "disaggregation": {"mode": role}}]}


def _nginx_string(value: dict | str) -> str:
    """A JSON document as an nginx single-quoted string."""
    text = value if isinstance(value, str) else orjson.dumps(value).decode()
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _server_block(role: str, port: int, bootstrap_port: int) -> str:
    fixed = {
        "/generate": GENERATE_BODY,
        "/v1/completions": GENERATE_BODY,  # the routers relay bytes; the shape only needs to be JSON
        "/v1/chat/completions": CHAT_BODY,
        "/get_server_info": server_info(role, port, bootstrap_port),
        "/server_info": server_info(role, port, bootstrap_port),
        "/get_model_info": model_info(role),
        "/model_info": model_info(role),
        "/v1/models": models_list(),
        "/v1/loads": loads(role),
        "/get_load": {"load": 0},
    }
    lines = [f"    server {{\n        listen 127.0.0.1:{port};"]
    for path, body in fixed.items():
        lines.append(f"        location = {path} {{ return 200 {_nginx_string(body)}; }}")
    for path in ("/health", "/health_generate", "/flush_cache", "/abort_request"):
        lines.append(f"        location = {path} {{ return 200; }}")
    lines.append("        location / { return 404 '{\"error\": {\"message\": \"not found\"}}'; }")
    lines.append("    }")
    return "\n".join(lines)


def nginx_config(workdir: Path, servers: list[tuple[str, int, int]], worker_processes: int,
                 access_log: bool = False) -> str:
    log = f"access_log {workdir}/access.log;" if access_log else "access_log off;"
    blocks = "\n".join(_server_block(role, port, boot) for role, port, boot in servers)
    return f"""worker_processes {worker_processes};
daemon off;
pid {workdir}/nginx.pid;
error_log {workdir}/nginx-error.log warn;
events {{ worker_connections 8192; multi_accept on; }}
http {{
    {log}
    default_type application/json;
    keepalive_timeout 300s;
    keepalive_requests 10000000;
    client_body_buffer_size 64k;
    client_body_temp_path {workdir}/client_body;
    proxy_temp_path {workdir}/proxy;
    fastcgi_temp_path {workdir}/fastcgi;
    uwsgi_temp_path {workdir}/uwsgi;
    scgi_temp_path {workdir}/scgi;
{blocks}
}}
"""


@dataclass
class CeilingFleet:
    """nginx serving 2P+2D instant servers; a context manager that stops nginx on exit."""

    workdir: Path
    prefills: int = 2
    decodes: int = 2
    worker_processes: int = 1
    access_log: bool = False  # log every request (to see what a router calls); off when measuring
    child: procs.Child | None = None
    fleet: Fleet | None = None

    def __enter__(self) -> Fleet:
        nginx = shutil.which("nginx") or "/usr/sbin/nginx"
        if not Path(nginx).exists():
            raise RuntimeError("nginx is not installed: run `python -m bench.setup`")
        servers = [("prefill", procs.free_port(), procs.free_port()) for _ in range(self.prefills)]
        servers += [("decode", procs.free_port(), procs.free_port()) for _ in range(self.decodes)]
        self.workdir.mkdir(parents=True, exist_ok=True)
        Path(MODEL_PATH).mkdir(parents=True, exist_ok=True)
        conf = self.workdir / "nginx.conf"
        conf.write_text(nginx_config(self.workdir, servers, self.worker_processes, self.access_log))
        self.child = procs.start("nginx", [nginx, "-e", str(self.workdir / "nginx-error.log"), "-c", str(conf)],
                                 self.workdir)
        self.fleet = Fleet(
            prefill=[(f"http://127.0.0.1:{port}", boot) for role, port, boot in servers if role == "prefill"],
            decode=[f"http://127.0.0.1:{port}" for role, port, _ in servers if role == "decode"],
            pids=[self.child.pid],
        )
        try:
            for url in self.fleet.all_urls():
                procs.wait_until(lambda: procs.http_status(f"{url}/health") == 200, timeout=15,
                                 what=f"nginx answering at {url}", child=self.child)
        except BaseException:
            procs.stop(self.child)
            raise
        return self.fleet

    def __exit__(self, *exc) -> None:
        if self.child is not None:
            procs.stop(self.child)
