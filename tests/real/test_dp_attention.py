"""Attention DP on real SGLang 0.5.23 (CPU): a prefill and a decode server started with `--tp-size 2 --dp-size 2
--enable-dp-attention` (0.5.23 asserts tp_size % attn_dp_size == 0), and pd-router with `--dp-aware` in front
(docs/DP_RANKS.md).

0.5.23 cannot run it on this CPU stack, and the module says so as a skip: under attention DP its scheduler pads
every batch for the MLP sync (`ForwardBatch.prepare_mlp_sync_batch` -> `_pad_inputs_to_size`), which on CPU
calls `attn_backend.get_cpu_graph_seq_len_fill_value()`; `TorchNativeAttnBackend`, the CPU attention backend this
stack runs, has no such method, so the first forward raises AttributeError and the server never becomes healthy
(seen here, after the two launch problems below were solved). The check reads the installed source (no server
started: the skip costs nothing); a stack whose backend has the method runs the tests.

Launching it at all needs, on this machine: ports below the kernel's ephemeral range (0.5.23 derives its
processes' TCP ports from `--port` + 233; an ephemeral port has them taken by the server's own connections now
and then: "dist_init_port ... is used by a process already"), named with `--dist-init-addr`; and
`SGLANG_CPU_OMP_THREADS_BIND` (0.5.23 refuses more CPU ranks than NUMA nodes without it).

When it runs: `/server_info` says dp_size 1, attn_dp_size 2, enable_dp_attention true, `/v1/loads` has two rows, a
prefill leg moved off its room's rank without `disagg_prefill_dp_rank` fails the conflict check (500, 0.5.23's
words), and the router serves on both ranks of each server without one failure. These two servers run only for
this module, first in the tier (before the session's fleet starts), and are stopped at its end.
"""

from __future__ import annotations

import os
import random
import socket

import pytest

from server_patches.pair import HOST, PairError, RealServer, ensure_tiny_model, wait_healthy

from .real_client import get_json, post_json
from .router_process import RouterProcess

DP_ARGS = ("--tp-size", "2", "--dp-size", "2", "--enable-dp-attention")
START_TIMEOUT_S = 240.0
# Under attention DP 0.5.23 talks between its processes over TCP on ports derived from the server's: its
# `--port` + 233 (dist_init_port) and the six after it. A port from the kernel's ephemeral range has those
# taken by the server's own outgoing connections now and then ("dist_init_port ... is used by a process
# already", seen here): the servers get ports below that range, and --dist-init-addr names the block.
LOW_PORTS = (20000, 32000)


def _port_block(count: int) -> int:
    """The first of `count` consecutive free ports below the ephemeral range."""
    for _ in range(200):
        base = random.randrange(LOW_PORTS[0], LOW_PORTS[1] - count)
        sockets = []
        try:
            for port in range(base, base + count):
                sock = socket.socket()
                sockets.append(sock)
                sock.bind((HOST, port))
            return base
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise RuntimeError(f"no {count} consecutive free ports in {LOW_PORTS}")


def _reason(log_tail: str) -> str:
    """The error a failed launch ended on (the last traceback's last line, else the log's last lines)."""
    lines = [line.strip() for line in log_tail.splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or line.startswith("assert") or "error" in line.lower()]
    return (errors[-1] if errors else " | ".join(lines[-3:]))[:500]


def cpu_blocker(venv) -> str | None:
    """Why the installed SGLang cannot serve attention DP on CPU (None: nothing known stops it)."""
    site = next(iter(sorted(venv.glob("lib/python3*/site-packages/sglang/srt"))), None)
    if site is None:
        return "no sglang/srt in the stack's venv"
    padding = (site / "model_executor" / "forward_batch_info.py").read_text()
    backend = (site / "layers" / "attention" / "torch_native_backend.py").read_text()
    if "get_cpu_graph_seq_len_fill_value()" in padding and "def get_cpu_graph_seq_len_fill_value" not in backend:
        return ("its attention-DP batch padding (ForwardBatch._pad_inputs_to_size, for the MLP sync) calls "
                "attn_backend.get_cpu_graph_seq_len_fill_value() on CPU, which TorchNativeAttnBackend (the CPU "
                "attention backend) does not have: AttributeError: 'TorchNativeAttnBackend' object has no attribute "
                "'get_cpu_graph_seq_len_fill_value' at the first forward, and the server never becomes healthy")
    return None


@pytest.fixture(scope="module")
def dp_servers(stack_paths, tmp_path_factory):
    blocker = cpu_blocker(stack_paths.venv)
    if blocker is not None:
        pytest.skip(f"SGLang 0.5.23 cannot run {' '.join(DP_ARGS)} on CPU: {blocker}")
    # 0.5.23 on CPU binds each TP rank to a NUMA node and refuses more ranks than nodes unless told which cores
    # each rank gets: one core each here (the servers' processes inherit the environment)
    cores = os.cpu_count() or 2
    bind = os.environ.get("SGLANG_CPU_OMP_THREADS_BIND") or ("0|1" if cores < 4 else f"0-{cores // 2 - 1}|"
                                                                                     f"{cores // 2}-{cores - 1}")
    previous = os.environ.get("SGLANG_CPU_OMP_THREADS_BIND")
    model = ensure_tiny_model(stack_paths)
    logs = tmp_path_factory.mktemp("dp-attention")
    servers = []
    os.environ["SGLANG_CPU_OMP_THREADS_BIND"] = bind
    try:
        for role in ("prefill", "decode"):
            base = _port_block(10)  # HTTP, bootstrap, then dist_init and the six 0.5.23 derives from it
            servers.append(RealServer.launch(role, paths=stack_paths, model=model, log_path=logs / f"{role}.log",
                                             port=base, bootstrap_port=base + 1,
                                             extra_args=(*DP_ARGS, "--dist-init-addr", f"{HOST}:{base + 2}"),
                                             die_with_parent=True))
        try:
            wait_healthy(servers, START_TIMEOUT_S)
        except PairError as exc:
            failed = next((s for s in servers if not s.alive()), servers[0])
            pytest.skip(f"SGLang 0.5.23 cannot run {' '.join(DP_ARGS)} on CPU: {_reason(failed.log_tail(40))} "
                        f"({str(exc).splitlines()[0]})")
        yield servers
    finally:
        for server in servers:
            server.stop(10)
        if previous is None:
            os.environ.pop("SGLANG_CPU_OMP_THREADS_BIND", None)
        else:
            os.environ["SGLANG_CPU_OMP_THREADS_BIND"] = previous


def test_server_info_and_loads_report_attention_dp_ranks(dp_servers):
    for server in dp_servers:
        info = get_json(f"{server.url}/server_info")
        assert (info["dp_size"], info["attn_dp_size"], info["enable_dp_attention"]) == (1, 2, True)
        assert [row["dp_rank"] for row in get_json(f"{server.url}/v1/loads")["loads"]] == [0, 1]


def test_a_prefill_moved_off_its_rooms_rank_without_the_prefill_rank_fails_the_conflict_check(dp_servers):
    prefill = dp_servers[0]
    room = 2 * random.getrandbits(40)  # even: rank 0 by the room
    body = {"text": "hello", "bootstrap_host": "127.0.0.1", "bootstrap_port": prefill.bootstrap_port,
            "bootstrap_room": room, "routed_dp_rank": 1, "sampling_params": {"max_new_tokens": 2}}
    status, answer = post_json(f"{prefill.url}/generate", body, timeout=60)
    assert status == 500, answer
    assert "follow_bootstrap_room conflict: dispatched to dp_rank 1" in str(answer)


def test_dp_aware_router_serves_on_both_ranks_without_a_failure(dp_servers, tmp_path):
    prefill, decode = dp_servers
    router = RouterProcess.start(prefill=[(prefill.url, prefill.bootstrap_port)], decode=[decode.url],
                                 log_path=tmp_path / "router.log",
                                 extra_args=("--dp-aware", "--rebalance", "off", "--health-check-interval-secs",
                                             "10"))
    try:
        workers = {w["role"]: w for w in router.workers()}
        assert workers["prefill"]["dp_ranks"] == 2 and workers["decode"]["dp_ranks"] == 2
        before = [row["total_prefill_uncached_tokens"] for row in get_json(f"{prefill.url}/v1/loads")["loads"]]
        for i in range(8):
            status, answer = post_json(f"{router.url}/generate", {"text": f"question {i}",
                                                                  "sampling_params": {"max_new_tokens": 4}},
                                       timeout=120)
            assert status == 200, answer
        after = [row["total_prefill_uncached_tokens"] for row in get_json(f"{prefill.url}/v1/loads")["loads"]]
        assert all(b > a for a, b in zip(before, after)), (before, after)  # both prefill ranks served
        assert "answered 500" not in router.log()  # no leg failed (no conflict, no KV pulled from the wrong rank)
    finally:
        router.stop()
