"""A request that makes every server fail the same way is the request's fault: two pairs tried, then the
servers' answer as a JSON error, and no breaker counts it, so repeating it takes nothing out while other
clients are served. A server that fails for everyone still has its breaker opened; a server's own error
answer reaches the client as a JSON error."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from router.core.config import BreakerConfig, RetryConfig
from router.dataplane.admission import ADMISSION

from ..helpers import wait_for

RETRY = RetryConfig(max_retries=3, initial_backoff_ms=1, max_backoff_ms=5)
GOOD = {"text": "hello", "sampling_params": {"max_new_tokens": 2}}
POISON = {**GOOD, "poison": True}  # a field these stand-ins fail on, as servers fail on an input they cannot take


async def settle(client):
    await wait_for(lambda: all(w.inflight == 0 for w in client.registry.workers()), message="in-flight back to 0")
    assert client.app[ADMISSION].active == 0


def attempts_with(workers, field: str) -> int:
    return sum(1 for w in workers for _, body in w.requests if field in (body or {}))


async def test_repeating_a_request_every_server_fails_on_opens_no_breaker(fake_fleet, make_router):
    workers = await fake_fleet(2, 2)
    for w in workers:
        w.behaviour.fail_on_field = "poison"
    p1, p2, d1, d2 = workers
    client = await make_router([p1, p2], [d1, d2], retry=RETRY, breaker=BreakerConfig(failure_threshold=3))

    async def send(body):
        async with client.post("/generate", json=body) as resp:
            return resp.status, resp.content_type, await resp.read()

    answers = await asyncio.gather(*(send(POISON if i % 2 else GOOD) for i in range(40)))
    for i, (status, content_type, raw) in enumerate(answers):
        if i % 2:
            assert status == 500 and content_type == "application/json", raw
            assert "cannot handle poison" in orjson.loads(raw)["error"]["message"]  # the servers' own words
        else:
            assert status == 200, raw  # the other clients are served throughout
    # each poison request was tried on two pairs, not on every retry the router has
    assert attempts_with([p1, p2], "poison") == 2 * 20
    assert all(w.breaker == "closed" and w.routable for w in client.registry.workers())
    status, _, _ = await send(GOOD)
    assert status == 200
    await settle(client)


async def test_a_server_failing_for_everyone_still_has_its_breaker_opened(sim_workers, make_router):
    p, d1, d2 = await sim_workers(1, 2)
    d1.set_faults(error_rate=1.0, error_status=500)  # broken for every request, whatever it is
    client = await make_router([p], [d1, d2], retry=RETRY, breaker=BreakerConfig(failure_threshold=3))
    for _ in range(30):
        async with client.post("/generate", json=GOOD) as resp:
            assert resp.status == 200  # retried on the other decode server
        if client.registry.find(d1.url).breaker == "open":
            break
    assert client.registry.find(d1.url).breaker == "open"
    assert client.registry.find(d2.url).breaker == "closed"
    await settle(client)


async def test_a_request_that_crashes_its_server_reaches_two_servers_not_every_one(fake_fleet, make_router):
    """A server that closes the connection without answering, on every try: after two the router stops (real
    0.5.23 servers died of `input_ids: [[]]`; the router refuses that one, this is the rule for the next)."""
    workers = await fake_fleet(4, 1)
    for w in workers:
        w.behaviour.close_on_field = "crash"
    client = await make_router(workers[:4], workers[4:], retry=RETRY)
    async with client.post("/generate", json={**GOOD, "crash": True}) as resp:
        assert resp.status == 502 and resp.content_type == "application/json"
        assert "closed the connection before answering" in (await resp.json())["error"]["message"]
    assert attempts_with(workers[:4], "crash") == 2
    await settle(client)


@pytest.mark.parametrize("answer, message, kept", [
    ({"error": "invalid type: string \"abc\", expected i64"}, "invalid type: string \"abc\", expected i64", {}),
    ({"object": "error", "message": "bad thing", "type": "BadRequestError", "param": None, "code": 400},
     "bad thing", {"object": "error", "message": "bad thing"}),
    ({"detail": [{"loc": ["body", "x"], "msg": "field required"}]}, "field required", {}),
    ({"error": {"message": "as it is", "code": 400}}, "as it is", {}),
])
async def test_a_servers_own_4xx_reaches_the_client_as_a_json_error(fake_fleet, make_router, answer, message,
                                                                     kept):
    p, d = await fake_fleet(1, 1)
    d.behaviour.status, d.behaviour.error_body = 400, answer
    client = await make_router([p], [d], retry=RETRY)
    async with client.post("/generate", json=GOOD) as resp:
        assert resp.status == 400 and resp.content_type == "application/json"
        body = await resp.json()
    assert message in body["error"]["message"] and body["error"]["code"] in (400, "400")
    assert {k: body[k] for k in kept} == kept  # SGLang's own fields stay for clients that read them
    assert len(d.requests) == 1  # a 4xx is the request's: not retried
    await settle(client)


async def test_a_text_error_answer_becomes_a_json_error(fake_fleet, make_router):
    p, d = await fake_fleet(1, 1)
    d.behaviour.status, d.behaviour.error_text = 400, "Flush cache failed."
    client = await make_router([p], [d], retry=RETRY)
    async with client.post("/generate", json=GOOD) as resp:
        assert resp.status == 400 and resp.content_type == "application/json"
        assert (await resp.json())["error"]["message"] == "Flush cache failed."
    await settle(client)
