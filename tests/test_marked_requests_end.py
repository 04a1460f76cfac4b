"""What became of the requests an operation marked before aborting their servers: the request path counts each
as it ends (`MarkTally`), so a weight update says how many its abort ended and how many finished first, instead
of how many were in flight when it began."""

from __future__ import annotations

import asyncio

from router.core.keys import REGISTRY, TRAFFIC
from router.core.traffic import AbortAction, MarkTally

from .helpers import wait_for


async def test_each_marked_request_is_counted_aborted_or_finished_by_its_answer(sim_workers, make_router):
    p, finishes, aborts = await sim_workers(1, 2)
    for decode in (finishes, aborts):
        decode.set_faults(hang_after_tokens=1)  # every request waits on its decode after its first token
    client = await make_router([p], [finishes, aborts])
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 3}}
    requests = [asyncio.ensure_future(client.post("/generate", json={**body, "stream": i % 2 == 1}))
                for i in range(12)]
    registry = client.app[REGISTRY]
    await wait_for(lambda: len(finishes.bodies()) + len(aborts.bodies()) == 12, message="all on their decodes")

    tally = MarkTally()
    marked = client.app[TRAFFIC].mark_on(registry.workers(), AbortAction.ANSWER, tally)
    assert marked == tally.marked == 12
    finishes.set_faults(hang_after_tokens=None)  # they finish
    aborts.worker.engine.abort(abort_all=True)  # they end with SGLang's abort answer, as /abort_request does
    answers = await asyncio.gather(*requests)
    raw = [await a.read() for a in answers]
    assert [a.status for a in answers] == [200] * 12
    aborted_answers = sum(b'"abort"' in r for r in raw)
    assert aborted_answers == len(aborts.bodies()) > 0

    await tally.wait_all_ended(5.0)
    assert (tally.aborted, tally.finished) == (len(aborts.bodies()), len(finishes.bodies()))
    assert tally.aborted + tally.finished == 12

