"""Role conversion end to end: pd-router in front of simulated SGLang workers (both server APIs).

Every test runs real HTTP on loopback: the router app, the simulated workers (their PD bootstrap and KV
transfer included), and clients that keep sending requests while a worker converts.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

import orjson
import pytest

from router.flows.conversion import CONVERSIONS
from router.server.app import create_app
from router.core.config import RetryConfig, RouterConfig, WorkerSpec
from router.core.keys import REGISTRY
from router.dataplane.proxy import PROXY
from router.core.registry import Role, WorkerState
from simulator.fleet import Fleet

from .helpers import wait_for

# Short PD deadlines and some decode time per token, so requests are in flight when a conversion starts.
SIM = dict(health_check_s=0.0, bootstrap_retries=3, bootstrap_retry_interval_s=0.02, deferred_release_s=0.0,
           decode_step_s=0.004)
BODY = {"text": "the quick brown fox", "sampling_params": {"max_new_tokens": 12, "temperature": 0}}


@dataclass
class Client:
    """The router's test client, its registry, and every request outcome the proxy recorded."""

    http: object
    fleet: Fleet
    records: list = field(default_factory=list)

    @property
    def registry(self):
        return self.http.app[REGISTRY]

    def worker(self, handle):
        return self.registry.get(handle.url)

    def inflight(self) -> list[int]:
        return [w.inflight for w in self.registry.workers()]

    async def convert(self, handle, **body) -> tuple[int, dict]:
        resp = await self.http.post(f"/admin/workers/{self.worker(handle).id}/convert", json=body)
        return resp.status, await resp.json()


@pytest.fixture
async def sim_router(aiohttp_client):
    """`client = await sim_router(prefill=2, decode=2, api="0.5.23", **worker_settings)`"""
    fleets: list[Fleet] = []

    async def build(prefill: int = 2, decode: int = 2, *, api: str = "0.5.23", router: dict | None = None,
                    **settings) -> Client:
        fleet = await Fleet(prefill, decode, api=api, enable_pd_role_switch=True, **{**SIM, **settings}).start()
        fleets.append(fleet)
        config = RouterConfig(
            prefill=tuple(WorkerSpec(h.url, h.bootstrap_port) for h in fleet.prefill),
            decode=tuple(WorkerSpec(h.url) for h in fleet.decode),
            **(router or {}),
        ).validated()
        http = await aiohttp_client(create_app(config), server_kwargs={"handler_cancellation": True})
        client = Client(http, fleet)
        http.app[PROXY].request_observers += (client.records.append,)
        return client

    yield build
    for fleet in fleets:
        await fleet.stop()


def answer_problem(status: int, raw: bytes, stream: bool) -> str | None:
    """Why a client would call this answer a failure (None: a normal, complete answer)."""
    if status != 200:
        return f"HTTP {status}: {raw[:200]!r}"
    if not stream:
        meta = orjson.loads(raw)["meta_info"]
        if meta["finish_reason"]["type"] not in ("length", "stop"):
            return f"finish_reason {meta['finish_reason']}"
        return None
    events = [block[6:] for block in raw.split(b"\n\n") if block.startswith(b"data: ")]
    if not events or events[-1] != b"[DONE]":
        return "stream without [DONE]"
    last = orjson.loads(events[-2])
    if "error" in last:
        return f"stream error {last['error']}"
    if last["meta_info"]["finish_reason"]["type"] not in ("length", "stop"):
        return f"stream finish_reason {last['meta_info']['finish_reason']}"
    return None


class Load:
    """`concurrency` clients sending requests back to back (every `stream_every`-th one streaming) until
    stopped; every answer is checked."""

    def __init__(self, client: Client, concurrency: int = 6, stream_every: int = 2) -> None:
        self.client = client
        self.concurrency = concurrency
        self.stream_every = stream_every
        self.done = 0
        self.problems: list[str] = []
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    async def _user(self, index: int) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            stream = bool(self.stream_every) and (index + n) % self.stream_every == 0
            resp = await self.client.http.post("/generate", json={**BODY, "stream": stream})
            raw = await resp.read()
            problem = answer_problem(resp.status, raw, stream)
            if problem:
                self.problems.append(problem)
            self.done += 1

    def __enter__(self) -> "Load":
        self._tasks = [asyncio.ensure_future(self._user(i)) for i in range(self.concurrency)]
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()

    async def finish(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)


async def requests_until(client: Client, condition, body: dict = BODY, timeout: float = 10.0) -> list:
    """Send requests one after another (each left running) until `condition()` holds; their tasks."""
    tasks = []
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        routed = sum(w.requests_total for w in client.registry.workers(Role.DECODE))
        tasks.append(asyncio.ensure_future(client.http.post("/generate", json=body)))
        await wait_for(lambda: sum(w.requests_total for w in client.registry.workers(Role.DECODE)) > routed
                       or tasks[-1].done())
    return tasks


async def converted_worker_serves(client: Client, handle, role: Role, load: Load) -> None:
    """The worker serves its new role: requests complete through it and the simulator saw its side of
    the PD transfer (a prefill hands KV out, a decode pulls it)."""
    counter = "kv_pulls_served" if role is Role.PREFILL else "kv_pulls_made"
    before = (await client.fleet.state(handle))["counters"][counter]
    done = load.done
    await wait_for(lambda: client.worker(handle).requests_total and load.done > done + 4, timeout=20)
    await client.fleet.wait_for(handle, lambda s: s["counters"][counter] > before, timeout=10)


# ---- conversion under load: both APIs, both modes, both directions ----------------------------------------
@pytest.mark.parametrize("api", ["0.5.23", "convert"])
@pytest.mark.parametrize("mode", ["drain", "abort"])
@pytest.mark.parametrize("direction", ["prefill->decode", "decode->prefill"])
async def test_conversion_under_load_fails_no_request(sim_router, api, mode, direction):
    client = await sim_router(2, 2, api=api)
    old_role = Role(direction.split("->")[0])
    handle = client.fleet.prefill[1] if old_role is Role.PREFILL else client.fleet.decode[1]
    worker = client.worker(handle)
    # Streams that already relayed tokens cannot be re-sent: abort mode on a decode ends them with
    # finish_reason abort (tested below), so that load is non-streaming.
    stream_every = 0 if (mode == "abort" and old_role is Role.DECODE) else 2
    with Load(client, concurrency=6, stream_every=stream_every) as load:
        await wait_for(lambda: worker.inflight > 0, timeout=10, message="requests in flight on the worker")
        status, record = await client.convert(handle, mode=mode, timeout_s=30)
        assert status == 200, record
        assert record["outcome"] == "converted" and record["api"] == ("pd_role_switch" if api == "0.5.23"
                                                                     else "convert_pd_role")
        assert [s["step"] for s in record["steps"]] == [mode, "switch", "verify"]
        assert worker.role is old_role.opposite and worker.state is WorkerState.ACTIVE
        state = await client.fleet.state(handle)
        assert state["role"] == old_role.opposite.value and state["counters"]["role_switches"] == 1
        converted_at = load.done
        await converted_worker_serves(client, handle, old_role.opposite, load)
        await wait_for(lambda: load.done > converted_at + 20, timeout=20, message="load goes on")
        await load.finish()
    assert load.problems == []
    if mode == "abort":
        assert (await client.fleet.state(handle))["counters"]["abort_all_requests"] >= 1
    await wait_for(lambda: not any(client.inflight()), message="in-flight counts back to 0")


async def test_abort_mode_re_sends_aborted_requests(sim_router):
    """Requests on the worker when it is aborted get a normal answer from another pair."""
    client = await sim_router(2, 2, decode_step_s=0.05)
    handle = client.fleet.decode[1]
    worker = client.worker(handle)
    with Load(client, concurrency=6, stream_every=0) as load:
        await wait_for(lambda: worker.inflight >= 2, timeout=10)
        status, record = await client.convert(handle, mode="abort")
        assert status == 200 and record["outcome"] == "converted"
        await load.finish()
    assert load.problems == []
    assert sum(r.retries_aborted for r in client.records) >= 2, "the aborted requests were re-sent"
    await wait_for(lambda: not any(client.inflight()))


async def test_abort_mode_ends_streams_that_had_tokens_with_sglangs_abort(sim_router):
    client = await sim_router(2, 2, decode_step_s=0.05)
    handle = client.fleet.decode[1]
    worker = client.worker(handle)
    streams = await requests_until(client, lambda: worker.inflight > 0, {**BODY, "stream": True})
    # Wait until the stream on the worker has relayed a token to its client.
    await client.fleet.wait_for(handle, lambda s: s["counters"]["generation_tokens"] >= 2)
    status, record = await client.convert(handle, mode="abort")
    assert status == 200
    finishes = []
    for resp in await asyncio.gather(*streams):
        raw = await resp.read()
        last = orjson.loads([b for b in raw.split(b"\n\n") if b.startswith(b"data: ")][-2][6:])
        finishes.append(last["meta_info"]["finish_reason"]["type"])
    assert "abort" in finishes  # the stream that had tokens on the aborted worker
    await wait_for(lambda: not any(client.inflight()))


async def test_without_retry_aborted_clients_get_sglangs_abort_answer(sim_router):
    client = await sim_router(2, 2, decode_step_s=0.05, router={"retry": RetryConfig(retry_aborted=False)})
    handle = client.fleet.decode[1]
    worker = client.worker(handle)
    running = await requests_until(client, lambda: worker.inflight > 0)
    await client.fleet.wait_for(handle, lambda s: s["rids_by_phase"].get("decode"))  # decoding: tokens made
    status, record = await client.convert(handle, mode="abort")
    assert status == 200 and record["outcome"] == "converted"
    answers = [(resp.status, orjson.loads(await resp.read())) for resp in await asyncio.gather(*running)]
    aborted = [a for status, a in answers if a["meta_info"]["finish_reason"]["type"] == "abort"]
    assert len(aborted) == 1 and all(status == 200 for status, _ in answers)  # HTTP 200 with SGLang's abort
    assert sum(r.retries_aborted for r in client.records) == 0
    await wait_for(lambda: not any(client.inflight()))


# ---- the converted worker serves its new role --------------------------------------------------------------
@pytest.mark.parametrize("api", ["0.5.23", "convert"])
async def test_prefill_converted_from_decode_is_used_with_its_new_bootstrap_port(sim_router, api):
    client = await sim_router(1, 2, api=api)
    handle = client.fleet.decode[1]
    status, record = await client.convert(handle, new_role="prefill")
    assert status == 200, record
    state = await client.fleet.state(handle)
    assert state["listener_registered"] and record["bootstrap_port"] == state["bootstrap_port"]
    if api == "convert":  # the earlier design opens a new bootstrap listener and reports its port
        assert state["bootstrap_port"] != state["launch_bootstrap_port"]
    worker = client.worker(handle)
    assert worker.role is Role.PREFILL and worker.bootstrap_port == state["bootstrap_port"]
    # Only the converted prefill is left to route through.
    resp = await client.http.delete(f"/workers/{client.worker(client.fleet.prefill[0]).id}")
    assert resp.status == 200
    for stream in (False, True):
        resp = await client.http.post("/generate", json={**BODY, "stream": stream})
        assert answer_problem(resp.status, await resp.read(), stream) is None
    served = (await client.fleet.state(handle))["counters"]["kv_pulls_served"]
    pulled = (await client.fleet.state(client.fleet.decode[0]))["counters"]["kv_pulls_made"]
    assert served == 2 and pulled == 2  # decode reached the new prefill on the port the router injected
    await wait_for(lambda: not any(client.inflight()))


# ---- failures -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("api", ["0.5.23", "convert"])
async def test_failure_that_is_safe_puts_the_worker_back(sim_router, api):
    client = await sim_router(2, 2, api=api)
    handle = client.fleet.prefill[1]
    await client.fleet.set_faults(handle, conversion_failure="safe")
    with Load(client, concurrency=4) as load:
        status, record = await client.convert(handle)
        assert status == 502 and record["outcome"] == "restored", record
        worker = client.worker(handle)
        assert worker.role is Role.PREFILL and worker.state is WorkerState.ACTIVE
        done = worker.requests_total
        await wait_for(lambda: worker.requests_total > done, timeout=10, message="routed to again")
        await load.finish()
    assert load.problems == []
    await wait_for(lambda: not any(client.inflight()))


@pytest.mark.parametrize("api", ["0.5.23", "convert"])
async def test_failure_that_is_unsafe_leaves_the_worker_failed(sim_router, api):
    client = await sim_router(2, 2, api=api)
    handle = client.fleet.decode[1]
    await client.fleet.set_faults(handle, conversion_failure="unsafe")
    with Load(client, concurrency=4) as load:
        status, record = await client.convert(handle)
        assert status == 502 and record["outcome"] == "failed", record
        worker = client.worker(handle)
        assert worker.state is WorkerState.FAILED and not worker.routable
        done, total = load.done, worker.requests_total
        await wait_for(lambda: load.done > done + 10, timeout=20)
        assert worker.requests_total == total, "a failed worker is never routed to"
        await load.finish()
    assert load.problems == []
    listing = await (await client.http.get("/workers")).json()
    assert [w["state"] for w in listing["workers"] if w["url"] == handle.url] == ["failed"]
    await wait_for(lambda: not any(client.inflight()))


async def test_last_worker_of_a_pool_is_refused(sim_router):
    client = await sim_router(1, 1)
    for handle in (client.fleet.prefill[0], client.fleet.decode[0]):
        status, body = await client.convert(handle)
        assert status == 409 and "last routable" in body["error"]["message"]
        assert (await client.fleet.state(handle))["counters"]["role_switches"] == 0
    resp = await client.http.post("/generate", json=BODY)
    assert resp.status == 200
    await wait_for(lambda: not any(client.inflight()))


async def test_two_conversions_of_one_worker_are_refused(sim_router):
    client = await sim_router(2, 2, decode_step_s=0.05)
    handle = client.fleet.decode[1]
    worker = client.worker(handle)
    with Load(client, concurrency=4, stream_every=0) as load:
        await wait_for(lambda: worker.inflight > 0, timeout=10)
        first = asyncio.ensure_future(client.convert(handle))
        await wait_for(lambda: worker.state is WorkerState.DRAINING)
        resp = await client.http.post("/pd_role_switch", json={"worker_url": handle.url, "new_role": "prefill"})
        body = await resp.json()
        assert resp.status == 409 and "already being converted" in body["message"], body
        status, record = await first
        assert status == 200 and record["outcome"] == "converted"
        await load.finish()
    assert load.problems == []
    assert (await client.fleet.state(handle))["counters"]["role_switches"] == 1
    await wait_for(lambda: not any(client.inflight()))


async def test_drain_deadline_exceeded_restores_the_worker(sim_router):
    client = await sim_router(2, 2, decode_step_s=0.02)
    handle = client.fleet.decode[1]
    worker = client.worker(handle)
    long_body = {**BODY, "sampling_params": {"max_new_tokens": 100, "temperature": 0}}  # ~2 s of decoding
    running = await requests_until(client, lambda: worker.inflight > 0, long_body)
    status, record = await client.convert(handle, timeout_s=0.3)
    assert status == 504 and record["outcome"] == "restored", record
    assert record["steps"][0]["outcome"] == "timeout" and "in flight" in record["steps"][0]["message"]
    assert [s["step"] for s in record["steps"]] == ["drain"]
    assert worker.state is WorkerState.ACTIVE and worker.role is Role.DECODE and worker.routable
    assert (await client.fleet.state(handle))["counters"]["role_switches"] == 0
    for resp in await asyncio.gather(*running):
        assert answer_problem(resp.status, await resp.read(), False) is None
    await wait_for(lambda: not any(client.inflight()))


async def test_drain_waits_until_the_server_reports_idle(sim_router):
    """A request the router does not know about (sent to the servers directly) keeps the drain waiting."""
    client = await sim_router(2, 2, decode_step_s=0.02)
    handle, prefill = client.fleet.decode[1], client.fleet.prefill[0]
    body = {**BODY, "sampling_params": {"max_new_tokens": 40, "temperature": 0}, "bootstrap_host": "127.0.0.1",
            "bootstrap_port": prefill.bootstrap_port, "bootstrap_room": 12345}
    session = client.http.session
    direct = [asyncio.ensure_future(session.post(h.url + "/generate", json=body)) for h in (prefill, handle)]
    await client.fleet.wait_for(handle, lambda s: s["running_rids"])
    status, record = await client.convert(handle, wait=False)
    assert status == 202
    conversion = client.http.app[CONVERSIONS].get(record["id"])
    await wait_for(lambda: "running" in (conversion.steps[0].message if conversion.steps else ""),
                   message="the drain sees the server busy")
    assert client.worker(handle).inflight == 0 and conversion.state == "drain"
    for resp in await asyncio.gather(*direct):
        assert resp.status == 200
        resp.release()
    await conversion.wait()
    assert conversion.outcome.value == "converted", conversion.message
    assert conversion.steps[0].duration_s > 0
    await wait_for(lambda: not any(client.inflight()))
