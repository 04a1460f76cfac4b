"""The simulator's /v1/loads against a real 0.5.23 server's, field by field, for each role, idle and busy.

The same states are made on the real pair and on a simulated pair of the same shape (4096-token KV pool, the
tiny model's context), by sending the same requests by hand, and each server's report is compared:
- the fields (recursively: names and kinds of values, simulator.conformance.shape_diff);
- the queue counts the router reads (running, waiting, every PD queue, queues.waiting / prealloc_ready), equal;
- in the states where nothing decodes, the token counts too (used, total, active, prealloc-ready tokens).
States: idle; a prefill leg alone (bootstrap queue); a decode leg alone (transfer queue: KV room taken, KV not
come); one request decoding; more requests than the decode's KV pool admits (0.5.23 reserves 512 tokens per
request: the rest wait in the decode's prealloc queue, handshake done, and their prefill legs in the prefill's
bootstrap queue). The router's attribution of each queue (policies/rebalance.py) rests on these.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest

from harness.processes import kill_when_parent_dies, record_process_group
from simulator.conformance import shape_diff

from .real_client import get_json, is_idle, request_json, wait_until
from .router_process import CHECKOUT_ROOT

SIM_ARGS = ("--api", "patched", "--context-length", "2048", "--max-total-tokens", "4096",
            "--prefix-cache-tokens", "4096", "--decode-step-s", "0.02", "--health-check-s", "0")
PROMPT_IDS = [1, 393, 390, 15, 88, 41, 77]
QUEUE_FIELDS = ("num_running_reqs", "num_waiting_reqs")
DISAGG_FIELDS = ("prefill_bootstrap_queue_reqs", "prefill_inflight_queue_reqs", "decode_prealloc_queue_reqs",
                 "decode_transfer_queue_reqs", "decode_retracted_queue_reqs")
TOKEN_FIELDS = ("num_used_tokens", "num_total_tokens", "num_active_tokens", "num_prealloc_ready_tokens")
# Values that differ by nature: clocks, memory sizes, throughput, the cumulative counters' magnitudes.
NOT_COMPARED = {"timestamp", "gen_throughput", "memory", "total_prefill_busy_us", "total_prefill_uncached_tokens",
                "decode_moments", "kv_transfer_speed_gb_s", "kv_transfer_latency_ms", "cache_hit_rate"}


class Servers:
    def __init__(self, name: str, prefill: str, decode: str, bootstrap_port: int) -> None:
        self.name, self.prefill, self.decode, self.bootstrap_port = name, prefill, decode, bootstrap_port

    def row(self, url: str) -> dict:
        (row,) = get_json(f"{url}/v1/loads")["loads"]
        return row

    def body(self, rid: str, max_new_tokens: int) -> dict:
        return {"input_ids": PROMPT_IDS, "rid": rid, "bootstrap_host": "127.0.0.1",
                "bootstrap_port": self.bootstrap_port, "bootstrap_room": random.getrandbits(63),
                "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True}}

    def send(self, url: str, body: dict, results: list) -> threading.Thread:
        thread = threading.Thread(target=lambda: results.append(request_json("POST", f"{url}/generate", body,
                                                                             timeout=120)), daemon=True)
        thread.start()
        return thread

    def wait_quiet(self) -> None:
        for url in (self.prefill, self.decode):
            wait_until(lambda: is_idle(url) and not any(self.row(url)["disaggregation"][k] for k in DISAGG_FIELDS),
                       timeout=60, what=f"{self.name}: {url} idle")


def queue_view(row: dict) -> dict:
    return {**{k: row[k] for k in QUEUE_FIELDS}, **{k: row["disaggregation"][k] for k in DISAGG_FIELDS},
            "waiting_queue": row["queues"]["waiting"], "prealloc_ready": row["queues"]["prealloc_ready"],
            "mode": row["disaggregation"]["mode"]}


def token_view(row: dict) -> dict:
    return {k: row[k] for k in TOKEN_FIELDS}


def states(side: Servers) -> dict[str, dict]:
    """Make each state on one side; its servers' rows, by state and role."""
    out: dict[str, dict] = {}
    side.wait_quiet()
    out["idle"] = {"prefill": side.row(side.prefill), "decode": side.row(side.decode)}

    results: list = []
    leg = side.send(side.prefill, side.body(f"lonely-p-{side.name}", 4), results)
    wait_until(lambda: side.row(side.prefill)["disaggregation"]["prefill_bootstrap_queue_reqs"] == 1, timeout=30,
               what=f"{side.name}: the prefill leg in the bootstrap queue")
    out["prefill_alone"] = {"prefill": side.row(side.prefill)}
    request_json("POST", f"{side.prefill}/abort_request", {"rid": f"lonely-p-{side.name}"})
    leg.join(60)

    leg = side.send(side.decode, side.body(f"lonely-d-{side.name}", 4), results)
    wait_until(lambda: side.row(side.decode)["disaggregation"]["decode_transfer_queue_reqs"] == 1, timeout=30,
               what=f"{side.name}: the decode leg in the transfer queue")
    out["decode_alone"] = {"decode": side.row(side.decode), "prefill": side.row(side.prefill)}
    request_json("POST", f"{side.decode}/abort_request", {"rid": f"lonely-d-{side.name}"})
    leg.join(60)
    side.wait_quiet()

    body = side.body(f"long-{side.name}", 300)
    legs = [side.send(url, body, results) for url in (side.prefill, side.decode)]
    def decoding_one() -> bool:  # and its KV no longer in flight on the prefill's side
        return (side.row(side.decode)["num_running_reqs"] == 1
                and side.row(side.prefill)["disaggregation"]["prefill_inflight_queue_reqs"] == 0)
    wait_until(decoding_one, timeout=30, what=f"{side.name}: one request decoding, its KV sent")
    out["decoding"] = {"decode": side.row(side.decode), "prefill": side.row(side.prefill)}
    for thread in legs:
        thread.join(120)
    side.wait_quiet()

    # 12 requests on a 4096-token pool: 7 fit (prompt + 512 reserved each, whatever the answer's length), 5 wait
    # for KV room. Answers of 400 tokens: on a quiet machine the real pair decodes 200-token answers of seven in
    # about a second, and the state was over before its last handshakes were done
    legs = []
    for i in range(12):
        body = side.body(f"many-{side.name}-{i}", 400)
        legs += [side.send(url, body, results) for url in (side.prefill, side.decode)]

    def settled() -> bool:  # the prefill's side too: the seventh KV sent, its transfer no longer in flight there
        d, p = side.row(side.decode), side.row(side.prefill)
        return (d["num_running_reqs"] == 7 and d["queues"]["prealloc_ready"] == 5
                and p["disaggregation"]["prefill_bootstrap_queue_reqs"] == 5
                and p["disaggregation"]["prefill_inflight_queue_reqs"] == 0)
    wait_until(settled, timeout=60, what=lambda: f"{side.name}: 7 decoding, 5 waiting for KV room "
                                                  f"(decode {queue_view(side.row(side.decode))}, "
                                                  f"prefill {queue_view(side.row(side.prefill))})")
    out["decode_kv_full"] = {"decode": side.row(side.decode), "prefill": side.row(side.prefill)}
    for thread in legs:
        thread.join(180)
    side.wait_quiet()
    failed = [r for r in results if r[0] not in (200, 500)]
    assert not failed, failed[:3]
    return out


@pytest.fixture(scope="module")
def simulated(stack_paths, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("simulated-loads")
    with open(log_dir / "fleet.log", "w") as log:
        fleet = subprocess.Popen(
            [sys.executable, "-m", "simulator.fleet", "--prefill", "1", "--decode", "1",
             "--model-path", str(stack_paths.tiny_model), *SIM_ARGS],
            cwd=CHECKOUT_ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log, text=True,
            start_new_session=True, preexec_fn=kill_when_parent_dies)
    record_process_group(fleet.pid)
    try:
        doc = json.loads(fleet.stdout.readline())
        (p,), (d,) = doc["prefill"], doc["decode"]
        yield Servers("sim", p["url"], d["url"], p["bootstrap_port"])
    finally:
        os.killpg(fleet.pid, signal.SIGTERM)
        try:
            fleet.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(fleet.pid, signal.SIGKILL)
            fleet.wait()
        fleet.stdout.close()


def test_simulator_reports_load_like_real_sglang(pd_pair, simulated):
    real = Servers("real", pd_pair.prefill.url, pd_pair.decode.url, pd_pair.prefill.bootstrap_port)
    started = time.monotonic()
    real_states, sim_states = states(real), states(simulated)
    diffs = []
    for state, by_role in real_states.items():
        for role, real_row in by_role.items():
            sim_row = sim_states[state][role]
            where = f"{state}.{role}"
            diffs += shape_diff({k: v for k, v in real_row.items() if k not in NOT_COMPARED},
                                {k: v for k, v in sim_row.items() if k not in NOT_COMPARED}, where)
            if queue_view(real_row) != queue_view(sim_row):
                diffs.append(f"{where} queues: real {queue_view(real_row)}, sim {queue_view(sim_row)}")
            if state in ("idle", "prefill_alone", "decode_alone") and token_view(real_row) != token_view(sim_row):
                diffs.append(f"{where} tokens: real {token_view(real_row)}, sim {token_view(sim_row)}")
        # busy states: the KV in use is reported alike in kind (something held, within the pool)
        if state in ("decoding", "decode_kv_full"):
            for side in (real_states, sim_states):
                row = side[state]["decode"]
                assert 0 < row["num_used_tokens"] <= row["max_total_num_tokens"] and row["token_usage"] > 0
    assert not diffs, "\n".join([f"/v1/loads differs ({time.monotonic() - started:.0f} s):", *diffs])
