"""--worker-startup-check-interval (the peers'): a worker not read yet is read again at that period."""

from __future__ import annotations

from router.control.live_state import LIVE_STATE
from router.core.config import HealthConfig
from router.core.registry import WorkerState

from simulator.config import WorkerConfig
from simulator.worker import Worker

from .helpers import free_port, wait_for
from .sim_support import FAST


async def test_a_pending_worker_is_read_again_at_the_check_interval(sim_workers, make_router):
    p, d = await sim_workers()
    router = await make_router([p], [d], worker_startup_check_interval_secs=0.3,
                               health=HealthConfig(interval_secs=60.0))
    assert router.app[LIVE_STATE].retry_interval == 0.3
    port = free_port()  # a decode that starts after the router: pending, read again every 0.3 s (not 60)
    resp = await router.post("/workers", json={"url": f"http://127.0.0.1:{port}", "worker_type": "decode"})
    assert resp.status in (200, 202), await resp.text()
    late = router.registry.find(f"http://127.0.0.1:{port}")
    assert late is not None and late.state is WorkerState.PENDING
    worker = await Worker(WorkerConfig(role="decode", port=port, bootstrap_port=None, **FAST)).start()
    try:
        await wait_for(lambda: late.state is WorkerState.ACTIVE, timeout=10, message="the late decode to be read")
    finally:
        await worker.stop()


async def test_without_the_flag_it_is_the_health_check_interval(sim_workers, make_router):
    p, d = await sim_workers()
    router = await make_router([p], [d], health=HealthConfig(interval_secs=7.0))
    assert router.app[LIVE_STATE].retry_interval == 7.0
