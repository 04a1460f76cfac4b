"""How much one request may ask for: `n` up to --max-n, prompts x n up to --max-batch-size, 400 beyond, judged
before anything is done per sequence (no bootstrap room is built, nothing reaches a worker)."""

from __future__ import annotations

import contextlib

import pytest

from router.core import request_shape
from router.core.config import AdmissionConfig, ConfigError
from router.dataplane.admission import ADMISSION
from router.server.cli import config_from_args

from ..helpers import wait_for

CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture
def rooms_built(monkeypatch):
    """How many bootstrap rooms the router made (one per sequence of each attempt)."""
    made = []
    real = request_shape.new_room

    def counting() -> int:
        made.append(1)
        return real()

    monkeypatch.setattr(request_shape, "new_room", counting)
    return made


@contextlib.asynccontextmanager
async def bounded_router(start_workers, make_router):
    p, d = await start_workers(1, 1)
    client = await make_router([p], [d], admission=AdmissionConfig(max_n=4, max_batch_size=8))
    client.workers = (p, d)
    yield client
    await wait_for(lambda: all(w.inflight == 0 for w in client.registry.workers()), message="in-flight back to 0")
    assert client.app[ADMISSION].active == 0


@pytest.fixture
async def router(sim_workers, make_router):
    async with bounded_router(sim_workers, make_router) as client:
        yield client


@pytest.fixture
async def router_serving_n(fake_fleet, make_router):
    """The same in front of fakes that serve n > 1 (a 0.5.23 decode never finishes one, nor does the simulator)."""
    async with bounded_router(fake_fleet, make_router) as client:
        yield client


async def post(client, path, body):
    async with client.post(path, json=body) as resp:
        assert resp.content_type == "application/json", await resp.text()
        return resp.status, await resp.json()


def sent(client) -> int:
    return sum(len(w.requests) for w in client.workers)


@pytest.mark.parametrize("path, body, flag", [
    ("/generate", {"text": "x", "sampling_params": {"n": 10**9}}, "--max-n"),
    ("/generate", {"text": "x", "sampling_params": [{"n": 10**9}]}, "--max-n"),
    ("/v1/completions", {"prompt": "x", "n": 10**9}, "--max-n"),
    ("/v1/chat/completions", {"messages": CHAT, "n": 10**9}, "--max-n"),
    ("/generate", {"text": ["x"] * 100}, "--max-batch-size"),
    ("/generate", {"input_ids": [[1]] * 100}, "--max-batch-size"),
    ("/v1/completions", {"prompt": ["x"] * 100}, "--max-batch-size"),
    ("/generate", {"text": ["x"] * 9, "return_logprob": [True] * 1000}, "--max-batch-size"),
    ("/generate", {"text": ["x"] * 3, "sampling_params": {"n": 3}}, "--max-batch-size"),
    ("/v1/completions", {"prompt": [[1], [2], [3]], "n": 3}, "--max-batch-size"),
], ids=["n", "n-in-list", "completions-n", "chat-n", "prompts", "token-batches", "completions-prompts",
        "logprob-list", "prompts-x-n", "completions-prompts-x-n"])
async def test_a_request_over_the_bounds_is_400_before_any_sequence_is_built(router, rooms_built, path, body, flag):
    status, answer = await post(router, path, body)
    assert status == 400, answer
    assert flag in answer["error"]["message"]
    assert rooms_built == [] and sent(router) == 0


@pytest.mark.parametrize("path, body, sequences", [
    ("/generate", {"text": "x", "sampling_params": {"n": 4}}, 4),
    ("/generate", {"text": ["x", "y"], "sampling_params": {"n": 4}}, 8),
    ("/v1/completions", {"prompt": ["a", "b", "c", "d", "e", "f", "g", "h"]}, 8),
    ("/v1/chat/completions", {"messages": CHAT, "n": 4}, 4),
])
async def test_a_request_at_the_bounds_is_served(router_serving_n, rooms_built, path, body, sequences):
    router = router_serving_n
    status, answer = await post(router, path, body)
    assert status == 200, answer
    assert len(rooms_built) == sequences  # one room per sequence, one attempt
    prefill, decode = router.workers
    assert len(decode.bodies(path)[-1]["bootstrap_room"]) == sequences


def test_the_bounds_are_flags_with_sane_defaults():
    config = config_from_args([], env={})
    assert (config.admission.max_n, config.admission.max_batch_size) == (1, 4096)  # n: 0.5.23's PD serves 1
    config = config_from_args(["--max-n", "16", "--max-batch-size", "64"], env={})
    assert (config.admission.max_n, config.admission.max_batch_size) == (16, 64)
    with pytest.raises(ConfigError) as refused:
        config_from_args(["--max-n", "0", "--max-batch-size", "0"], env={})
    assert any("--max-n" in p for p in refused.value.problems)
    assert any("--max-batch-size" in p for p in refused.value.problems)


async def test_the_default_bounds_refuse_what_took_the_router_down(sim_workers, make_router, rooms_built):
    """`n: 10^9` built 10^9 bootstrap rooms on the event loop (/health timed out, memory grew until the process
    died): it is refused at once with the default bounds."""
    p, d = await sim_workers(1, 1)
    client = await make_router([p], [d])
    # (10^6 here: were the bound gone, a test of 10^9 would take the machine down with the router)
    for body in ({"text": "x", "sampling_params": {"n": 10**6}}, {"text": ["x"] * 4097}):
        status, answer = await post(client, "/generate", body)
        assert status == 400 and "--max-" in answer["error"]["message"], answer
    assert rooms_built == [] and not p.requests and not d.requests
