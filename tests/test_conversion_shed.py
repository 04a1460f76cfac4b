"""`shed` mode: a decode converted while its requests wait on a backlogged prefill re-sends those requests
instead of waiting for them (they wait on the very backlog a move to prefill is to relieve), and lets the ones
decoding finish. On simulated 0.5.23 servers: one prefill, one forward at a time, a queue of prompts."""

from __future__ import annotations

import asyncio

from simulator.fleet import Fleet

from .helpers import wait_for
from .sim_support import FAST

# one prompt per forward, a quarter of a second each: 16 requests queue for about 4 s at the one prefill
SLOW_PREFILL = dict(prefill_concurrency=1, max_prefill_tokens=8, prefill_overhead_s=0.25)
BODY = {"text": "hello there", "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}


def router_inflight(client) -> list[int]:
    return [w.inflight for w in client.registry.workers()]


async def test_a_decode_converted_in_shed_mode_re_sends_what_waits_on_the_prefill_and_loses_nothing(make_router):
    async with Fleet(1, 2, decode_step_s=0.01, prefill_overrides=SLOW_PREFILL, **FAST) as fleet:
        client = await make_router(fleet.prefill, fleet.decode)
        donor = next(w for w in client.registry.workers() if w.url == fleet.decode[1].url)
        answers: list[tuple[int, dict | list]] = []

        async def one(stream: bool) -> None:
            resp = await client.post("/generate", json={**BODY, "stream": stream})
            answers.append((resp.status, await resp.text()))

        clients = [asyncio.ensure_future(one(stream=i % 4 == 0)) for i in range(16)]
        # the donor holds requests that wait on the prefill's queue
        await wait_for(lambda: donor.inflight >= 3, timeout=10)
        resp = await client.post(f"/admin/workers/{donor.id}/convert", json={"mode": "shed"})
        record = await resp.json()
        converted_with = len(answers)
        await asyncio.gather(*clients)

        assert resp.status == 200 and record["outcome"] == "converted" and record["mode"] == "shed", record
        drain = next(s for s in record["steps"] if s.get("step", s.get("name")) == "drain")
        assert drain["details"]["resent"] >= 3, drain
        # it did not wait for the backlog: most requests were still on their way when it had converted
        assert converted_with < len(clients) - 3, (converted_with, record)
        # every request answered whole: those re-sent went through the other decode (or the new prefill)
        assert [s for s, _ in answers] == [200] * len(clients), answers
        assert not any('"abort"' in text for _, text in answers), answers
        prefill_state = await fleet.state(fleet.prefill[0])
        assert prefill_state["counters"]["items_aborted"] >= 1, prefill_state["counters"]  # dropped from its queue
        await wait_for(lambda: router_inflight(client) == [0, 0, 0], timeout=10)


async def test_shed_mode_on_a_decode_with_nothing_waiting_is_a_drain(make_router):
    async with Fleet(1, 2, decode_step_s=0.01, **FAST) as fleet:
        client = await make_router(fleet.prefill, fleet.decode)
        donor = next(w for w in client.registry.workers() if w.url == fleet.decode[1].url)
        resp = await client.post(f"/admin/workers/{donor.id}/convert", json={"mode": "shed"})
        record = await resp.json()
        assert resp.status == 200 and record["outcome"] == "converted", record
        drain = next(s for s in record["steps"] if s.get("step", s.get("name")) == "drain")
        assert drain["details"]["resent"] == 0 and drain["outcome"] == "ok", drain
        assert donor.role.value == "prefill" and donor.routable
