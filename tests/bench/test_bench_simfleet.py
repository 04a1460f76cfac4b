"""The sim setup's fleet: `python -m simulator.fleet` started as a process, found, loaded without a router."""

import pytest

from bench.loadgen import DirectPD, run_load
from bench.simfleet import SimFleet


@pytest.mark.skipif(not __import__("importlib").util.find_spec("simulator.fleet"), reason="no simulator yet")
async def test_simulated_fleet_serves_pd_requests_without_a_router(tmp_path):
    sim = SimFleet(tmp_path, prefills=1, decodes=1)
    with sim as fleet:
        assert len(fleet.prefill) == 1 and fleet.prefill[0][1] is not None and len(fleet.decode) == 1
        result = await run_load(url="", concurrency=4, duration=0.5, warmup=0.1, stream=True,
                                direct=DirectPD(fleet.prefill, fleet.decode))
    assert not sim.child.alive()
    # every request the clients sent was answered (a loaded machine may fit none inside the 0.5 s window:
    # those in it are the figures', and then the first token came before the last)
    assert result["errors"] == 0 and result["answered"] >= 4
    assert result["requests"] == 0 or result["ttft_p50_ms"] <= result["p50_ms"]
