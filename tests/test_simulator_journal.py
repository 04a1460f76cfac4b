"""The simulator's Journal: what a worker received, kept only when asked for (simulator/journal.py)."""

from __future__ import annotations

from simulator.fleet import Fleet
from simulator.journal import Journal
from tests.sim_support import FAST, pd_generate, post

PROMPT = "Hello world, this is"


async def test_a_recording_fleet_keeps_generation_bodies_aborts_and_headers(session):
    async with Fleet(1, 1, record_requests=True, **FAST) as fleet:
        body = {"text": PROMPT, "rid": "j1", "sampling_params": {"max_new_tokens": 2}}
        (p_status, _), (d_status, _) = await pd_generate(session, fleet, body)
        assert (p_status, d_status) == (200, 200)
        decode = fleet.decode[0].worker.journal
        assert [b["rid"] for b in decode.bodies()] == ["j1"] and decode.bodies("/v1/completions") == []
        async with session.post(fleet.decode[0].url + "/abort_request?x=1", json={"rid": "j1"},
                                headers={"Authorization": "Bearer k"}) as resp:
            assert resp.status == 200
        await post(session, fleet.decode[0].url + "/generate", None)  # no body: kept as None, answered 400
        assert decode.aborts == [{"rid": "j1"}]
        assert decode.bodies()[-1] is None and decode.calls["/generate"] == 2
        assert ("/abort_request", "Bearer k") in decode.authorizations
        assert decode.queries == [("/abort_request", {"x": "1"})]
        assert decode.in_flight["/generate"] == 0


async def test_a_worker_keeps_nothing_unless_asked():
    async with Fleet(1, 1, **FAST) as fleet:
        for handle in fleet.workers:
            assert handle.worker.journal is None
            assert not any(isinstance(getattr(m, "__self__", None), Journal) for m in handle.worker.app.middlewares)
