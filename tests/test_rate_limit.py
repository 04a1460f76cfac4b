"""--rate-limit-tokens-per-second (the peers'): a token bucket of new requests, bursting up to
--max-concurrent-requests; beyond it 429 with Retry-After, and nothing is left counted."""

from __future__ import annotations

import asyncio

import pytest

from router.core.config import AdmissionConfig, ConfigError
from router.dataplane.admission import Admission
from router.core.errors import TooManyRequests
from router.server.cli import config_from_args


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def test_a_burst_passes_then_the_rate_bites_and_refills():
    clock = Clock()
    admission = Admission(AdmissionConfig(max_concurrent_requests=3, rate_limit_tokens_per_second=2), clock=clock)
    for _ in range(3):  # the burst: the bucket holds max_concurrent_requests
        async with admission.slot():
            pass
    with pytest.raises(TooManyRequests) as refused:
        async with admission.slot():
            pass
    assert refused.value.headers["Retry-After"] == "1" and "rate limit" in refused.value.message
    assert admission.active == 0 and admission.rejected_total == 1
    clock.now += 0.5  # one token back at 2/s
    async with admission.slot():
        pass
    with pytest.raises(TooManyRequests):
        async with admission.slot():
            pass
    clock.now += 60  # never more than the bucket holds
    for _ in range(3):
        async with admission.slot():
            pass
    with pytest.raises(TooManyRequests):
        async with admission.slot():
            pass


async def test_through_the_router_429_is_json_and_the_others_are_served(sim_workers, make_router):
    p, d = await sim_workers()
    router = await make_router([p], [d], admission=AdmissionConfig(rate_limit_tokens_per_second=1))
    # five at once on a bucket of one token refilled each second: the first passes, the others (but one per
    # second the machine takes to send them) are refused
    answers = await asyncio.gather(*(router.post("/generate", json={"text": "hi"}) for _ in range(5)))
    statuses = sorted(a.status for a in answers)
    assert statuses[0] == 200 and statuses[-1] == 429 and set(statuses) == {200, 429}, statuses
    refused = next(a for a in answers if a.status == 429)
    assert int(refused.headers["Retry-After"]) >= 1 and "rate limit" in (await refused.json())["error"]["message"]
    assert all(w.inflight == 0 for w in router.registry.workers())


def test_zero_is_refused():
    with pytest.raises(ConfigError, match="rate-limit-tokens-per-second must be at least 1"):
        config_from_args(["--rate-limit-tokens-per-second", "0"], env={})
