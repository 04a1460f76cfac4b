"""The conformance scenarios: each drives a `Pair` (conformance_pair.py) and records every answer; each leaves
both servers idle and unpaused. `SCENARIOS` lists them in the order they are recorded and replayed."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any, Awaitable, Callable

import orjson

from harness.processes import free_port

from .conformance_pair import LONG_TOKENS, PROMPT, Pair, _gen, pd



async def info(pair: Pair) -> None:
    for role in ("prefill", "decode"):
        for path in (
            "/health", "/health_generate", "/ready", "/model_info", "/get_model_info", "/server_info",
            "/get_server_info", "/v1/loads", "/get_load", "/v1/models", "/metrics", "/weight_version",
        ):
            await pair.call(role, "GET", path, label=path)


async def generate_basic(pair: Pair) -> None:
    await pd(pair, "/generate", pair.pd_body(_gen()), "text")
    await pd(pair, "/generate", pair.pd_body(_gen(rid="conformance-rid-1")), "rid")
    ids = {"input_ids": [1, 20, 30, 40, 50], "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    await pd(pair, "/generate", pair.pd_body(ids), "input_ids")
    await pd(pair, "/generate", pair.pd_body(_gen(return_logprob=True, top_logprobs_num=2)), "logprob")
    await pd(pair, "/generate", pair.pd_body(_gen(4, stream=True)), "stream")
    await pd(pair, "/generate", pair.pd_body(_gen(3, stream=True, return_logprob=True)), "stream_logprob")
    await pd(pair, "/generate", pair.pd_body({"text": PROMPT}), "default_max_new_tokens")
    await pd(pair, "/generate", pair.pd_body(_gen(4, sampling_params={"max_new_tokens": 4, "stop": ["zz"]})), "stop")


async def generate_batch(pair: Pair) -> None:
    base = random.getrandbits(60)
    body = {
        "text": [PROMPT, "The quick brown fox"],
        "sampling_params": {"temperature": 0, "max_new_tokens": 3, "ignore_eos": True},
        "bootstrap_host": [pair.host, pair.host],
        "bootstrap_port": [pair.prefill_bootstrap_port, pair.prefill_bootstrap_port],
        "bootstrap_room": [base, base + 7],
    }
    await pd(pair, "/generate", body, "batch_text")
    body = dict(body, rid=["conf-b-0", "conf-b-1"], stream=True)
    body["bootstrap_room"] = [base + 20, base + 27]
    await pd(pair, "/generate", body, "batch_stream_rids")
    # a scalar room with a batch: SGLang expands it to room + i
    body = pair.pd_body({"text": [PROMPT, "The quick"], "sampling_params": {"max_new_tokens": 2}})
    await pd(pair, "/generate", body, "batch_scalar_room")
    # n > 1 on one prompt
    body = pair.pd_body({"text": PROMPT, "sampling_params": {"max_new_tokens": 2, "n": 2, "temperature": 0.5}})
    await pd(pair, "/generate", body, "parallel_n2", timeout=pair.hang(10))  # decode never answers: its warm-up waits
    await pair.wait_idle()


async def generate_errors(pair: Pair) -> None:
    for role in ("prefill", "decode"):
        await pair.call(role, "POST", "/generate", {"sampling_params": {"max_new_tokens": 2}}, label="no_input")
        await pair.call(role, "POST", "/generate", raw=b"{not json", label="bad_json")
        await pair.call(role, "POST", "/generate", {"text": PROMPT, "input_ids": [1, 2]},
                        label="text_and_ids")
        await pair.call(role, "POST", "/generate", {"text": PROMPT, "sampling_params": {"max_new_tokens": -1}},
                        label="negative_max_new_tokens")
        await pair.call(role, "POST", "/generate", {"text": PROMPT, "sampling_params": {"max_new_tokens": 5000}},
                        label="too_long")
        await pair.call(role, "POST", "/generate", {"text": 5}, label="text_not_str")
    # a decode request without any bootstrap field
    await pair.call("decode", "POST", "/generate", _gen(2), label="decode_without_bootstrap", timeout=60)
    await pair.wait_idle()


async def openai_routes(pair: Pair) -> None:
    comp = {"model": "default", "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    await pd(pair, "/v1/completions", pair.pd_body(comp), "completions")
    await pd(pair, "/v1/completions", pair.pd_body(dict(comp, stream=True)), "completions_stream")
    await pd(pair, "/v1/completions", pair.pd_body(dict(comp, logprobs=2)), "completions_logprobs")
    await pd(pair, "/v1/completions", pair.pd_body(dict(comp, prompt=[PROMPT, "The quick"])), "completions_list")
    chat = {"model": "default", "messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 4}
    await pd(pair, "/v1/chat/completions", pair.pd_body(chat), "chat")
    await pd(pair, "/v1/chat/completions", pair.pd_body(dict(chat, stream=True)), "chat_stream")
    await pd(pair, "/v1/chat/completions",
             pair.pd_body(dict(chat, stream=True, stream_options={"include_usage": True})), "chat_stream_usage")
    await pair.call("decode", "POST", "/v1/completions", {"prompt": PROMPT}, label="completions_no_model",
                    timeout=30)
    await pair.call("decode", "POST", "/v1/chat/completions", {"model": "x"}, label="chat_no_messages")
    await pair.call("decode", "POST", "/v1/completions", raw=b"prompt=x",
                    headers={"Content-Type": "application/x-www-form-urlencoded"}, label="completions_not_json")
    await pair.call("decode", "GET", "/v1/models/default", label="model_card_missing")
    await pair.wait_idle()


async def bootstrap_failures(pair: Pair) -> None:
    stale = free_port()
    await pair.call("decode", "POST", "/generate", pair.pd_body(_gen(2), port=stale), label="stale_port",
                    timeout=120)
    # the decode server's own bootstrap listener: no prefill registered there
    await pair.call("decode", "POST", "/generate", pair.pd_body(_gen(2), port=pair.decode_bootstrap_port),
                    label="decode_bootstrap_port", timeout=120)
    # bootstrap_port null: decode uses its own --disaggregation-bootstrap-port
    await pair.call("decode", "POST", "/generate", pair.pd_body(_gen(2), port=None), label="null_port",
                    timeout=120)
    await pair.wait_idle()


async def bootstrap_listener(pair: Pair) -> None:
    async def boot(port: int, path: str, label: str) -> None:
        started = time.monotonic()
        who = "prefill" if port == pair.prefill_bootstrap_port else "decode"
        step: dict[str, Any] = {"label": label, "server": f"bootstrap:{who}", "method": "GET", "path": path}
        async with pair.session.get(f"http://{pair.host}:{port}{path}") as resp:  # type: ignore[union-attr]
            step["status"] = resp.status
            step["content_type"] = resp.content_type
            data = await resp.read()
            try:
                step["json"] = orjson.loads(data)
            except orjson.JSONDecodeError:
                step["text"] = data.decode(errors="replace")
        step["elapsed_s"] = round(time.monotonic() - started, 3)
        pair.steps.append(step)

    all_ranks = "/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1"
    rank0 = "/route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0"
    for port, who in ((pair.prefill_bootstrap_port, "prefill"), (pair.decode_bootstrap_port, "decode")):
        await boot(port, "/health", f"{who}:health")
        await boot(port, "/route", f"{who}:route_no_params")
        await boot(port, all_ranks, f"{who}:route_all")
        await boot(port, rank0, f"{who}:route_rank0")


async def unpaired_legs(pair: Pair) -> None:
    """A leg whose partner never comes: abort it and record how each side answers."""
    body = pair.pd_body(_gen(4, rid="conf-lonely-prefill"))
    task = asyncio.create_task(pair.call("prefill", "POST", "/generate", body, label="prefill_alone"))
    await pair.wait_running("prefill")
    await pair.call("prefill", "POST", "/abort_request", {"rid": "conf-lonely-prefill"}, label="abort_prefill")
    await task
    body = pair.pd_body(_gen(4, rid="conf-lonely-decode"))
    task = asyncio.create_task(pair.call("decode", "POST", "/generate", body, label="decode_alone"))
    await pair.wait_running("decode")
    await pair.call("decode", "POST", "/abort_request", {"rid": "conf-lonely-decode"}, label="abort_decode")
    await task
    body = pair.pd_body(_gen(4, rid="conf-lonely-decode-stream", stream=True))
    task = asyncio.create_task(pair.call("decode", "POST", "/generate", body, label="decode_alone_stream"))
    await pair.wait_running("decode")
    await pair.call("decode", "POST", "/abort_request", {"abort_all": True}, label="abort_all_decode")
    await task
    await pair.wait_idle()


async def _long_pd(pair: Pair, label: str, **extra: Any) -> asyncio.Task:
    body = pair.pd_body(_gen(LONG_TOKENS, **extra))
    task = asyncio.create_task(pd(pair, "/generate", body, label))
    await pair.wait_running("decode")
    if pair.strict_running:
        await _wait_decoding(pair)
    return task


async def abort(pair: Pair) -> None:
    task = await _long_pd(pair, "abort_by_rid", rid="conf-abort-1")
    await pair.call("decode", "POST", "/abort_request", {"rid": "conf-abort-1"}, label="abort_rid")
    await task
    task = await _long_pd(pair, "abort_stream", rid="conf-abort-2", stream=True)
    await pair.call("decode", "POST", "/abort_request", {"rid": "conf-abort-2"}, label="abort_rid_stream")
    await task
    task = await _long_pd(pair, "abort_prefix", rid="conf-abort-prefix-xyz")
    await pair.call("decode", "POST", "/abort_request", {"rid": "conf-abort-prefix"}, label="abort_by_prefix")
    await asyncio.sleep(pair.settle_s)  # give a (wrongly) matching abort time to act
    still = await pair.loads("decode")
    pair.steps.append({"label": "after_prefix_abort", "decode_running": still["num_running_reqs"]})
    await pair.call("decode", "POST", "/abort_request", {"abort_all": True}, label="abort_all")
    await task
    await pair.call("decode", "POST", "/abort_request", {"rid": "no-such-rid"}, label="abort_unknown")
    await pair.call("decode", "POST", "/abort_request", {}, label="abort_empty")
    await pair.wait_idle()


async def client_disconnect(pair: Pair) -> None:
    body = pair.pd_body(_gen(LONG_TOKENS, rid="conf-disconnect"))
    calls = [
        asyncio.create_task(pair.call(role, "POST", "/generate", body, label=f"disconnect:{role}",
                                          timeout=pair.hang(3)))
        for role in ("prefill", "decode")
    ]
    await asyncio.gather(*calls)
    started = time.monotonic()
    await pair.wait_idle(timeout=60)
    pair.steps.append({"label": "idle_after_disconnect_s", "elapsed_s": round(time.monotonic() - started, 3)})


async def pause_modes(pair: Pair) -> None:
    for mode in ("abort", "retract", "in_place"):
        task = await _long_pd(pair, f"pause_{mode}", rid=f"conf-pause-{mode}", sampling_params={
            "temperature": 0, "max_new_tokens": 200 if mode != "abort" else LONG_TOKENS, "ignore_eos": True})
        await pair.call("decode", "POST", "/pause_generation", {"mode": mode}, label=f"pause:{mode}")
        await pair.call("decode", "POST", "/flush_cache", label=f"flush_while_paused:{mode}")
        await pair.call("decode", "GET", "/v1/loads", label=f"loads_while_paused:{mode}")
        await pair.call("decode", "POST", "/continue_generation", {}, label=f"continue:{mode}")
        await task
    await pair.wait_idle()
    # a new request sent while paused waits and completes after continue
    await pair.call("decode", "POST", "/pause_generation", {"mode": "retract"}, label="pause_idle")
    task = asyncio.create_task(pd(pair, "/generate", pair.pd_body(_gen(4)), "generate_while_paused"))
    await asyncio.sleep(pair.settle_s)  # the request must still be parked: nothing to wait on
    pair.steps.append({"label": "paused_request_done_before_continue", "value": task.done()})
    await pair.call("decode", "POST", "/continue_generation", {}, label="continue_idle")
    await task
    await pair.call("decode", "POST", "/pause_generation", label="pause_no_body")
    await pair.call("decode", "POST", "/pause_generation", {"mode": "bogus"}, label="pause_bad_mode")
    await pair.call("decode", "POST", "/continue_generation", label="continue_no_body")
    await pair.call("decode", "POST", "/continue_generation", {}, label="continue_final")
    await pair.wait_idle()


async def flush_cache(pair: Pair) -> None:
    await pair.call("decode", "POST", "/flush_cache", label="flush_idle")
    await pair.call("decode", "GET", "/flush_cache", label="flush_idle_get")
    task = await _long_pd(pair, "flush_busy", rid="conf-flush")
    await pair.call("decode", "POST", "/flush_cache", label="flush_busy")
    await pair.call("decode", "POST", "/flush_cache?timeout=1", label="flush_busy_timeout")
    await pair.call("decode", "POST", "/abort_request", {"abort_all": True}, label="abort_all")
    await task
    await pair.wait_idle()


async def weights(pair: Pair) -> None:
    info = await pair.call("decode", "GET", "/model_info", label="model_info_before")
    path = info["json"]["model_path"]
    await pair.call("decode", "POST", "/update_weights_from_disk", {"model_path": path}, label="disk_same")
    await pair.call("decode", "POST", "/update_weights_from_disk", {"model_path": path, "weight_version": "v2"},
                    label="disk_version")
    await pair.call("decode", "GET", "/model_info", label="model_info_after_disk")
    await pair.call("decode", "GET", "/server_info", label="server_info_after_disk")
    await pd(pair, "/generate", pair.pd_body(_gen(2)), "generate_after_disk")
    await pair.call("decode", "POST", "/update_weights_from_disk", {"model_path": "/nonexistent/model"},
                    label="disk_bad_path")
    await pair.call("decode", "POST", "/update_weights_from_disk", {}, label="disk_no_path")
    await pair.call("decode", "POST", "/update_weight_version", {"new_version": "v3"}, label="version_v3")
    await pair.call("decode", "POST", "/update_weight_version", {}, label="version_missing")
    await pair.call("decode", "GET", "/model_info", label="model_info_after_version")
    await pd(pair, "/generate", pair.pd_body(_gen(2)), "generate_after_version")
    await pair.call("decode", "POST", "/update_weights_from_tensor",
                    {"serialized_named_tensors": [], "weight_version": "v4"}, label="tensor_outside_session")
    await pair.call("decode", "POST", "/update_weights_from_distributed",
                    {"names": [], "dtypes": [], "shapes": [], "group_name": "g"}, label="distributed_outside_session")
    await pair.call("decode", "POST", "/begin_weight_update", {}, label="begin")
    await pair.call("decode", "POST", "/begin_weight_update", {}, label="begin_twice")
    await pair.call("decode", "POST", "/end_weight_update", {}, label="end")
    await pair.call("decode", "POST", "/end_weight_update", {}, label="end_twice")
    await pair.call("decode", "POST", "/destroy_weights_update_group", {"group_name": "nope"}, label="destroy_unknown")
    # busy + abort_all_requests: the abort is asynchronous, the update races it
    task = await _long_pd(pair, "update_busy", rid="conf-update-busy")
    await pair.call("decode", "POST", "/update_weights_from_disk",
                    {"model_path": path, "abort_all_requests": True, "weight_version": "v5"}, label="disk_busy_abort")
    await task
    await pair.wait_idle()
    await pair.call("decode", "GET", "/model_info", label="model_info_after_busy")
    await pair.call("decode", "GET", "/server_info", label="server_info_after_busy")
    # busy without abort: the update waits for the running request (write lock)
    task = await _long_pd(pair, "update_waits", rid="conf-update-wait",
                          sampling_params={"temperature": 0, "max_new_tokens": 300, "ignore_eos": True})
    await pair.call("decode", "POST", "/update_weights_from_disk", {"model_path": path, "weight_version": "v6"},
                    label="disk_busy_waits")
    await task
    await pair.call("decode", "POST", "/update_weight_version", {"new_version": "default"}, label="version_reset")
    await pair.call("prefill", "POST", "/update_weight_version", {"new_version": "default"}, label="version_reset_p")
    await pair.wait_idle()


async def role_switch(pair: Pair) -> None:
    await pair.call("prefill", "POST", "/pd_role_switch", {"new_role": "decode"}, label="to_decode_no_gb")
    await pair.call("prefill", "POST", "/pd_role_switch", {"new_role": "prefill"}, label="same_role")
    await pair.call("prefill", "POST", "/pd_role_switch", {"new_role": "bogus"}, label="bad_role")
    await pair.call("prefill", "POST", "/pd_role_switch", {}, label="no_role")
    await pair.call("prefill", "POST", "/pd_role_switch",
                    {"new_role": "decode", "decode_cuda_graph_memory_gb": 0, "prepare_only": True}, label="prepare_only")
    task = await _long_pd(pair, "switch_busy", rid="conf-switch-busy")
    await pair.call("decode", "POST", "/pd_role_switch", {"new_role": "prefill"}, label="busy_decode")
    await pair.call("decode", "POST", "/abort_request", {"abort_all": True}, label="abort_all")
    await task
    await pair.wait_idle()
    await pair.call("decode", "POST", "/pd_role_switch", {"new_role": "prefill"}, label="after_abort_decode")
    # a prefill leg waiting for its partner counts as busy
    body = pair.pd_body(_gen(2, rid="conf-switch-lonely"))
    lonely = asyncio.create_task(pair.call("prefill", "POST", "/generate", body, label="lonely_prefill"))
    await pair.wait_running("prefill")
    await pair.call("prefill", "POST", "/pd_role_switch", {"new_role": "decode", "decode_cuda_graph_memory_gb": 0},
                    label="busy_prefill_bootstrap_queue")
    await pair.call("prefill", "POST", "/abort_request", {"abort_all": True}, label="abort_lonely")
    await lonely
    await pair.wait_idle()
    # swap roles: P -> decode, D -> prefill (the decode side may refuse for a while after an abort)
    await pair.call("prefill", "POST", "/pd_role_switch", {"new_role": "decode", "decode_cuda_graph_memory_gb": 0},
                    label="p_to_decode")
    deadline = time.monotonic() + 60
    while True:
        step = await pair.call("decode", "POST", "/pd_role_switch", {"new_role": "prefill"}, label="d_to_prefill")
        if step.get("status") == 200 or time.monotonic() > deadline:
            break
        await asyncio.sleep(2)
    for role in ("prefill", "decode"):
        await pair.call(role, "GET", "/model_info", label="model_info_switched")
        await pair.call(role, "GET", "/server_info", label="server_info_switched")
        await pair.call(role, "GET", "/v1/loads", label="loads_switched")
    # generate through the swapped pair: the old decode is now prefill with its own bootstrap port
    swapped = Pair(pair.decode, pair.prefill, pair.decode_bootstrap_port, pair.prefill_bootstrap_port,
                   pair.host, pair.session, pair.steps, pair.settle_s, pair.hang_s, pair.strict_running)
    await pd(swapped, "/generate", swapped.pd_body(_gen(4)), "swapped_generate")
    # and a request routed with the old roles (to the old prefill's bootstrap port)
    stale_route = pair.pd_body(_gen(2))
    await pair.call("prefill", "POST", "/generate", stale_route, label="old_roles_to_new_decode",
                    timeout=pair.hang(40))
    await pair.wait_idle(timeout=120)
    # swap back
    await pair.call("decode", "POST", "/pd_role_switch", {"new_role": "decode", "decode_cuda_graph_memory_gb": 0},
                    label="back_d")
    await pair.call("prefill", "POST", "/pd_role_switch", {"new_role": "prefill"}, label="back_p")
    await pd(pair, "/generate", pair.pd_body(_gen(4)), "generate_after_swap_back", timeout=pair.hang(120))


async def _wait_decoding(pair: Pair, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (await pair.loads("decode"))["num_running_reqs"] >= 1:
            return
        await asyncio.sleep(0.05)
    raise TimeoutError("decode never started decoding")


async def extras(pair: Pair) -> None:
    """Input logprobs, aborts of requests that are decoding (stream, OpenAI), usage chunks, invalid streams."""
    for role in ("prefill", "decode"):
        await pair.call(role, "POST", "/generate",
                        pair.pd_body({"text": PROMPT, "stream": True, "sampling_params": {"max_new_tokens": -1}}),
                        label="stream_invalid")
        await pair.call(role, "POST", "/generate", {"text": PROMPT, "stream": True}, label="stream_without_room")
    await pd(pair, "/generate", pair.pd_body(_gen(3, return_logprob=True, logprob_start_len=0)), "input_logprobs")
    body = pair.pd_body(_gen(LONG_TOKENS, rid="conf-x-stream", stream=True))
    task = asyncio.create_task(pd(pair, "/generate", body, "abort_decoding_stream"))
    await _wait_decoding(pair)
    await pair.call("decode", "POST", "/abort_request", {"rid": "conf-x-stream"}, label="abort")
    await task
    for path, base in (("/v1/completions", {"prompt": PROMPT}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})):
        for stream in (False, True):
            rid = f"conf-x-oai{path.replace('/', '-')}-{stream}"
            body = pair.pd_body(dict(base, model="default", max_tokens=LONG_TOKENS, stream=stream, rid=rid,
                                     ignore_eos=True))
            task = asyncio.create_task(pd(pair, path, body, f"abort_openai{path}:{stream}"))
            await _wait_decoding(pair)
            await pair.call("decode", "POST", "/abort_request", {"rid": rid}, label="abort")
            await task
    comp = {"model": "default", "prompt": PROMPT, "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True}}
    await pd(pair, "/v1/completions", pair.pd_body(comp), "completions_stream_usage")
    await pd(pair, "/v1/completions", pair.pd_body(dict(comp, n=2, stream=False)), "completions_n2", timeout=pair.hang(10))
    await pair.wait_idle()
    # a transfer-phase abort when the prefill leg never came: does the decode hold its KV?
    body = pair.pd_body(_gen(4, rid="conf-x-no-prefill"))
    task = asyncio.create_task(pair.call("decode", "POST", "/generate", body, label="decode_no_prefill"))
    await pair.wait_running("decode")
    await pair.call("decode", "POST", "/abort_request", {"rid": "conf-x-no-prefill"}, label="abort")
    await task
    await pair.call("decode", "POST", "/flush_cache", label="flush_after_transfer_abort")
    await pair.call("decode", "POST", "/pd_role_switch", {"new_role": "decode"}, label="switch_same_after_abort")
    await pair.call("decode", "POST", "/pd_role_switch", {"new_role": "prefill", "prepare_only": True},
                    label="prepare_after_transfer_abort")


async def convert_api(pair: Pair) -> None:
    """0.5.23 has no /convert_pd_role: record the 404 the earlier-design API gets."""
    await pair.call("decode", "POST", "/convert_pd_role", {"server_url": pair.decode, "check_idle": True},
                    label="convert_absent")


SCENARIOS: dict[str, Callable[[Pair], Awaitable[None]]] = {
    "info": info,
    "generate_basic": generate_basic,
    "generate_batch": generate_batch,
    "generate_errors": generate_errors,
    "openai": openai_routes,
    "bootstrap_listener": bootstrap_listener,
    "bootstrap_failures": bootstrap_failures,
    "unpaired_legs": unpaired_legs,
    "abort": abort,
    "client_disconnect": client_disconnect,
    "pause": pause_modes,
    "flush_cache": flush_cache,
    "weights": weights,
    "convert_api": convert_api,
    "extras": extras,
    "role_switch": role_switch,  # last: it leaves the pair's roles as a router with stale roles would see them
}
