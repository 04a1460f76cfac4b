"""pd-router in front of a simulated 2P+2D fleet: what a user sees, through real HTTP on loopback."""

from __future__ import annotations

import openai
import orjson
import pytest

from router.server.app import create_app
from router.core.config import DISCOVER, RetryConfig, RouterConfig, WorkerSpec
from router.core.keys import REGISTRY
from simulator.fleet import Fleet
from simulator.tokens import encode, expected_generation

from .helpers import wait_for
from .sim_support import FAST


@pytest.fixture
async def fleet():
    async with Fleet(prefill=2, decode=2) as fleet:
        yield fleet


@pytest.fixture
async def router(fleet, aiohttp_client):
    config = RouterConfig(
        prefill=tuple(WorkerSpec(h.url, DISCOVER) for h in fleet.prefill),  # ports learnt from the servers
        decode=tuple(WorkerSpec(h.url) for h in fleet.decode),
    ).validated()
    client = await aiohttp_client(create_app(config), server_kwargs={"handler_cancellation": True})
    client.registry = client.app[REGISTRY]
    yield client
    await wait_for(lambda: all(w.inflight == 0 for w in client.registry.workers()),
                   message="no in-flight count leaked")


def sse(raw: bytes) -> list:
    out = []
    for block in raw.split(b"\n\n"):
        if block.startswith(b"data: "):
            out.append("[DONE]" if block[6:] == b"[DONE]" else orjson.loads(block[6:]))
    return out


async def test_learnt_bootstrap_ports_match_the_fleet(fleet, router):
    learnt = {w.url: w.bootstrap_port for w in router.registry.workers() if w.role.value == "prefill"}
    assert learnt == {h.url: h.bootstrap_port for h in fleet.prefill}


async def test_generate_answer_is_the_deterministic_one(router):
    resp = await router.post("/generate", json={"text": "The capital of France is",
                                                "sampling_params": {"max_new_tokens": 12, "temperature": 0}})
    assert resp.status == 200
    body = await resp.json()
    expected = expected_generation("The capital of France is", max_new_tokens=12)
    assert body["text"] == expected.text and body["output_ids"] == expected.output_ids
    assert body["meta_info"]["completion_tokens"] == 12


async def test_generate_batch_of_input_ids(router):
    prompts = [encode("first prompt"), encode("second, longer prompt here")]
    resp = await router.post("/generate", json={"input_ids": prompts, "sampling_params": {"max_new_tokens": 5}})
    assert resp.status == 200
    answers = await resp.json()
    assert [a["output_ids"] for a in answers] == [
        expected_generation(input_ids=p, max_new_tokens=5).output_ids for p in prompts]


async def test_streaming_generate_ends_with_done_and_full_text(router):
    resp = await router.post("/generate", json={"text": "stream me", "stream": True,
                                                "sampling_params": {"max_new_tokens": 6}})
    events = sse(await resp.read())
    assert events[-1] == "[DONE]"
    assert events[-2]["text"] == expected_generation("stream me", max_new_tokens=6).text


@pytest.mark.parametrize("stream", [False, True])
async def test_input_logprobs_come_from_prefill(router, stream):
    body = {"text": "logprobs please", "return_logprob": True, "logprob_start_len": 0, "stream": stream,
            "sampling_params": {"max_new_tokens": 3}}
    resp = await router.post("/generate", json=body)
    assert resp.status == 200
    answer = sse(await resp.read())[-2] if stream else await resp.json()
    n_input = len(encode("logprobs please"))
    assert len(answer["meta_info"]["input_token_logprobs"]) == n_input  # prefill's, merged in
    assert len(answer["meta_info"]["output_token_logprobs"]) == 3


async def test_official_openai_client_chat_and_completions(router):
    client = openai.AsyncOpenAI(base_url=str(router.make_url("/v1")), api_key="unused")
    try:
        models = await client.models.list()
        model = models.data[0].id
        chat = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hello there"}], max_tokens=7, temperature=0)
        assert chat.choices[0].message.content and chat.usage.completion_tokens == 7
        completion = await client.completions.create(model=model, prompt="Once upon a time", max_tokens=5)
        assert completion.choices[0].text == expected_generation("Once upon a time", max_new_tokens=5).text
        chunks = []
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "stream it"}], max_tokens=6, stream=True)
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                chunks.append(chunk.choices[0].delta.content)
        assert "".join(chunks)
        text = []
        stream = await client.completions.create(model=model, prompt="stream completion", max_tokens=4,
                                                 stream=True)
        async for chunk in stream:
            text.append(chunk.choices[0].text)
        assert "".join(text) == expected_generation("stream completion", max_new_tokens=4).text
    finally:
        await client.close()


async def test_openai_completions_list_prompt_and_n(router):
    resp = await router.post("/v1/completions", json={"model": "m", "prompt": ["alpha", "beta"], "max_tokens": 3})
    assert resp.status == 200
    texts = sorted(c["text"] for c in (await resp.json())["choices"])
    assert texts == sorted(expected_generation(p, max_new_tokens=3).text for p in ("alpha", "beta"))


async def test_stale_bootstrap_port_fails_cleanly_not_hangs(aiohttp_client):
    """A prefill registered with a wrong bootstrap port: decode cannot reach its bootstrap server and fails
    the request the way SGLang does (500, after its handshake retries); the router relays that error and
    aborts the prefill leg, which would otherwise wait for a decode that never comes."""
    async with Fleet(prefill=1, decode=1, **FAST) as fleet:
        config = RouterConfig(prefill=(WorkerSpec(fleet.prefill[0].url, 1),),  # nothing listens on port 1
                              decode=(WorkerSpec(fleet.decode[0].url),),
                              retry=RetryConfig(enabled=False)).validated()
        client = await aiohttp_client(create_app(config), server_kwargs={"handler_cancellation": True})
        resp = await client.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 2}})
        assert resp.status == 500
        body = await resp.json()
        assert "bootstrap" in body["message"].lower() or "handshake" in body["message"].lower()
        await wait_for(lambda: all(w.inflight == 0 for w in client.app[REGISTRY].workers()))

        async def prefill_idle():
            state = await fleet.state(fleet.prefill[0])
            return not state["running_rids"] and not state["waiting_rids"] and not state["inflight_calls"]
        await wait_for(prefill_idle, message="prefill leg aborted, not left waiting for decode")


CHAT = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": CHAT, "n": "2", "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": CHAT, "n": 2, "max_tokens": 2, "stream": True}),
    ("/v1/completions", {"prompt": "hi", "n": "2", "max_tokens": 2}),
    ("/v1/completions", {"prompt": "hi", "n": 2.0, "max_tokens": 2}),
    ("/generate", {"text": "hi", "sampling_params": {"n": 2, "max_new_tokens": 2}}),
], ids=["chat-text", "chat-stream", "completions-text", "completions-float", "generate"])
async def test_n_above_one_is_a_400_saying_why_not_the_servers_500(fleet, router, path, body):
    """SGLang 0.5.23's decode server waits for the KV of an n > 1 request's warm-up, which no prefill sends: the
    servers' answer is a 500 after the KV timeout, whatever the router sends. The client gets a 400 at once."""
    resp = await router.post(path, json=body)
    assert resp.status == 400, await resp.text()
    error = (await resp.json())["error"]
    assert error["param"] in ("n", "sampling_params.n") and "n > 1" in error["message"]
    reached = [(await fleet.state(h))["counters"]["requests_by_route"] for h in fleet.workers]
    assert reached == [{}] * len(fleet.workers)  # refused before anything was sent


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": CHAT, "n": "1", "max_tokens": 2}),
    ("/v1/completions", {"prompt": "hi", "n": 1.0, "max_tokens": 2}),
    ("/generate", {"text": "hi", "sampling_params": {"n": 1, "max_new_tokens": 2}}),
])
async def test_n_of_one_written_any_way_is_served(router, path, body):
    resp = await router.post(path, json=body)
    assert resp.status == 200, await resp.text()
