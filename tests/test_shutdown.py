"""Graceful shutdown: pd-router as a real process in front of simulated servers, signalled with requests in
flight, during a conversion and during a pause."""

from __future__ import annotations

import asyncio
import signal
import time
from types import SimpleNamespace
from urllib.parse import quote

import aiohttp
import pytest

from simulator.fleet import Fleet

from .helpers import wait_for
from .router_process import RouterProcess, generate, live_rids

SIM = dict(health_check_s=0.0, bootstrap_retries=3, bootstrap_retry_interval_s=0.02, deferred_release_s=0.0,
           decode_step_s=0.01)
GRACE_S = 4.0
EXIT_SLACK_S = 1.0  # the interpreter's own exit after the router has closed everything
SHORT_TOKENS = 30  # ~0.3 s of decoding: finishes well within the grace
LONG_TOKENS = 5000  # ~50 s: still running when the grace ends


async def running_on_decode(fleet: Fleet, rids: set[str]) -> bool:
    running = set()
    for handle in fleet.decode:
        running |= set((await fleet.state(handle))["running_rids"])
    return rids <= running


async def nothing_left_on_servers(fleet: Fleet) -> bool:
    return not any((await live_rids(fleet)).values())


async def test_sigterm_finishes_short_requests_aborts_long_ones_cleanly_and_exits_0_within_the_grace(tmp_path):
    async with Fleet(1, 2, **SIM) as fleet, \
            RouterProcess(fleet, "--shutdown-grace-secs", str(GRACE_S), log_path=tmp_path / "router.log") as router, \
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as clients, \
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as keep_alive:
        async with keep_alive.get(router.url + "/health") as resp:  # opens the connection a balancer keeps
            assert resp.status == 200
        long = [asyncio.ensure_future(generate(clients, router.url, f"long-{i}", LONG_TOKENS, stream=bool(i % 2)))
                for i in range(4)]
        await wait_for(lambda: running_on_decode(fleet, {f"long-{i}" for i in range(4)}), timeout=10)
        short = [asyncio.ensure_future(generate(clients, router.url, f"short-{i}", SHORT_TOKENS, stream=bool(i % 2)))
                 for i in range(4)]
        await wait_for(lambda: running_on_decode(fleet, {f"short-{i}" for i in range(4)}), timeout=10)

        sent = router.send(signal.SIGTERM)
        health = []

        async def health_says_shutting_down() -> bool:  # on the connection kept open (the signal is async)
            async with keep_alive.get(router.url + "/health") as resp:
                health[:] = [resp.status, await resp.json()]
            return resp.status == 503

        await wait_for(health_says_shutting_down, timeout=GRACE_S / 2)
        async with keep_alive.post(router.url + "/generate", json={"text": "late", "sampling_params": {}}) as resp:
            late = resp.status
        with pytest.raises(aiohttp.ClientConnectorError):  # no new connection is accepted
            await clients.get(router.url + "/health")
        rc = await router.exited(GRACE_S + 10)
        took = time.monotonic() - sent
        short_seen, long_seen = await asyncio.gather(asyncio.gather(*short), asyncio.gather(*long))
        log = router.log()

        assert rc == 0, log
        assert took < GRACE_S + EXIT_SLACK_S, f"exited after {took:.2f} s\n{log}"
        assert health[1]["status"] == "shutting down" and health[1]["shutdown"]["phase"] == "grace", health
        assert late == 503
        for seen in short_seen:
            assert seen.get("finish") == "length" and seen["tokens"] == SHORT_TOKENS, seen
        for seen in long_seen:  # a clean abort answer, never a reset
            assert seen["status"] == 200 and seen.get("finish") == "abort", seen
            assert 0 < seen["tokens"] < LONG_TOKENS, seen
            if "done" in seen:
                assert seen["done"], seen
        assert await live_rids(fleet) == {h.url: [] for h in fleet.workers}
        for phase in ("stopped accepting connections", "aborting 4 request(s)", "closing connections"):
            assert phase in log, log


async def test_sigterm_with_nothing_in_flight_exits_at_once(tmp_path):
    async with Fleet(1, 1, **SIM) as fleet, \
            RouterProcess(fleet, "--shutdown-grace-secs", "30", log_path=tmp_path / "router.log") as router:
        sent = router.send(signal.SIGINT)
        assert await router.exited(10) == 0
        assert time.monotonic() - sent < 3.0, router.log()
        assert "nothing left in flight" in router.log()


async def test_a_second_signal_aborts_at_once(tmp_path):
    async with Fleet(1, 1, **SIM) as fleet, \
            RouterProcess(fleet, "--shutdown-grace-secs", "60", log_path=tmp_path / "router.log") as router, \
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as clients:
        request = asyncio.ensure_future(generate(clients, router.url, "long", LONG_TOKENS, stream=True))
        await wait_for(lambda: running_on_decode(fleet, {"long"}), timeout=10)
        sent = router.send(signal.SIGTERM)
        await wait_for(lambda: "stopped accepting" in router.log(), timeout=5)
        router.send(signal.SIGTERM)
        assert await router.exited(15) == 0
        assert time.monotonic() - sent < 10.0, router.log()  # not the 60 s grace
        seen = await request
        assert seen.get("finish") == "abort" and seen["done"], seen
        assert await live_rids(fleet) == {h.url: [] for h in fleet.workers}


async def test_sigterm_during_a_pause_continues_the_fleet_and_lets_stalled_requests_finish(tmp_path):
    async with Fleet(1, 1, **SIM) as fleet, \
            RouterProcess(fleet, "--shutdown-grace-secs", "10", log_path=tmp_path / "router.log") as router, \
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as clients:
        request = asyncio.ensure_future(generate(clients, router.url, "stalled", 100, stream=True))
        await wait_for(lambda: running_on_decode(fleet, {"stalled"}), timeout=10)
        status, _ = await router.call("/pause_generation", {"mode": "in_place"})
        assert status == 200
        assert all([(await fleet.state(h))["paused"] for h in fleet.workers])
        router.send(signal.SIGTERM)
        assert await router.exited(15) == 0, router.log()
        seen = await request
        assert seen.get("finish") == "length" and seen["tokens"] == 100, seen
        for handle in fleet.workers:
            assert (await fleet.state(handle))["paused"] is False, handle.url
        assert "ending the pause with continue_generation" in router.log()


@pytest.mark.parametrize("mode", ["drain", "shed"])
async def test_sigterm_during_a_drain_conversion_rolls_it_back_and_leaves_the_server_in_its_role(tmp_path, mode):
    """Shed drains what decodes as drain does (only what still waits on a prefill is re-sent): the same
    rollback."""
    async with Fleet(1, 2, **SIM) as fleet, \
            RouterProcess(fleet, "--shutdown-grace-secs", "3", log_path=tmp_path / "router.log") as router, \
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as clients:
        requests = [asyncio.ensure_future(generate(clients, router.url, f"r{i}", LONG_TOKENS, stream=True))
                    for i in range(4)]
        await wait_for(lambda: running_on_decode(fleet, {f"r{i}" for i in range(4)}), timeout=10)
        # a decode the requests run on (the policy may have sent all four to one of the two: the other would
        # drain at once and switch before the signal lands)
        target = [h for h in fleet.decode if (await fleet.state(h))["running_rids"]][0]
        status, answer = await router.call(f"/admin/workers/{quote(target.url, safe='')}/convert",
                                          {"mode": mode, "wait": False})
        assert status in (200, 202), answer
        router.send(signal.SIGTERM)
        assert await router.exited(15) == 0, router.log()
        for seen in await asyncio.gather(*requests):
            assert seen.get("finish") == "abort" and seen["done"], seen
        assert (await fleet.state(target))["role"] == "decode"
        assert "rolling back conversion" in router.log()
        assert await live_rids(fleet) == {h.url: [] for h in fleet.workers}


async def test_sigterm_during_a_role_switch_waits_for_it(tmp_path):
    async with Fleet(1, 2, role_switch_s=1.5, **SIM) as fleet, \
            RouterProcess(fleet, "--shutdown-grace-secs", "1", log_path=tmp_path / "router.log") as router:
        target = fleet.decode[0]
        status, answer = await router.call(f"/admin/workers/{quote(target.url, safe='')}/convert",
                                          {"mode": "drain", "wait": False})
        assert status in (200, 202), answer
        await wait_for(lambda: "step drain: ok" in router.log(), timeout=10)
        router.send(signal.SIGTERM)
        assert await router.exited(15) == 0, router.log()
        state = await fleet.state(target)
        assert state["role"] == "prefill" and state["listener_registered"], state  # switched whole
        assert "conversion c1" in router.log() and "converted from decode to prefill" in router.log()


async def test_sigterm_during_a_weight_update_that_is_still_draining_rolls_it_back(tmp_path):
    async with Fleet(1, 1, **SIM) as fleet, \
            RouterProcess(fleet, "--shutdown-grace-secs", "3", log_path=tmp_path / "router.log") as router, \
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as clients:
        request = asyncio.ensure_future(generate(clients, router.url, "long", LONG_TOKENS, stream=False))
        await wait_for(lambda: running_on_decode(fleet, {"long"}), timeout=10)
        update = asyncio.ensure_future(router.call("/update_weights_from_disk", {
            "model_path": "sim/tiny-llama-v2", "weight_version": "v2"}))  # drains: waits for "long"

        async def quiescing() -> bool:
            async with router.session.get(router.url + "/weight_updates") as resp:
                current = (await resp.json())["current"]
            return current is not None and current["step"] == "quiesce"

        await wait_for(quiescing, timeout=5)
        router.send(signal.SIGTERM)
        assert await router.exited(15) == 0, router.log()
        status, answer = await update
        assert status == 503 and "rolled back" in answer["error"]["message"], answer
        seen = await request
        assert seen.get("finish") == "abort", seen
        for handle in fleet.workers:
            state = await fleet.state(handle)
            assert state["weight_version"] == "default" and not state["paused"], state
        assert "rolling back fleet operation op1" in router.log()


async def test_requests_whose_servers_ignore_the_abort_are_answered_by_the_router(fake_fleet, tmp_path):
    """Servers that never answer: the router answers for them (an abort answer, or an error event
    mid-stream) before it closes, so no client sees its connection reset."""
    p, hung, stalled = await fake_fleet(1, 2)
    hung.behaviour.hang = True  # answers nothing, abort or not
    stalled.behaviour.stream_chunks, stalled.behaviour.stall_after = 4, 1  # one event, then nothing
    servers = SimpleNamespace(prefill=[p], decode=[hung, stalled])
    async with RouterProcess(servers, "--shutdown-grace-secs", "8", "--decode-policy", "round_robin",
                             log_path=tmp_path / "router.log") as router, \
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as clients:
        seen = []
        for rid, stream, where, handlers in (("unary", False, hung, 1), ("streaming", True, stalled, 1),
                                             ("before-first-event", True, hung, 2)):
            seen.append(asyncio.ensure_future(generate(clients, router.url, rid, 10, stream=stream)))
            await wait_for(lambda: where.in_handler == handlers, timeout=10, message=f"{rid} on its server")
        sent = router.send(signal.SIGTERM)
        assert await router.exited(20) == 0, router.log()
        assert time.monotonic() - sent < 8 + EXIT_SLACK_S, router.log()
        unary, streaming, before_first_event = await asyncio.gather(*seen)
        assert unary["status"] == 200 and unary["finish"] == "abort", unary
        assert before_first_event["finish"] == "abort" and before_first_event["done"], before_first_event
        assert streaming["done"] and "did not answer its abort" in str(streaming["error"]), streaming
        assert "3 request(s) answered by the router itself" in router.log()
        for rid, server in (("unary", hung), ("streaming", stalled), ("before-first-event", hung)):
            assert {"rid": rid} in server.aborts and {"rid": rid} in p.aborts, (rid, server.aborts, p.aborts)
