"""A router that dies (SIGKILL: a crash, an OOM kill, a node drain) and is started again with its original
command line serves from the servers' live state: converted servers in the pool of their live role with their
live bootstrap port, a paused fleet back with one /continue_generation, and no server routed on other weights
after a weight update the dead router left half-done. pd-router is a real process; the simulated servers run
in the test (real HTTP on loopback, PD transfer included)."""

from __future__ import annotations

import asyncio

import aiohttp
import orjson
import pytest

from simulator.fleet import Fleet

from .helpers import wait_for
from .router_process import RouterProcess

SIM = dict(health_check_s=0.0, bootstrap_retries=3, bootstrap_retry_interval_s=0.02, deferred_release_s=0.0,
           decode_step_s=0.004)
BODY = {"text": "the quick brown fox", "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
FLAGS = ("--health-check-interval-secs", "0.5")
HELD_UPDATE_S = 3600.0  # a straggler's update, held until the test releases it (update_delay_s set to 0)


def answer_of(status: int, raw: bytes, stream: bool) -> tuple[str | None, str | None]:
    """(why a client would call it a failure or None, the weight version that served it)."""
    if status != 200:
        return f"HTTP {status}: {raw[:200]!r}", None
    if stream:
        events = [block[6:] for block in raw.split(b"\n\n") if block.startswith(b"data: ")]
        if not events or events[-1] != b"[DONE]":
            return "stream without [DONE]", None
        last = orjson.loads(events[-2])
        if "error" in last:
            return f"stream error {last['error']}", None
    else:
        last = orjson.loads(raw)
    meta = last["meta_info"]
    if meta["finish_reason"]["type"] not in ("length", "stop"):
        return f"finish_reason {meta['finish_reason']}", meta.get("weight_version")
    return None, meta.get("weight_version")


class Load:
    """`concurrency` clients sending requests back to back (every other one streaming) to the router."""

    def __init__(self, router: RouterProcess, concurrency: int = 6) -> None:
        self.router = router
        self.concurrency = concurrency
        self.done = 0
        self.problems: list[str] = []
        self.versions: set[str | None] = set()
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    async def _user(self, index: int) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            stream = (index + n) % 2 == 0
            try:
                async with self.router.session.post(self.router.url + "/generate",
                                                    json={**BODY, "stream": stream}) as resp:
                    problem, version = answer_of(resp.status, await resp.read(), stream)
            except aiohttp.ClientError as exc:
                problem, version = f"{type(exc).__name__}: {exc}", None
            if problem:
                self.problems.append(problem)
            self.versions.add(version)
            self.done += 1

    def __enter__(self) -> "Load":
        self._tasks = [asyncio.ensure_future(self._user(i)) for i in range(self.concurrency)]
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()

    async def run_until(self, done: int, timeout: float = 60.0) -> None:
        target = self.done + done
        await wait_for(lambda: self.done >= target or any(t.done() for t in self._tasks), timeout=timeout,
                       message=f"{done} more requests answered")
        self._stop.set()
        await asyncio.gather(*self._tasks)


async def workers_of(router: RouterProcess) -> dict[str, dict]:
    async with router.session.get(router.url + "/workers") as resp:
        assert resp.status == 200
        return {w["url"]: w for w in (await resp.json())["workers"]}


@pytest.mark.parametrize("api", ["0.5.23", "convert"])
async def test_restart_after_conversions_routes_each_server_in_its_live_role(tmp_path, api):
    async with Fleet(2, 2, api=api, enable_pd_role_switch=True, **SIM) as fleet, \
            RouterProcess(fleet, *FLAGS, log_path=tmp_path / "router.log") as router:
        to_prefill, to_decode = fleet.decode[1], fleet.prefill[1]
        ids = {url: w["id"] for url, w in (await workers_of(router)).items()}
        for handle, role in ((to_prefill, "prefill"), (to_decode, "decode")):
            status, record = await router.call(f"/admin/workers/{ids[handle.url]}/convert", {"new_role": role})
            assert status == 200 and record["outcome"] == "converted", record
        live_port = (await fleet.state(to_prefill))["bootstrap_port"]
        if api == "convert":  # the earlier design's new prefill listens on a port of its own
            assert live_port != to_prefill.bootstrap_port
        await router.kill()
        counters = {h.url: (await fleet.state(h))["counters"] for h in (to_prefill, to_decode)}

        await router.start(serving=False)  # the original command line: to_prefill is still a --decode
        with Load(router) as load:  # as soon as its port answers
            await load.run_until(60)
        assert load.problems == [] and load.done >= 60
        workers = await workers_of(router)
        assert (workers[to_prefill.url]["worker_type"], workers[to_prefill.url]["bootstrap_port"]) == \
               ("prefill", live_port)
        assert (workers[to_decode.url]["worker_type"], workers[to_decode.url]["bootstrap_port"]) == ("decode", None)
        assert all(w["routable"] for w in workers.values())
        # Each converted server did its new role's part of the PD transfer after the restart.
        assert (await fleet.state(to_prefill))["counters"]["kv_pulls_served"] > \
               counters[to_prefill.url]["kv_pulls_served"]
        assert (await fleet.state(to_decode))["counters"]["kv_pulls_made"] > counters[to_decode.url]["kv_pulls_made"]
        log = router.log()
        assert f"--decode {to_prefill.url} is now prefill (live role): routing it as prefill" in log
        assert f"--prefill {to_decode.url} is now decode (live role): routing it as decode" in log


async def test_restart_while_the_fleet_is_paused_serves_after_one_continue(tmp_path):
    async with Fleet(1, 2, **SIM) as fleet, \
            RouterProcess(fleet, *FLAGS, log_path=tmp_path / "router.log") as router:
        status, answer = await router.call("/pause_generation", {"mode": "retract"})
        assert status == 200, answer
        await router.kill()

        await router.start(serving=False)  # this router never paused anybody
        workers = await workers_of(router)
        assert {(w["state"], (w["hold"] or {}).get("kind"), w["routable"]) for w in workers.values()} == \
               {("failed", "paused", False)}
        assert all("/ready answers 503" in w["state_reason"] for w in workers.values())
        status, answer = await router.call("/continue_generation", {})
        assert status == 200, answer
        assert all(w["routable"] for w in (await workers_of(router)).values())
        with Load(router) as load:
            await load.run_until(40)
        assert load.problems == [] and load.versions == {"default"}
        assert not any([(await fleet.state(h))["paused"] for h in fleet.workers])


async def test_restart_mid_weight_update_routes_no_server_on_other_weights(tmp_path):
    async with Fleet(2, 2, **SIM) as fleet, \
            RouterProcess(fleet, *FLAGS, log_path=tmp_path / "router.log") as router:
        straggler = fleet.decode[1]
        await fleet.set_faults(straggler, update_delay_s=HELD_UPDATE_S)  # still updating when the router dies
        update = asyncio.ensure_future(router.call("/update_weights_from_disk",
                                                   {"model_path": "sim/m2", "weight_version": "v2"}))
        others = [h for h in fleet.workers if h is not straggler]

        async def versions(handles) -> list[str]:
            return [(await fleet.state(h))["weight_version"] for h in handles]

        async def serve_v2(handles) -> bool:
            return await versions(handles) == ["v2"] * len(handles)

        await wait_for(lambda: serve_v2(others), timeout=20, message="every server but one updated")
        await router.kill()
        with pytest.raises(aiohttp.ClientError):
            await update

        await router.start(serving=False)
        with Load(router) as load:  # as soon as its port answers
            await load.run_until(40)
        assert await versions([straggler]) == ["default"], "the straggler's held update landed"
        assert load.problems == [] and load.versions == {"v2"}  # the straggler served nothing meanwhile
        workers = await workers_of(router)
        held = workers[straggler.url]
        assert (held["routable"], held["hold"]["kind"]) == (False, "weights")
        assert "serves weight_version 'default', the fleet serves 'v2'" in held["state_reason"]
        async with router.session.get(router.url + "/weight_updates") as resp:
            assert (await resp.json())["fleet_weight_version"] == "v2"
        status, answer = await router.call("/continue_generation", {})
        assert status == 200, answer
        # Once its update lands, the straggler serves the fleet's version and rejoins.
        await fleet.set_faults(straggler, update_delay_s=0.0)
        await wait_for(lambda: serve_v2([straggler]), timeout=10, message="its update lands")
        await wait_for(lambda: _routable(router, straggler.url), timeout=10,
                       message="the straggler rejoins at the fleet's version")
        with Load(router) as load:
            await load.run_until(40)
        assert load.problems == [] and load.versions == {"v2"}


async def _routable(router: RouterProcess, url: str) -> bool:
    return (await workers_of(router))[url]["routable"]
