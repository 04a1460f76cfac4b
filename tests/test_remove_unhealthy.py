"""--remove-unhealthy-workers / --worker-auto-recovery (SMG's): a worker its probes declare down is removed, and
the worker source that listed it (here a --discovery-file) registers it again once its server answers; with
--no-remove-unhealthy-workers (pd-router's default) it is held out, never removed, and comes back by itself."""

from __future__ import annotations

import contextlib

import orjson
from aiohttp.test_utils import TestClient, TestServer

from router.core.keys import REGISTRY
from router.server.app import create_app
from router.server.cli import config_from_args
from simulator.fleet import Fleet

from .conftest import RUNNER_KWARGS
from .helpers import wait_for
from .sim_support import FAST

FAST_HEALTH = ["--health-check-interval-secs", "0.05", "--health-failure-threshold", "1",
               "--health-success-threshold", "1", "--discovery-check-interval-secs", "0.05"]


@contextlib.asynccontextmanager
async def _router(fleet: Fleet, tmp_path, *flags: str):
    listing = tmp_path / "workers.json"
    listing.write_bytes(orjson.dumps({"workers": [
        {"url": fleet.prefill[0].url, "worker_type": "prefill", "bootstrap_port": fleet.prefill[0].bootstrap_port},
        {"url": fleet.decode[0].url, "worker_type": "decode"}]}))
    config = config_from_args(["--discovery-file", str(listing), *FAST_HEALTH, *flags], env={})
    server = TestServer(create_app(config))
    await server.start_server(**RUNNER_KWARGS)
    client = TestClient(server)
    await client.start_server()
    try:
        await wait_for(lambda: len([w for w in client.app[REGISTRY].workers() if w.routable]) == 2, timeout=10,
                       message="both listed workers to be routable")
        yield client
    finally:
        await client.close()


async def _serves(router) -> bool:
    resp = await router.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}})
    return resp.status == 200 and (await resp.json())["meta_info"]["completion_tokens"] == 2


async def _entry(router, url: str) -> dict:
    resp = await router.get("/admin/discovery")
    (source,) = (await resp.json())["sources"]
    return next(e for e in source["workers"] if e["url"] == url)


async def _source_retried_twice(router) -> None:
    """Wait until the worker source has applied its listing twice more (its retries: applied_at moves)."""
    async def applied_at() -> float:
        return (await (await router.get("/admin/discovery")).json())["sources"][0]["applied_at"]

    seen = [await applied_at()]

    async def moved_twice() -> bool:
        if (now := await applied_at()) != seen[-1]:
            seen.append(now)
        return len(seen) >= 3

    await wait_for(moved_twice, timeout=10, interval=0.02, message="the worker source to retry twice")


async def test_a_killed_worker_is_removed_and_registered_again_once_it_answers(tmp_path):
    async with Fleet(1, 1, processes=True, **FAST) as fleet:
        decode = fleet.decode[0]
        async with _router(fleet, tmp_path, "--worker-auto-recovery") as router:
            registry = router.app[REGISTRY]
            first = registry.find(decode.url)
            assert await _serves(router)
            fleet.kill(decode)  # SIGKILL: probes find nothing listening
            await wait_for(lambda: registry.find(decode.url) is None, timeout=10, message="the dead decode removed")
            # the source tries its entry again every interval, but registers it only once its server answers
            await _source_retried_twice(router)
            assert registry.find(decode.url) is None
            entry = await _entry(router, decode.url)
            assert entry["status"] == "removed as unhealthy" and "once its server answers" in entry["problem"]
            assert "not yet: " in entry["problem"]
            assert (await router.get("/readiness")).status == 503
            await fleet.restart(decode)
            await wait_for(lambda: (w := registry.find(decode.url)) is not None and w.routable, timeout=20,
                           message="the restarted decode registered again")
            assert registry.find(decode.url) is not first  # a new registration, read from the server
            assert (await _entry(router, decode.url))["status"] == "registered"
            assert await _serves(router)


async def test_without_removal_an_unhealthy_worker_is_held_out_and_comes_back(fleet, tmp_path):
    async with _router(fleet, tmp_path, "--no-remove-unhealthy-workers") as router:
        registry = router.app[REGISTRY]
        worker = registry.find(fleet.decode[0].url)
        await fleet.set_faults(fleet.decode[0], unhealthy=True)
        await wait_for(lambda: not worker.healthy, timeout=10, message="the decode found unhealthy")
        assert registry.find(worker.url) is worker and not worker.routable  # held out, not removed
        assert (await _entry(router, worker.url))["status"] == "registered"
        await fleet.set_faults(fleet.decode[0], unhealthy=False)
        await wait_for(lambda: worker.routable, timeout=10, message="the decode back in routing")
        assert registry.find(worker.url) is worker and await _serves(router)


def test_removal_without_a_worker_source_is_for_good_and_says_so():
    config = config_from_args(["--remove-unhealthy-workers"], env={})
    assert config.health.remove_unhealthy
    assert any("removed for good" in w for w in config.warnings())
    assert not config_from_args([], env={}).health.remove_unhealthy  # pd-router's default: held out
