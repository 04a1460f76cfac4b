"""A weight update that a server took without flushing its cache (0.5.23 refuses the flush while requests are on
it, as when the fleet is paused in place): the server is held out as `cache` until the router's /flush_cache
succeeds once its requests are done; where its pool has no other server, continue_generation keeps new
requests waiting for it instead of answering them 503. Real HTTP on loopback: the router app and simulated
servers (tests/test_weights_e2e.py's fixture).
"""

from __future__ import annotations

import asyncio

from router.core.registry import WorkerState

from .helpers import wait_for
from .test_weights_e2e import sim_router  # noqa: F401  (the fixture)

LONG = {"text": "a long answer", "sampling_params": {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True}}


async def _flushes(router, handle) -> int:
    return (await router.fleet.state(handle))["counters"]["cache_flushes"]


async def _decoding_on(router, handle) -> None:
    worker = router.worker(handle)
    await wait_for(lambda: worker.inflight == 1, timeout=10, message="the long request decoding")
    await router.fleet.wait_for(handle, lambda s: bool(s["running_rids"]))


async def _paused_with_a_long_request_on(router, busy, other) -> asyncio.Future:
    """One long request decoding on `busy` (kept off `other`), then the fleet paused in place."""
    router.registry.hold_out(router.worker(other), "paused", "test: keep the long request off it")
    long = asyncio.ensure_future(router.generate(LONG))
    await _decoding_on(router, busy)
    router.registry.end_hold(router.worker(other), ["paused"], "test")
    assert (await router.call("/pause_generation", {"mode": "in_place"}))[0] == 200
    return long


async def test_an_unflushed_server_is_held_until_its_requests_end_then_flushed_and_back(sim_router):
    router = await sim_router(1, 2, decode_step_s=0.005)
    busy, other = router.fleet.decode
    long = await _paused_with_a_long_request_on(router, busy, other)
    before = await _flushes(router, busy)

    status, answer = await router.call("/update_weights_from_disk", {"model_path": "sim/m", "weight_version": "v2"})
    assert status == 200 and answer["success"] and answer["weight_version"] == "v2", answer
    row = next(w for w in answer["workers"] if w["url"] == busy.url)
    assert row["success"] and row["cache"] == "stale" and row["routable"] is False, row
    assert router.flow.left_out[router.worker(busy).id].kind == "cache"
    assert router.worker(other).routable, "the flushed decode serves"

    status, resumed = await router.call("/continue_generation", {})
    assert status == 200, resumed
    assert "flush" not in [s.name for s in router.flow.history[-1].steps], "another decode serves: no wait"
    assert not (await long).outcome == "error"
    await wait_for(lambda: router.worker(busy).routable, timeout=10, message="flushed and back once idle")
    assert await _flushes(router, busy) == before + 1, "the router flushed it"
    assert router.worker(busy).weight_version == "v2"


async def test_continue_keeps_requests_waiting_where_the_pool_has_only_the_unflushed_server(sim_router):
    router = await sim_router(1, 1, decode_step_s=0.005)
    decode = router.fleet.decode[0]
    long = asyncio.ensure_future(router.generate(LONG))
    await _decoding_on(router, decode)
    assert (await router.call("/pause_generation", {"mode": "in_place"}))[0] == 200
    status, answer = await router.call("/update_weights_from_disk", {"model_path": "sim/m", "weight_version": "v2"})
    assert status == 200 and answer["success"], answer
    assert not router.worker(decode).routable and router.flow.left_out[router.worker(decode).id].kind == "cache"

    waiting = asyncio.ensure_future(router.generate())
    await wait_for(lambda: router.admission.waiting == 1, message="held while paused")
    status, resumed = await router.call("/continue_generation", {})
    assert status == 200, resumed
    flush = next(s for s in router.flow.history[-1].steps if s.name == "flush")
    assert flush.outcome == "ok", flush
    assert router.worker(decode).routable and router.admission.is_open
    new = await waiting
    assert new.outcome == "complete" and new.weight_version == "v2", new  # not a 503 "no routable decode"
    assert (await long).outcome == "complete"


async def test_a_server_still_busy_at_continue_s_deadline_stays_out_and_the_reconciler_brings_it_back(sim_router):
    router = await sim_router(1, 1, decode_step_s=0.005, router={"abort_timeout_secs": 0.3})
    decode = router.fleet.decode[0]
    long = asyncio.ensure_future(router.generate(LONG))  # ~1 s of decoding
    await _decoding_on(router, decode)
    assert (await router.call("/pause_generation", {"mode": "in_place"}))[0] == 200
    assert (await router.call("/update_weights_from_disk", {"model_path": "sim/m", "weight_version": "v2"}))[0] == 200
    status, resumed = await router.call("/continue_generation", {})
    assert status == 200, resumed
    flush = next(s for s in router.flow.history[-1].steps if s.name == "flush")
    assert flush.outcome == "timeout" and decode.url in flush.message, flush
    assert router.admission.is_open, "a deadline passed: admission opens, nothing waits for ever"
    worker = router.worker(decode)
    assert worker.state is WorkerState.FAILED and worker.hold.kind == "cache"
    assert (await long).outcome == "complete"
    await wait_for(lambda: worker.routable, timeout=10, message="the reconciler flushed it once idle")
    assert (await router.generate()).weight_version == "v2"


async def test_an_update_that_flushes_ends_an_earlier_cache_hold(sim_router):
    router = await sim_router(1, 1, decode_step_s=0.005)
    decode = router.fleet.decode[0]
    router.registry.hold_out(router.worker(decode), "cache", "test: an earlier update left its cache")
    status, answer = await router.call("/update_weights_from_disk", {"model_path": "sim/m", "weight_version": "v3"})
    assert status == 200, answer
    assert router.worker(decode).routable and "cache" not in next(w for w in answer["workers"]
                                                                  if w["url"] == decode.url)


async def test_a_server_killed_while_held_as_cache_is_judged_again_when_it_restarts(sim_router):
    """The held server dies (SIGKILL) before its cache is flushed: its request is re-sent to the other decode,
    and the reconciler keeps trying. Restarted with its command line, it is empty (the flush succeeds) but serves
    its launch weights: held out for those, not routed to on the wrong version, and back with the next update."""
    router = await sim_router(1, 2, decode_step_s=0.005, processes=True)
    busy, other = router.fleet.decode
    long = await _paused_with_a_long_request_on(router, busy, other)
    launch_version = router.worker(busy).weight_version
    status, answer = await router.call("/update_weights_from_disk", {"model_path": "sim/m", "weight_version": "v2"})
    assert status == 200 and answer["success"], answer
    worker = router.worker(busy)
    assert worker.hold.kind == "cache"
    assert (await router.call("/continue_generation", {}))[0] == 200

    router.fleet.kill(busy)
    resent = await asyncio.wait_for(long, 30)  # nothing of it was sent yet: re-sent to the other decode
    assert resent.outcome == "complete" and resent.weight_version == "v2", resent
    await router.fleet.restart(busy)
    await wait_for(lambda: worker.hold is not None and worker.hold.kind == "weights", timeout=15,
                   message="flushed (empty) once back, and held out for its launch weights")
    assert f"serves weight_version {launch_version!r}" in worker.hold.reason, worker.hold
    assert not worker.routable
    for _ in range(4):  # the other decode serves, on the fleet's version
        answer = await router.generate()
        assert answer.outcome == "complete" and answer.weight_version == "v2", answer

    status, answer = await router.call("/update_weights_from_disk", {"model_path": "sim/m", "weight_version": "v2"})
    assert status == 200 and answer["success"], answer
    await wait_for(lambda: worker.routable, timeout=10, message="back on the fleet's version")
