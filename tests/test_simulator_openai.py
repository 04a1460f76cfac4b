"""OpenAI routes on simulated workers: shapes of SGLang 0.5.23, PD legs, streams, errors."""

from __future__ import annotations


from simulator.tokens import apply_chat_template, encode, expected_generation
from tests.sim_support import get, pd_generate, post

PROMPT = "Hello world, this is"


async def test_completion(fleet, session):
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 4, "rid": "c1"}
    (ps, pout), (ds, dout) = await pd_generate(session, fleet, body, path="/v1/completions")
    assert (ps, ds) == (200, 200)
    want = expected_generation(PROMPT, max_new_tokens=4)
    assert list(dout) == ["id", "object", "created", "model", "choices", "usage", "metadata"]
    assert dout["id"] == "c1" and dout["object"] == "text_completion" and dout["model"] == "m"
    assert dout["choices"] == [{"index": 0, "text": want.text, "logprobs": None, "finish_reason": "length",
                                "matched_stop": None}]
    assert dout["usage"] == {"prompt_tokens": want.prompt_tokens, "total_tokens": want.prompt_tokens + 4,
                             "completion_tokens": 4, "prompt_tokens_details": None, "reasoning_tokens": 0,
                             "completion_tokens_details": None}
    assert dout["metadata"] == {"weight_version": "default",
                                "weight_versions": [{"version": "default", "start": 0, "end": 4}]}
    assert pout["usage"]["completion_tokens"] == 1


async def test_completion_default_max_tokens_is_16(fleet, session):
    _, (_, dout) = await pd_generate(session, fleet, {"prompt": PROMPT}, path="/v1/completions")
    assert dout["usage"]["completion_tokens"] == 16


async def test_completion_stream_deltas_and_usage(fleet, session):
    body = {"prompt": PROMPT, "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}
    _, (ds, events) = await pd_generate(session, fleet, body, path="/v1/completions")
    assert ds == 200 and events[-1] == "[DONE]"
    deltas = [e["choices"][0]["text"] for e in events[:-2]]
    assert "".join(deltas) == expected_generation(PROMPT, max_new_tokens=3).text
    assert [e["choices"][0]["finish_reason"] for e in events[:-2]] == [None, None, "length"]
    assert events[-2]["choices"] == [] and events[-2]["usage"] == {
        "prompt_tokens": 5, "total_tokens": 8, "completion_tokens": 3, "reasoning_tokens": 0}


async def test_completion_prompt_list_gets_a_room_per_prompt(fleet, session):
    body = {"prompt": [PROMPT, "The quick"], "max_tokens": 2}
    (ps, pout), (ds, dout) = await pd_generate(session, fleet, body, path="/v1/completions", room=90)
    assert (ps, ds) == (200, 200)
    assert [c["index"] for c in dout["choices"]] == [0, 1]
    assert dout["choices"][1]["text"] == expected_generation("The quick", max_new_tokens=2).text
    assert (await fleet.state(fleet.prefill[0]))["counters"]["kv_pulls_served"] == 2


async def test_completion_logprobs(fleet, session):
    _, (_, dout) = await pd_generate(session, fleet, {"prompt": PROMPT, "max_tokens": 2, "logprobs": 2},
                                     path="/v1/completions")
    lp = dout["choices"][0]["logprobs"]
    assert list(lp) == ["text_offset", "token_logprobs", "tokens", "top_logprobs"]
    assert len(lp["tokens"]) == 2 and len(lp["top_logprobs"][0]) == 2


async def test_chat(fleet, session):
    messages = [{"role": "user", "content": "Hi there"}]
    (ps, _), (ds, dout) = await pd_generate(session, fleet, {"model": "m", "messages": messages, "max_tokens": 4},
                                            path="/v1/chat/completions")
    assert (ps, ds) == (200, 200)
    ids = encode(apply_chat_template(messages))
    want = expected_generation(input_ids=ids, max_new_tokens=4)
    assert dout["object"] == "chat.completion"
    assert dout["choices"][0]["message"] == {"role": "assistant", "content": want.text, "reasoning_content": None}
    assert dout["usage"]["prompt_tokens"] == len(ids)


async def test_chat_stream(fleet, session):
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stream": True,
            "stream_options": {"include_usage": True}}
    _, (ds, events) = await pd_generate(session, fleet, body, path="/v1/chat/completions")
    assert ds == 200 and events[-1] == "[DONE]"
    assert events[0]["choices"][0]["delta"] == {"reasoning_content": None, "role": "assistant", "content": ""}
    assert all(e["object"] == "chat.completion.chunk" for e in events[:-1])
    finish = events[-3]["choices"][0]
    assert finish["delta"] == {"reasoning_content": None} and finish["finish_reason"] == "length"
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 2


async def test_models_and_model_card(fleet, session):
    status, out = await get(session, fleet.decode[0].url + "/v1/models")
    assert status == 200 and out["object"] == "list" and out["data"][0]["id"] == "sim/tiny-llama"
    assert out["data"][0]["owned_by"] == "sglang" and out["data"][0]["max_model_len"] == 8192
    status, out = await get(session, fleet.decode[0].url + "/v1/models/default")
    assert status == 404 and out["error"]["code"] == "model_not_found"
    assert (await get(session, fleet.decode[0].url + "/v1/models/sim/tiny-llama"))[0] == 200


async def test_errors(fleet, session):
    url = fleet.decode[0].url
    status, out = await post(session, url + "/v1/completions", {"prompt": PROMPT})
    assert status == 400 and out["type"] == "BadRequestError"
    assert out["message"].startswith("Invalid request: Disaggregated request received without bootstrap room id.")
    status, out = await post(session, url + "/v1/chat/completions", {"model": "x"})
    assert status == 400 and "'msg': 'Field required'" in out["message"]
    async with session.post(url + "/v1/completions", data=b"prompt=x",
                            headers={"Content-Type": "application/x-www-form-urlencoded"}) as r:
        assert r.status == 400 and "Only 'application/json' is allowed" in (await r.json())["message"]


async def test_stream_failure_is_an_error_chunk(fleet, session):
    body = {"prompt": PROMPT, "stream": True, "bootstrap_host": "127.0.0.1", "bootstrap_port": 1,
            "bootstrap_room": 3}
    status, events = await post(session, fleet.decode[0].url + "/v1/completions", body)
    assert status == 200 and events[-1] == "[DONE]"
    err = events[0]["error"]
    assert err["code"] == 500 and err["type"] == "INTERNAL_SERVER_ERROR"
    assert err["message"].startswith("Decode handshake failed")


async def test_openai_routes_are_counted(fleet, session):
    await pd_generate(session, fleet, {"prompt": PROMPT, "max_tokens": 1}, path="/v1/completions")
    await pd_generate(session, fleet, {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1},
                      path="/v1/chat/completions")
    by_route = (await fleet.state(fleet.decode[0]))["counters"]["requests_by_route"]
    assert by_route == {"completions": 1, "chat_completions": 1}
