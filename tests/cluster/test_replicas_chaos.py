"""The chaos soak (tests/cluster/chaos.py) at a small size: one seeded run of ~20 s. Longer and on more seeds:
`PDR_CHAOS_SEEDS=1-20 PDR_CHAOS_DURATION_S=75 PDR_CHAOS_CLIENTS=8 pytest tests/cluster/test_replicas_chaos.py -s`
(each seed a test; a failure names its seed, and the same seed replays the same events)."""

from __future__ import annotations

import orjson
import pytest

from simulator.fleet import Fleet

from .chaos import Chaos, save, settings
from .replicas import SIM

SEEDS, DURATION_S, CLIENTS = settings()


@pytest.mark.timeout(DURATION_S + 300)  # the run, then its calls' deadlines, the quiesce and the exits
@pytest.mark.parametrize("seed", SEEDS)
async def test_replicas_under_chaos_lose_no_request_and_end_on_the_servers_live_state(etcd, tmp_path, seed):
    # both switch APIs on every server (0.5.23's and the earlier design's), bootstrap ports the OS picks
    fleet = await Fleet(3, 3, **{**SIM, "decode_step_s": 0.004}, api="patched", convert_bootstrap_base=0).start()
    try:
        report = await Chaos(etcd, fleet, tmp_path, seed, DURATION_S, CLIENTS).run()
    finally:
        await fleet.stop()
    save(report)
    print(orjson.dumps(report.summary(), option=orjson.OPT_INDENT_2).decode())
    assert report.answers > 0
    assert not report.problems, f"seed {seed}: {report.problems}"
