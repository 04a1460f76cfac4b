"""pd-router in front of the simulator answers like pd-router in front of real SGLang, call for call.

The same router-level scenarios this tier runs (generation, errors, control, conversion) go to two routers: one
in front of the real fleet (1P+2D), one in front of a simulated fleet of the same shape. Compared, per call, with
the fidelity test's rules (simulator.conformance.shape_diff): status codes, keys (recursively), kinds of values,
error messages (ids and numbers normalised); and the values that say what happened (SAME_VALUES: finish
reasons, outcomes, roles, versions, success). Token ids, texts and timings differ by nature.
tests/test_simulator_fidelity.py does the same against recorded server-level answers; this one is live and goes
through the router. Every difference left is listed in INHERENT with its reason; an unlisted difference, or a
listed one that went away, fails the test.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field

import pytest

from harness.processes import kill_when_parent_dies, record_process_group
from simulator.conformance import normalize_message, shape_diff

from .conftest import ROUTER_ARGS
from .real_client import fully_idle, get_json, request_json, running_requests, stream_events, wait_until
from .router_process import CHECKOUT_ROOT, RouterProcess

PROMPT = "Hello world, this is"
SHORT = {"temperature": 0, "max_new_tokens": 6}
LONG = {"temperature": 0, "max_new_tokens": 1500, "ignore_eos": True}
# Like the real fleet: server_patches' APIs, the tiny Llama's 2048-token context and 4096-token pool, a prefix
# cache (the real fleet runs with it), real-like decode pace; /health without its one-second wait.
SIM_ARGS = ("--api", "patched", "--context-length", "2048", "--max-total-tokens", "4096",
            "--prefix-cache-tokens", "4096", "--decode-step-s", "0.02", "--health-check-s", "0")
CONVERSION_TIMEOUT_S = 180.0

# Differences that remain, each with its reason (the diff text, as shape_diff and compare() word it).
INHERENT: dict[str, str] = {}


@dataclass
class Side:
    name: str
    router: str
    prefill: str
    decode: str
    spare: str
    steps: dict = field(default_factory=dict)

    def call(self, label: str, method: str, path: str, body=None, *, stream: bool = False, timeout: float = 60):
        url = self.router + path
        if stream:
            status, events = stream_events(url, dict(body, stream=True), timeout=timeout)
            step = {"status": status, "events": events}
        else:
            status, data = request_json(method, url, body, timeout=timeout)
            step = {"status": status, "json": data}
        self.steps[label] = step
        return step


# ---- scenarios: each runs on one side and records its steps ------------------------------------------------
def generation(side: Side) -> None:
    side.call("warm_up", "POST", "/generate", {"text": PROMPT, "sampling_params": SHORT})  # prefix cached from now
    del side.steps["warm_up"]  # (whether the real one had it cached already depends on the tests before)
    side.call("generate", "POST", "/generate", {"text": PROMPT, "sampling_params": SHORT})
    side.call("generate_stream", "POST", "/generate", {"text": PROMPT, "sampling_params": SHORT}, stream=True)
    side.call("generate_ids", "POST", "/generate", {"input_ids": [1, 393, 390, 15], "sampling_params": SHORT})
    side.call("generate_batch", "POST", "/generate", {"text": [PROMPT, "The quick"], "sampling_params": SHORT})
    side.call("generate_logprob", "POST", "/generate", {"text": PROMPT, "sampling_params": SHORT,
                                                        "return_logprob": True, "logprob_start_len": 0,
                                                        "top_logprobs_num": 2})
    completion = {"model": "tiny", "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 1}
    side.call("completions", "POST", "/v1/completions", completion)
    side.call("completions_stream", "POST", "/v1/completions", completion, stream=True)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 6, "temperature": 0}
    side.call("chat", "POST", "/v1/chat/completions", chat)
    side.call("chat_stream", "POST", "/v1/chat/completions", chat, stream=True)


def errors(side: Side) -> None:
    side.call("no_input", "POST", "/generate", {"sampling_params": SHORT})
    side.call("negative_max_new_tokens", "POST", "/generate", {"text": PROMPT,
                                                               "sampling_params": {"max_new_tokens": -1}})
    side.call("negative_temperature", "POST", "/generate", {"text": PROMPT, "sampling_params": {"temperature": -1}})
    side.call("too_long", "POST", "/generate", {"input_ids": [5] * 2100, "sampling_params": SHORT})
    side.call("not_json", "POST", "/generate", b"{not json")
    side.call("chat_no_messages", "POST", "/v1/chat/completions", {"model": "tiny", "max_tokens": 4})
    side.call("unknown_worker", "POST", "/pd_role_switch", {"worker_url": "http://127.0.0.1:1", "new_role": "decode"})
    side.call("last_prefill", "POST", "/convert_pd_role", {"server_url": side.prefill})
    side.call("bad_pause_mode", "POST", "/pause_generation", {"mode": "sideways"})


def info(side: Side) -> None:
    side.call("health", "GET", "/health")
    side.call("models", "GET", "/v1/models")
    side.call("model_info", "GET", "/model_info")
    side.call("server_info", "GET", "/server_info")
    side.call("get_weight_version", "GET", "/get_weight_version")
    side.call("flush_cache", "POST", "/flush_cache", {})


def _decoding(side: Side, body: dict) -> dict:
    """Start a long streaming request in a thread; return its holder once it decodes."""
    holder: dict = {}
    thread = threading.Thread(target=lambda: holder.update(result=stream_events(
        side.router + "/generate", dict(body, stream=True), timeout=120)), daemon=True)
    thread.start()
    holder["thread"] = thread
    wait_until(lambda: sum(running_requests(u) for u in (side.decode, side.spare)) >= 1 or "result" in holder,
               timeout=60, what=f"{side.name}: the long request decodes")
    return holder


def _ended(holder: dict) -> dict:
    holder["thread"].join(60)
    status, events = holder["result"]
    return {"status": status, "events": events}


def control(side: Side, model_path: str) -> None:
    running = _decoding(side, {"text": PROMPT, "sampling_params": LONG})
    side.call("abort_all", "POST", "/abort_request", {"abort_all": True})
    side.steps["aborted_stream"] = _ended(running)
    running = _decoding(side, {"text": PROMPT, "sampling_params": LONG, "rid": f"cmp-{side.name}"})
    side.call("abort_rid", "POST", "/abort_request", {"rid": f"cmp-{side.name}"})
    side.steps["aborted_by_rid"] = _ended(running)
    running = _decoding(side, {"text": PROMPT, "sampling_params": LONG})
    side.call("pause_abort", "POST", "/pause_generation", {"mode": "abort"})
    side.steps["paused_stream"] = _ended(running)
    side.call("weight_updates_paused", "GET", "/weight_updates")
    side.call("continue", "POST", "/continue_generation", {})
    for server in (side.prefill, side.decode, side.spare):
        wait_until(lambda: fully_idle(server), timeout=60, what=f"{side.name}: {server} idle")
    running = _decoding(side, {"text": PROMPT, "sampling_params": LONG})
    side.call("update_weights", "POST", "/update_weights_from_disk",
              {"model_path": model_path, "abort_all_requests": True, "weight_version": "cmp-v2"}, timeout=180)
    side.steps["updated_stream"] = _ended(running)
    side.call("generate_after_update", "POST", "/generate", {"text": PROMPT, "sampling_params": SHORT})
    side.call("weight_version_after_update", "GET", "/get_weight_version")
    side.call("update_back", "POST", "/update_weights_from_disk",
              {"model_path": model_path, "abort_all_requests": True, "weight_version": "default"}, timeout=180)


def conversion(side: Side) -> None:
    def record(label: str, answer: dict) -> None:
        conversion_id = (answer.get("json") or {}).get("conversion_id")
        if conversion_id:
            side.call(label + "_record", "GET", f"/admin/conversions/{conversion_id}")

    record("spare_to_prefill", side.call("spare_to_prefill", "POST", "/pd_role_switch",
                                         {"worker_url": side.spare, "new_role": "prefill"},
                                         timeout=CONVERSION_TIMEOUT_S))
    record("prefill_to_decode", side.call("prefill_to_decode", "POST", "/convert_pd_role",
                                          {"server_url": side.prefill}, timeout=CONVERSION_TIMEOUT_S))
    side.call("generate_swapped", "POST", "/generate", {"text": PROMPT, "sampling_params": SHORT})
    side.call("workers_swapped", "GET", "/workers")
    record("prefill_back", side.call("prefill_back", "POST", "/convert_pd_role", {"server_url": side.prefill},
                                     timeout=CONVERSION_TIMEOUT_S))
    record("spare_back", side.call("spare_back", "POST", "/pd_role_switch",
                                   {"worker_url": side.spare, "new_role": "decode"}, timeout=CONVERSION_TIMEOUT_S))


# ---- the simulated side ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def simulated(stack_paths, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("simulated")
    with open(log_dir / "fleet.log", "w") as log:
        fleet = subprocess.Popen(
            [sys.executable, "-m", "simulator.fleet", "--prefill", "1", "--decode", "2",
             "--model-path", str(stack_paths.tiny_model), *SIM_ARGS],
            cwd=CHECKOUT_ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log, text=True,
            start_new_session=True, preexec_fn=kill_when_parent_dies)
    record_process_group(fleet.pid)
    router = None
    try:
        doc = json.loads(fleet.stdout.readline())
        (p,), (d, s) = doc["prefill"], doc["decode"]
        router = RouterProcess.start(prefill=[(p["url"], p["bootstrap_port"])], decode=[d["url"], s["url"]],
                                     log_path=log_dir / "router.log", extra_args=ROUTER_ARGS)
        yield Side("sim", router.url, p["url"], d["url"], s["url"])
    finally:
        if router is not None:
            router.stop()
        os.killpg(fleet.pid, signal.SIGTERM)
        try:
            fleet.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(fleet.pid, signal.SIGKILL)
            fleet.wait()
        fleet.stdout.close()


# Values compared too (wherever these keys appear): outcomes, roles, versions, finish reasons.
SAME_VALUES = frozenset({"success", "outcome", "old_role", "new_role", "role", "state", "paused", "consistent",
                         "routable", "weight_version", "finish_reason", "type", "safe_to_restore", "status_code",
                         "object", "in_progress", "api"})


def value_diff(real, sim, path: str) -> list[str]:
    """Differences of the SAME_VALUES keys' values, walking both answers alike (lists: first and last items)."""
    diffs = []
    if isinstance(real, dict) and isinstance(sim, dict):
        for key in real.keys() & sim.keys():
            if key in SAME_VALUES and not isinstance(real[key], (dict, list)) and real[key] != sim[key]:
                diffs.append(f"{path}.{key}: {real[key]!r} on real, {sim[key]!r} on sim")
            else:
                diffs.extend(value_diff(real[key], sim[key], f"{path}.{key}"))
    elif isinstance(real, list) and isinstance(sim, list) and real and sim:
        diffs.extend(value_diff(real[0], sim[0], f"{path}[0]"))
        if len(real) > 1 and len(sim) > 1:
            diffs.extend(value_diff(real[-1], sim[-1], f"{path}[-1]"))
    return diffs


def compare(real: Side, sim: Side) -> list[str]:
    diffs = []
    if set(real.steps) != set(sim.steps):
        diffs.append(f"steps: {sorted(set(real.steps) ^ set(sim.steps))} on one side only")
    for label in real.steps.keys() & sim.steps.keys():
        r, s = real.steps[label], sim.steps[label]
        if r["status"] != s["status"]:
            diffs.append(f"{label}.status: {r['status']!r} on real, {s['status']!r} on sim")
        for key in ("json", "events"):
            if key in r and key in s:
                if isinstance(r[key], str) and isinstance(s[key], str):
                    if normalize_message(r[key]) != normalize_message(s[key]):
                        diffs.append(f"{label}.{key}: {r[key]!r} on real, {s[key]!r} on sim")
                else:
                    diffs.extend(shape_diff(r[key], s[key], f"{label}.{key}"))
                    diffs.extend(value_diff(r[key], s[key], f"{label}.{key}"))
    return sorted(set(diffs))


def test_router_answers_alike_in_front_of_the_simulator_and_real_sglang(router, fleet, simulated):
    real = Side("real", router.url, fleet.prefill.url, fleet.decode.url, fleet.spare.url)
    model_path = get_json(f"{fleet.prefill.url}/model_info")["model_path"]
    for side in (real, simulated):
        generation(side)
        errors(side)
        info(side)
        control(side, model_path)
        conversion(side)
    found = compare(real, simulated)
    unexpected = [d for d in found if d not in INHERENT]
    gone = [d for d in INHERENT if d not in found]
    assert not unexpected and not gone, "\n".join(
        ["differences between pd-router+simulator and pd-router+real SGLang:", *unexpected,
         "listed as inherent but gone:", *gone])
