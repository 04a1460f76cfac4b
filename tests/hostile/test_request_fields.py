"""The fields the router reads or injects are judged before anything is sent: what SGLang 0.5.23 refuses (or
fails on) is a 400 JSON error naming the field, and nothing reaches a worker; what it accepts is served.

The cases come from SGLang 0.5.23 itself: its `/generate` contract gate and `GenerateReqInput` normalisation,
the OpenAI routes' pydantic models (lax mode), and real servers' answers (`input_ids: [[]]` killed the
scheduler of every server it reached; a list rid for one prompt is their 500).
"""

from __future__ import annotations

import contextlib

import orjson
import pytest

from router.core.config import AdmissionConfig
from router.dataplane.admission import ADMISSION

from ..helpers import wait_for

CHAT = [{"role": "user", "content": "hi"}]
G, C, CH = "/generate", "/v1/completions", "/v1/chat/completions"

REFUSED = [
    (G, {}, "text"),
    (G, {"sampling_params": {"max_new_tokens": 2}, "rid": "r"}, "text"),
    (G, {"text": "x", "sampling_params": "x"}, "sampling_params"),
    (G, {"text": "x", "sampling_params": []}, "sampling_params"),
    (G, {"text": "x", "sampling_params": [7]}, "sampling_params"),
    (G, {"text": "x", "sampling_params": [{"max_new_tokens": 2}]}, "sampling_params"),  # a list for one prompt
    (G, {"text": ["a", "b"], "sampling_params": [{"max_new_tokens": 2}]}, "sampling_params"),
    (G, {"text": ["a", "b"], "sampling_params": [{"n": 2}, {"n": 3}]}, "sampling_params.n"),
    (G, {"text": "x", "sampling_params": {"max_new_tokens": "abc"}}, "sampling_params.max_new_tokens"),
    (G, {"text": "x", "sampling_params": {"max_new_tokens": 2.0}}, "sampling_params.max_new_tokens"),
    (G, {"text": "x", "sampling_params": {"max_new_tokens": True}}, "sampling_params.max_new_tokens"),
    (G, {"text": "x", "sampling_params": {"max_new_tokens": -1}}, "sampling_params.max_new_tokens"),
    (G, {"text": "x", "sampling_params": {"n": "2"}}, "sampling_params.n"),
    (G, {"text": "x", "sampling_params": {"n": 0}}, "sampling_params.n"),
    (G, {"text": "x", "rid": {"a": 1}}, "rid"),
    (G, {"text": "x", "rid": 5}, "rid"),
    (G, {"text": "x", "rid": ["solo"]}, "rid"),  # one prompt: SGLang keys its state by the rid (500)
    (G, {"text": ["a", "b"], "rid": ["x"]}, "rid"),
    (G, {"text": ["a", "b"], "rid": ["x", 5]}, "rid"),
    (G, {"text": 5}, "text"),
    (G, {"text": ["a", 5]}, "text"),
    (G, {"text": []}, "text"),
    (G, {"input_ids": "1 2"}, "input_ids"),
    (G, {"input_ids": []}, "input_ids"),
    (G, {"input_ids": [[]]}, "input_ids"),  # killed the scheduler of real 0.5.23 servers
    (G, {"input_ids": [[1, 2], []]}, "input_ids"),
    (G, {"input_ids": [[1], 2]}, "input_ids"),
    (G, {"input_ids": ["a"]}, "input_ids"),
    (G, {"text": "x", "stream": "maybe"}, "stream"),
    (G, {"text": "x", "stream": {}}, "stream"),
    (G, {"text": "x", "return_logprob": "x"}, "return_logprob"),
    (G, {"text": ["a", "b"], "return_logprob": [True, "x"]}, "return_logprob"),
    (C, {}, "prompt"),
    (C, {"prompt": 5}, "prompt"),
    (C, {"prompt": []}, "prompt"),
    (C, {"prompt": [[]]}, "prompt"),
    (C, {"prompt": [[1, 2], []]}, "prompt"),
    (C, {"prompt": ["a", [1]]}, "prompt"),
    (C, {"prompt": [{}]}, "prompt"),
    (C, {"prompt": "x", "n": "abc"}, "n"),
    (C, {"prompt": "x", "n": 0}, "n"),
    (C, {"prompt": "x", "n": 2.5}, "n"),
    (C, {"prompt": "x", "max_tokens": "x"}, "max_tokens"),
    (C, {"prompt": "x", "max_tokens": -1}, "max_tokens"),
    (C, {"prompt": "x", "rid": 5}, "rid"),
    (C, {"prompt": ["a", "b"], "rid": ["x"]}, "rid"),
    (C, {"prompt": "x", "stream": "maybe"}, "stream"),
    (CH, {}, "messages"),
    (CH, {"messages": "hi"}, "messages"),
    (CH, {"messages": CHAT, "max_tokens": "x"}, "max_tokens"),
    (CH, {"messages": CHAT, "max_completion_tokens": "x"}, "max_completion_tokens"),
    (CH, {"messages": CHAT, "max_tokens": 5.5}, "max_tokens"),
    (CH, {"messages": CHAT, "n": 0}, "n"),
    (CH, {"messages": CHAT, "n": "x"}, "n"),
    (CH, {"messages": CHAT, "stream": "maybe"}, "stream"),
    (CH, {"messages": CHAT, "rid": {}}, "rid"),
    (CH, {"messages": CHAT, "rid": ["a"]}, "rid"),
]


@contextlib.asynccontextmanager
async def router_allowing_n(start_workers, make_router):
    """A router that lets n > 1 through (--max-n 128): what is refused here is the fields' form."""
    p, d = await start_workers(1, 1)
    client = await make_router([p], [d], admission=AdmissionConfig(max_n=128))
    client.workers = (p, d)
    yield client
    await wait_for(lambda: all(w.inflight == 0 for w in client.registry.workers()), message="in-flight back to 0")
    assert client.app[ADMISSION].active == 0


@pytest.fixture
async def router(sim_workers, make_router):
    async with router_allowing_n(sim_workers, make_router) as client:
        yield client


@pytest.fixture
async def router_serving_n(fake_fleet, make_router):
    """The same in front of fakes that serve n > 1 (a 0.5.23 decode never finishes one, nor does the simulator)."""
    async with router_allowing_n(fake_fleet, make_router) as client:
        yield client


async def post(client, path, body):
    async with client.post(path, data=orjson.dumps(body), headers={"Content-Type": "application/json"}) as resp:
        raw = await resp.read()
        return resp.status, resp.content_type, raw


async def test_what_sglang_refuses_or_fails_on_is_400_naming_the_field(router):
    wrong = []
    for path, body, param in REFUSED:
        status, content_type, raw = await post(router, path, body)
        error = orjson.loads(raw).get("error", {}) if content_type == "application/json" else {}
        if status != 400 or error.get("param") != param or not error.get("message"):
            wrong.append((path, body, status, raw[:200]))
    assert not wrong, "\n".join(map(str, wrong))
    assert not router.workers[0].requests and not router.workers[1].requests


ACCEPTED = [  # (path, body, what the decode server must have received of it)
    (G, {"text": "x", "rid": ["one"], "sampling_params": {"n": 2}}, {"rid": ["one"]}),  # n > 1: a batch of one
    (G, {"text": "x", "sampling_params": [{"n": 2}]}, {"sampling_params": [{"n": 2}]}),
    (G, {"text": ["a", "b"], "sampling_params": [{"max_new_tokens": 1}, {"max_new_tokens": 2}]}, {}),
    (G, {"text": "", "sampling_params": {"max_new_tokens": 0}}, {"text": ""}),
    (G, {"text": [""], "sampling_params": {"max_new_tokens": None}}, {"text": [""]}),
    (G, {"input_ids": [], "session_params": {"id": "s1"}}, {"input_ids": []}),  # a session's history is the prompt
    (G, {"input_ids": [[1, 2], [3]], "rid": ["a", "b"]}, {"rid": ["a", "b"]}),
    (G, {"text": "x", "stream": "false"}, {"stream": False}),  # lax values are forwarded as JSON's own
    (G, {"text": "x", "return_logprob": "no"}, {"return_logprob": False}),
    (C, {"prompt": "x", "max_tokens": "16"}, {"max_tokens": "16"}),
    (C, {"prompt": "x", "n": "2"}, {"n": 2}),
    (C, {"prompt": "x", "n": 2.0}, {"n": 2}),
    (C, {"prompt": [1, 2, 3]}, {"prompt": [1, 2, 3]}),
    (C, {"prompt": [[1, 2], [3]], "rid": ["a", "b"]}, {"rid": ["a", "b"]}),
    (C, {"prompt": ["a", "b"], "stream": 0}, {"stream": False}),
    (CH, {"messages": CHAT, "max_tokens": None, "stream": "off"}, {"stream": False}),
    (CH, {"messages": CHAT, "max_tokens": "5", "n": True}, {"n": 1}),
    (CH, {"messages": [], "max_completion_tokens": 0}, {"messages": []}),
    (CH, {"messages": CHAT, "rid": ["a"], "n": 2}, {"rid": ["a"]}),
]


async def test_what_sglang_serves_is_forwarded(router_serving_n):
    router = router_serving_n
    prefill, decode = router.workers
    for path, body, forwarded in ACCEPTED:
        status, content_type, raw = await post(router, path, body)
        assert status == 200, (path, body, raw[:300])
        assert content_type == "application/json", (path, body, content_type)  # no stream when it says "false"
        sent = decode.bodies(path)[-1]
        assert {k: sent[k] for k in forwarded} == forwarded, (path, body, sent)


async def test_a_stream_written_as_text_is_streamed(router):
    for path, body in [(CH, {"messages": CHAT, "stream": "true"}), (G, {"text": "x", "stream": 1})]:
        async with router.post(path, json=body) as resp:
            assert resp.status == 200 and resp.content_type == "text/event-stream", await resp.text()
            assert (await resp.read()).rstrip().endswith(b"data: [DONE]")
