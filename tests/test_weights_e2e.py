"""Fleet-wide abort, pause and weight updates end to end: pd-router in front of simulated SGLang workers.

Real HTTP on loopback: the router app, simulated P and D servers (their PD transfer, weight lock, pause
modes and aborts included), and clients that keep sending requests while the fleet is updated.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import aiohttp
import orjson
import pytest

from router.server.app import create_app
from router.core.config import AdmissionConfig, HealthConfig, RouterConfig, WorkerSpec
from router.core.keys import REGISTRY
from router.dataplane.admission import ADMISSION
from router.dataplane.proxy import PROXY
from router.flows.fleet_control import FLEET_CONTROL
from router.core.registry import WorkerState
from simulator.fleet import Fleet

from .helpers import wait_for

SIM = dict(health_check_s=0.0, bootstrap_retries=3, bootstrap_retry_interval_s=0.02, deferred_release_s=0.0,
           decode_step_s=0.003)
BODY = {"text": "the quick brown fox", "sampling_params": {"max_new_tokens": 16, "temperature": 0}}
CLIENT_TIMEOUT = aiohttp.ClientTimeout(total=30)


@dataclass
class Answer:
    """What a client saw: complete, abort (SGLang's clean abort answer) or error; and the weight version."""

    status: int
    outcome: str
    weight_version: str | None
    sent: float
    ended: float
    detail: str = ""
    output_tokens: int = 0


def classify(status: int, raw: bytes, stream: bool, sent: float) -> Answer:
    ended = time.monotonic()
    if status != 200:
        return Answer(status, "error", None, sent, ended, raw[:300].decode(errors="replace"))
    if stream:
        events = [block[6:] for block in raw.split(b"\n\n") if block.startswith(b"data: ")]
        if not events or events[-1] != b"[DONE]":
            return Answer(status, "error", None, sent, ended, "stream without [DONE]")
        chunks = [orjson.loads(e) for e in events[:-1]]
        if not chunks or any("error" in c for c in chunks):
            return Answer(status, "error", None, sent, ended, f"stream ended with {chunks[-1:]}")
        if "choices" in chunks[0]:  # OpenAI: the last finish_reason given
            reasons = [c["finish_reason"] for chunk in chunks for c in chunk.get("choices", []) if c["finish_reason"]]
            return _openai(status, reasons[-1] if reasons else None, sent, ended)
        last = chunks[-1]
        meta, tokens = last["meta_info"], len(last.get("output_ids") or [])
    else:
        answer = orjson.loads(raw)
        if "choices" in answer:
            return _openai(status, answer["choices"][0]["finish_reason"], sent, ended)
        meta, tokens = answer["meta_info"], len(answer.get("output_ids") or [])
    kind = meta["finish_reason"]["type"]
    outcome = "abort" if kind == "abort" else "complete" if kind in ("length", "stop") else "error"
    return Answer(status, outcome, meta.get("weight_version"), sent, ended, str(meta["finish_reason"]), tokens)


def _openai(status: int, reason: str | None, sent: float, ended: float) -> Answer:
    outcome = "abort" if reason == "abort" else "complete" if reason in ("length", "stop") else "error"
    return Answer(status, outcome, None, sent, ended, str(reason))


@dataclass
class Router:
    http: object
    fleet: Fleet

    @property
    def registry(self):
        return self.http.app[REGISTRY]

    @property
    def flow(self):
        return self.http.app[FLEET_CONTROL]

    @property
    def admission(self):
        return self.http.app[ADMISSION]

    @property
    def live(self):
        return self.http.app[PROXY].live

    def worker(self, handle):
        return self.registry.get(handle.url)

    def inflight(self) -> int:
        return sum(w.inflight for w in self.registry.workers())

    def decoding(self) -> int:
        """Requests in flight on the decode side (a prefill leg ends once its KV has been taken)."""
        return sum(w.inflight for w in self.registry.workers() if w.role.value == "decode")

    async def call(self, path: str, body: dict | None = None, method: str = "POST") -> tuple[int, object]:
        resp = await self.http.request(method, path, json=body, timeout=CLIENT_TIMEOUT)
        raw = await resp.read()
        return resp.status, (orjson.loads(raw) if raw else None)

    async def generate(self, body: dict = BODY, *, stream: bool = False, path: str = "/generate") -> Answer:
        sent = time.monotonic()
        try:
            resp = await self.http.post(path, json={**body, "stream": stream}, timeout=CLIENT_TIMEOUT)
            raw = await resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            return Answer(0, "error", None, sent, time.monotonic(), f"{type(exc).__name__}: {exc}")
        return classify(resp.status, raw, stream, sent)

    async def versions(self) -> list[str]:
        return [(await self.fleet.state(h))["weight_version"] for h in self.fleet.workers]


@pytest.fixture
async def sim_router(aiohttp_client):
    """`router = await sim_router(prefill=2, decode=2, router={...}, **worker_settings)`"""
    fleets: list[Fleet] = []

    async def build(prefill: int = 2, decode: int = 2, *, router: dict | None = None, **settings) -> Router:
        fleet = await Fleet(prefill, decode, **{**SIM, **settings}).start()
        fleets.append(fleet)
        options = {"health": HealthConfig(enabled=False), **(router or {})}
        config = RouterConfig(prefill=tuple(WorkerSpec(h.url, h.bootstrap_port) for h in fleet.prefill),
                              decode=tuple(WorkerSpec(h.url) for h in fleet.decode), **options).validated()
        http = await aiohttp_client(create_app(config), server_kwargs={"handler_cancellation": True})
        return Router(http, fleet)

    yield build
    for fleet in fleets:
        await fleet.stop()


@dataclass
class Load:
    """`concurrency` clients sending requests back to back (every other one streaming) until stopped."""

    router: Router
    concurrency: int = 12
    answers: list[Answer] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    async def _user(self, index: int) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            self.answers.append(await self.router.generate(stream=(index + n) % 2 == 0))

    def start(self) -> "Load":
        self._tasks = [asyncio.ensure_future(self._user(i)) for i in range(self.concurrency)]
        return self

    async def finish(self) -> list[Answer]:
        self._stop.set()
        await asyncio.gather(*self._tasks)
        return self.answers

    def count(self, outcome: str) -> int:
        return sum(a.outcome == outcome for a in self.answers)


async def quiet(router: Router) -> None:
    await wait_for(lambda: router.inflight() == 0 and len(router.live) == 0, timeout=10,
                   message="router in-flight back to 0")
    for handle in router.fleet.workers:
        await router.fleet.wait_for(handle, lambda s: not s["running_rids"] and not s["waiting_rids"]
                                    and s["inflight_calls"] == 0)


# ---- the update under load ----------------------------------------------------------------------------
@pytest.mark.parametrize("abort", [False, True], ids=["drain", "abort_all_requests"])
async def test_update_under_load_every_request_completes_or_aborts_cleanly(sim_router, abort):
    router = await sim_router(2, 2)
    load = Load(router).start()
    await wait_for(lambda: router.inflight() >= 8 and len(load.answers) >= 12, timeout=20,
                   message="load running")
    before = len(load.answers)
    status, answer = await router.call("/update_weights_from_disk", {
        "model_path": "sim/tiny-llama-v2", "weight_version": "v2", "abort_all_requests": abort})
    returned = time.monotonic()
    assert status == 200, answer
    assert answer["success"] is True and answer["weight_version"] == "v2"
    assert [w["success"] for w in answer["workers"]] == [True] * 4
    assert {w["weight_version"] for w in answer["workers"]} == {"v2"}
    assert await router.versions() == ["v2"] * 4
    await wait_for(lambda: sum(a.sent > returned for a in load.answers) >= 12, timeout=20,
                   message="requests after the update")
    answers = await load.finish()

    assert [a for a in answers if a.outcome == "error"] == [], "no request failed, hung or lost its connection"
    assert len(answers) > before
    # Once the update has returned, every answer carries the new version: requests held during the update
    # were served by the updated fleet, and nothing finished on the old weights after it.
    after = [a for a in answers if a.ended > returned and a.outcome == "complete"]
    assert after and {a.weight_version for a in after} == {"v2"}
    aborted = [a for a in answers if a.outcome == "abort"]
    if abort:
        assert aborted, "requests in flight were aborted"
        # what the abort ended (its clients got the abort), not what was in flight when the update began
        assert answer["num_aborted_requests"] == len(aborted)
        assert answer["num_finished_requests"] >= 0
        assert all(a.weight_version in (None, "default") for a in aborted)
    else:
        assert aborted == [] and answer["num_aborted_requests"] == answer["num_finished_requests"] == 0
    op = (await router.call("/weight_updates", method="GET"))[1]["last"]
    assert op["state"] == "succeeded" and [s["name"] for s in op["steps"]] == ["hold", "quiesce", "update",
                                                                                "verify"]
    assert op["hold_s"] > 0 and op["quiesce_s"] is not None and op["held_requests"] >= 0
    await quiet(router)
    assert router.admission.is_open and router.admission.active == 0


async def test_retry_aborted_re_sends_requests_after_the_update(sim_router):
    router = await sim_router(1, 1, decode_step_s=0.01)
    tasks = [asyncio.ensure_future(router.generate()) for _ in range(6)]
    await wait_for(lambda: router.decoding() == 6, timeout=10)
    status, answer = await router.call("/update_weights_from_disk", {
        "model_path": "sim/tiny-llama", "weight_version": "v2", "abort_all_requests": True,
        "retry_aborted": True})
    assert status == 200 and answer["num_aborted_requests"] == 6, answer
    answers = await asyncio.gather(*tasks)
    # Nothing had reached the clients: each aborted request was sent again and served by the new weights.
    assert [(a.outcome, a.weight_version, a.output_tokens) for a in answers] == [("complete", "v2", 16)] * 6
    await quiet(router)


async def test_retry_aborted_cannot_re_send_a_stream_the_client_is_reading(sim_router):
    router = await sim_router(1, 1)
    await router.fleet.set_faults(router.fleet.decode[0], hang_after_tokens=2)
    stream = asyncio.ensure_future(router.generate(stream=True))
    await router.fleet.wait_for(router.fleet.decode[0], lambda s: len(s["rids_by_phase"].get("decode", [])) == 1)
    status, answer = await router.call("/update_weight_version", {"new_version": "v2", "retry_aborted": True})
    assert status == 200 and answer["num_aborted_requests"] == 1
    aborted = await stream
    assert aborted.outcome == "abort", "tokens already reached the client: it gets the abort with them"
    await router.fleet.set_faults(router.fleet.decode[0], hang_after_tokens=None)
    assert (await router.generate(stream=True)).weight_version == "v2"
    await quiet(router)


async def test_update_without_abort_waits_for_requests_to_finish(sim_router):
    router = await sim_router(1, 1, decode_step_s=0.02)
    task = asyncio.ensure_future(router.generate())
    await wait_for(lambda: router.decoding() == 1)
    status, answer = await router.call("/update_weight_version", {"new_version": "v7",
                                                                  "abort_all_requests": False})
    returned = time.monotonic()
    assert status == 200 and answer["weight_version"] == "v7"
    finished = await task
    assert (finished.outcome, finished.weight_version) == ("complete", "default")
    assert finished.ended <= returned, "the update waited for the request"


# ---- partial and total failure ------------------------------------------------------------------------
async def test_a_failed_server_leaves_routing_and_rejoins_at_the_fleet_version(sim_router):
    router = await sim_router(2, 2)
    bad = router.fleet.decode[1]
    await router.fleet.set_faults(bad, update_failure=True)
    status, answer = await router.call("/update_weights_from_disk", {"model_path": "sim/m", "weight_version": "v2"})
    assert status == 400 and answer["success"] is False
    by_url = {w["url"]: w for w in answer["workers"]}
    assert by_url[bad.url]["success"] is False and "simulated update failure" in by_url[bad.url]["message"]
    assert by_url[bad.url]["weight_version"] == "default" and by_url[bad.url]["routable"] is False
    assert answer["left_out"] == [bad.url] and answer["error"]["code"] == 400
    assert router.worker(bad).state is WorkerState.FAILED
    # The fleet serves one version only: every answer now comes from the updated servers.
    answers = await asyncio.gather(*(router.generate() for _ in range(8)))
    assert {(a.outcome, a.weight_version) for a in answers} == {("complete", "v2")}
    status, version = await router.call("/get_weight_version", method="GET")
    assert version["weight_version"] == "v2" and version["consistent"] is True
    assert {(w["url"], w["weight_version"], w["routable"]) for w in version["workers"]
            if w["url"] == bad.url} == {(bad.url, "default", False)}
    # The reconciler leaves it out while it serves another version ...
    assert (await router.call("/weight_updates/rejoin", {}))[1]["rejoined"] == []
    # ... and brings it back once it serves the fleet's (here fixed by hand on the server itself).
    async with aiohttp.ClientSession() as session:
        async with session.post(bad.url + "/update_weight_version", json={"new_version": "v2"}) as resp:
            assert resp.status == 200
    status, result = await router.call("/weight_updates/rejoin", {})
    assert result["rejoined"] == [bad.url] and router.worker(bad).state is WorkerState.ACTIVE

    # A later update that reaches every server keeps everybody in.
    await router.fleet.set_faults(bad, update_failure=False)
    status, answer = await router.call("/update_weights_from_disk", {"model_path": "sim/m", "weight_version": "v3"})
    assert status == 200 and answer["left_out"] == []
    assert await router.versions() == ["v3"] * 4
    await quiet(router)


async def test_a_failed_server_rejoins_through_the_next_update(sim_router):
    router = await sim_router(1, 2)
    bad = router.fleet.decode[0]
    await router.fleet.set_faults(bad, update_failure=True)
    assert (await router.call("/update_weight_version", {"new_version": "v2"}))[0] == 200  # no fault there
    for version in ("v3", "v4"):  # failing again keeps it out
        status, answer = await router.call("/update_weights_from_disk", {"model_path": "sim/m",
                                                                         "weight_version": version})
        assert status == 400 and answer["left_out"] == [bad.url]
        assert router.worker(bad).state is WorkerState.FAILED and list(router.flow.left_out) == [router.worker(bad).id]
    await router.fleet.set_faults(bad, update_failure=False)
    status, answer = await router.call("/update_weights_from_disk", {"model_path": "sim/m", "weight_version": "v5"})
    assert status == 200 and router.worker(bad).state is WorkerState.ACTIVE
    assert router.flow.left_out == {}


async def test_a_new_worker_on_another_version_is_kept_out_until_updated(sim_router):
    router = await sim_router(1, 1)
    assert (await router.call("/update_weight_version", {"new_version": "v2"}))[0] == 200
    async with Fleet(0, 1, **SIM) as extra:
        newcomer = extra.decode[0]
        status, _ = await router.call("/workers", {"url": newcomer.url, "worker_type": "decode"})
        assert status in (200, 201, 202)
        await wait_for(lambda: router.worker(newcomer).state is WorkerState.FAILED, timeout=10,
                       message="a worker serving 'default' does not join a fleet serving 'v2'")
        answers = await asyncio.gather(*(router.generate() for _ in range(6)))
        assert {a.weight_version for a in answers} == {"v2"}
        status, answer = await router.call("/update_weights_from_disk", {"model_path": "sim/m", "weight_version": "v3"})
        assert status == 200 and router.worker(newcomer).state is WorkerState.ACTIVE
        await quiet(router)


async def test_an_update_refused_everywhere_changes_nothing_and_keeps_serving(sim_router):
    router = await sim_router(1, 1)
    status, answer = await router.call("/update_weights_from_disk", {"model_path": "/nonexistent/model",
                                                                     "weight_version": "v2"})
    assert status == 400 and "Nothing changed" in answer["message"]
    assert all(w["routable"] for w in answer["workers"])
    assert (await router.generate()).weight_version == "default"


async def test_a_server_that_does_not_answer_is_a_502_and_is_left_out(sim_router):
    router = await sim_router(1, 2)
    gone = router.fleet.decode[1]
    await gone.worker.stop()
    status, answer = await router.call("/update_weight_version", {"new_version": "v2"})
    assert status == 502 and answer["left_out"] == [gone.url]
    assert (await router.generate()).weight_version == "v2"


async def test_quiesce_deadline_fails_the_update_and_changes_nothing(sim_router):
    router = await sim_router(1, 1, router={"drain_timeout_secs": 0.3})
    await router.fleet.set_faults(router.fleet.decode[0], hang_after_tokens=2)
    task = asyncio.ensure_future(router.generate())
    await wait_for(lambda: router.decoding() == 1)
    status, answer = await router.call("/update_weights_from_disk", {"model_path": "sim/m", "weight_version": "v2"})
    assert status == 504 and "nothing was changed" in answer["message"]
    assert await router.versions() == ["default", "default"]
    assert router.admission.is_open
    assert (await router.call("/abort_request", {"abort_all": True}))[0] == 200
    assert (await task).outcome == "abort"
    await quiet(router)


async def test_a_client_that_leaves_does_not_cancel_the_update(sim_router):
    router = await sim_router(1, 1)
    await router.fleet.set_faults(router.fleet.decode[0], update_delay_s=0.3)
    call = asyncio.ensure_future(router.call("/update_weights_from_disk", {"model_path": "sim/m",
                                                                           "weight_version": "v2"}))
    await wait_for(lambda: router.flow.current is not None and router.flow.current.current_step == "update")
    call.cancel()
    await wait_for(lambda: router.flow.current is None, timeout=10)
    assert router.flow.history[-1].state == "succeeded" and await router.versions() == ["v2", "v2"]
    assert router.admission.is_open


# ---- tensor / distributed: sessions, groups ----------------------------------------------------------
@pytest.mark.parametrize("version", ["0.5.23", "0.5.6"])
async def test_tensor_update_is_wrapped_in_a_session_where_the_server_needs_one(sim_router, version):
    router = await sim_router(1, 1, sglang_version=version)
    status, answer = await router.call("/update_weights_from_tensor", {"serialized_named_tensors": ["AAAA"],
                                                                       "weight_version": "t1"})
    assert status == 200, answer
    assert await router.versions() == ["t1", "t1"]
    states = [await router.fleet.state(h) for h in router.fleet.workers]
    assert [s["weight_session_open"] for s in states] == [False, False]


async def test_distributed_update_in_a_session_opened_through_the_router(sim_router):
    router = await sim_router(1, 2)
    status, answer = await router.call("/init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 4})
    assert status == 200, answer
    assert sorted(w["rank_offset"] for w in answer["workers"]) == [1, 2, 3] and answer["ranks_used"] == 4
    assert (await router.call("/begin_weight_update", {}))[0] == 200
    assert [(await router.fleet.state(h))["weight_session_open"] for h in router.fleet.workers] == [True] * 3
    for bucket, version in ((["a"], None), (["b"], "d1")):
        body = {"names": bucket, "dtypes": ["bfloat16"], "shapes": [[2, 2]], "weight_version": version}
        status, answer = await router.call("/update_weights_from_distributed", body)
        assert status == 200, answer
    assert (await router.call("/end_weight_update", {}))[0] == 200
    assert await router.versions() == ["d1"] * 3
    assert (await router.call("/destroy_weights_update_group", {}))[0] == 200


async def test_update_group_world_size_must_fit_the_fleet(sim_router):
    router = await sim_router(1, 1)
    status, answer = await router.call("/init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 2})
    assert status == 400 and "world_size 2 is too small" in answer["error"]["message"]


# ---- pause / continue ---------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
async def test_pause_holds_new_requests_and_continue_releases_them(sim_router, mode):
    router = await sim_router(1, 1, decode_step_s=0.02)
    running = [asyncio.ensure_future(router.generate(stream=i % 2 == 0)) for i in range(4)]
    await wait_for(lambda: router.decoding() == 4)
    status, answer = await router.call("/pause_generation", {"mode": mode})
    assert status == 200 and answer["message"] == "Generation paused successfully.", answer
    assert not router.admission.is_open and router.flow.paused == mode
    held = [asyncio.ensure_future(router.generate()) for _ in range(3)]
    await wait_for(lambda: router.admission.waiting == 3, message="new requests wait in the router")
    for handle in router.fleet.workers:
        assert (await router.fleet.state(handle))["paused"] is True
    if mode == "abort":
        assert answer["num_aborted_requests"] == 4 and router.inflight() == 0
        assert [a.outcome for a in await asyncio.gather(*running)] == ["abort"] * 4
    else:
        assert answer["num_paused_requests"] == 4 and not any(t.done() for t in running)
    status, answer = await router.call("/continue_generation", {})
    assert status == 200 and answer["message"] == "Generation continued successfully."
    assert [a.outcome for a in await asyncio.gather(*held)] == ["complete"] * 3
    if mode != "abort":
        assert [a.outcome for a in await asyncio.gather(*running)] == ["complete"] * 4
    await quiet(router)


async def test_a_fleet_hold_leaves_every_worker_routable_and_the_router_ready(sim_router):
    """The hold is the router's (admission), not a worker state: /health stays ready (a readiness probe keeps
    the router in service) and requests wait in its queue instead of finding no routable worker."""
    router = await sim_router(1, 1)
    status, _ = await router.call("/pause_generation", {"mode": "retract"})
    assert status == 200 and not router.admission.is_open
    held = asyncio.ensure_future(router.generate())
    await wait_for(lambda: router.admission.waiting == 1, message="the request waits in the router")
    status, health = await router.call("/health", method="GET")
    assert status == 200 and health["admission"]["held"] is True
    _, listing = await router.call("/workers", method="GET")
    assert [(w["state"], w["routable"]) for w in listing["workers"]] == [("active", True)] * 2
    status, _ = await router.call("/continue_generation", {})
    assert status == 200 and (await held).outcome == "complete"


async def test_pause_abort_with_retry_aborted_re_sends_after_continue(sim_router):
    router = await sim_router(1, 1, decode_step_s=0.02)
    running = [asyncio.ensure_future(router.generate()) for _ in range(3)]
    await wait_for(lambda: router.decoding() == 3)
    status, answer = await router.call("/pause_generation", {"mode": "abort", "retry_aborted": True})
    assert status == 200 and answer["num_aborted_requests"] == 3
    await wait_for(lambda: router.inflight() == 0 and len(router.live) == 0, message="aborted, waiting to re-send")
    assert not any(t.done() for t in running)
    assert (await router.call("/continue_generation", {}))[0] == 200
    assert [(a.outcome, a.output_tokens) for a in await asyncio.gather(*running)] == [("complete", 16)] * 3
    await quiet(router)


async def test_pause_without_body_and_update_while_paused(sim_router):
    router = await sim_router(1, 1)
    resp = await router.http.post("/pause_generation")  # no body at all, as old servers took it
    assert resp.status == 200
    status, answer = await router.call("/update_weights_from_disk", {"model_path": "sim/m", "weight_version": "p2"})
    assert status == 200
    assert [s["name"] for s in router.flow.history[-1].to_dict()["steps"]][:2] == ["hold", "quiesce"]
    assert router.flow.history[-1].steps[1].outcome == "skipped"
    assert not router.admission.is_open, "still paused after the update"
    held = asyncio.ensure_future(router.generate())
    await wait_for(lambda: router.admission.waiting == 1)
    assert (await router.call("/continue_generation"))[0] == 200
    assert (await held).weight_version == "p2"


async def test_a_server_that_misses_continue_is_left_out(sim_router):
    router = await sim_router(1, 2)
    assert (await router.call("/pause_generation", {"mode": "retract"}))[0] == 200
    gone = router.fleet.decode[1]
    await gone.worker.stop()
    status, answer = await router.call("/continue_generation", {})
    assert status == 502 and answer["error"]["code"] == 502
    assert router.worker(gone).state is WorkerState.FAILED
    assert router.flow.left_out[router.worker(gone).id].kind == "paused"
    assert router.admission.is_open and router.flow.paused is None
    answers = await asyncio.gather(*(router.generate() for _ in range(4)))
    assert {a.outcome for a in answers} == {"complete"}


async def test_queue_full_while_held_is_503_with_retry_after(sim_router):
    router = await sim_router(1, 1, router={"admission": AdmissionConfig(queue_size=2)})
    assert (await router.call("/pause_generation", {"mode": "abort"}))[0] == 200
    held = [asyncio.ensure_future(router.generate()) for _ in range(2)]
    await wait_for(lambda: router.admission.waiting == 2)
    resp = await router.http.post("/generate", json=BODY)
    assert resp.status == 503 and resp.headers["Retry-After"]
    assert "held (pause_generation) and the wait queue is full" in (await resp.json())["error"]["message"]
    assert (await router.call("/continue_generation", {}))[0] == 200
    assert [a.outcome for a in await asyncio.gather(*held)] == ["complete"] * 2


# ---- abort ------------------------------------------------------------------------------------------------
def rids_on(state: dict) -> list[str]:
    return sum(state["rids_by_phase"].values(), []) + state["undispatched_rids"]


async def test_abort_by_rid_reaches_both_legs(sim_router):
    router = await sim_router(2, 2)
    # The decode legs never start: each request waits on both of its servers (prefill for its partner).
    for handle in router.fleet.decode:
        await router.fleet.set_faults(handle, hang=True)
    mine = asyncio.ensure_future(router.generate({**BODY, "rid": "client-rid-1"}, stream=True))
    other = asyncio.ensure_future(router.generate(BODY))  # the router makes up its rid
    await wait_for(lambda: len(router.live) == 2 and router.inflight() == 4)
    injected = next(a.rids[0] for a in router.live if a.rids[0] != "client-rid-1")
    for rid, task in (("client-rid-1", mine), (injected, other)):
        attempt, _ = router.live.by_rid(rid)
        pair = {attempt.prefill.url, attempt.decode.url}
        for handle in router.fleet.workers:
            await router.fleet.wait_for(handle, lambda s: (rid in rids_on(s)) == (handle.url in pair))
        before = {h.url: (await router.fleet.state(h))["counters"]["aborts_matched"] for h in router.fleet.workers}
        status, body = await router.call("/abort_request", {"rid": rid})
        assert (status, body) == (200, None)  # SGLang's answer: 200, no body; and the request has ended
        assert task.done() and (await task).outcome == "abort"
        for handle in router.fleet.workers:
            state = await router.fleet.state(handle)
            assert rid not in rids_on(state)
            assert state["counters"]["aborts_matched"] - before[handle.url] == (handle.url in pair)
    await quiet(router)


async def test_abort_all_ends_every_request_cleanly(sim_router):
    router = await sim_router(1, 1)
    await router.fleet.set_faults(router.fleet.decode[0], hang_after_tokens=3)
    tasks = [asyncio.ensure_future(router.generate(stream=s)) for s in (True, False)]
    tasks += [asyncio.ensure_future(router.generate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}, stream=s,
        path="/v1/chat/completions")) for s in (True, False)]
    await wait_for(lambda: router.decoding() == 4)
    await router.fleet.wait_for(router.fleet.decode[0], lambda s: len(s["rids_by_phase"].get("decode", [])) == 4)
    status, body = await router.call("/abort_request", {"abort_all": True})
    assert (status, body) == (200, None) and router.inflight() == 0
    stream, unary = [await t for t in tasks[:2]]
    assert (stream.outcome, unary.outcome) == ("abort", "abort")
    assert 1 <= unary.output_tokens <= 3, "the partial output comes back"
    assert [(a.status, a.outcome) for a in [await t for t in tasks[2:]]] == [(200, "abort")] * 2
    await quiet(router)


async def test_a_request_aborted_before_its_transfer_gets_the_abort_answer_not_a_500(sim_router):
    router = await sim_router(1, 1)
    await router.fleet.set_faults(router.fleet.decode[0], hang=True)
    tasks = [asyncio.ensure_future(router.generate(stream=s)) for s in (False, True)]
    batch = asyncio.ensure_future(router.http.post("/generate", json={"text": ["a", "b"], "rid": ["b0", "b1"]}))
    await wait_for(lambda: router.inflight() == 6)
    assert (await router.call("/abort_request", {"abort_all": True}))[0] == 200
    unary, stream = await asyncio.gather(*tasks)
    assert (unary.status, unary.outcome, stream.outcome) == (200, "abort", "abort")
    resp = await batch
    answer = await resp.json()
    assert resp.status == 200 and [a["meta_info"]["id"] for a in answer] == ["b0", "b1"]
    assert {a["meta_info"]["finish_reason"]["type"] for a in answer} == {"abort"}
    await quiet(router)


async def test_abort_of_a_rid_the_router_does_not_know_goes_to_every_server(sim_router):
    router = await sim_router(1, 2)
    status, body = await router.call("/abort_request", {"rid": "routed-elsewhere"})
    assert (status, body) == (200, None)
    for handle in router.fleet.workers:
        assert (await router.fleet.state(handle))["counters"]["abort_requests"] == 1


# ---- GPU memory release / resume (RL colocation) ------------------------------------------------------
async def test_simulator_release_memory_needs_an_idle_server(sim_router):
    router = await sim_router(1, 1)
    decode = router.fleet.decode[0]
    await router.fleet.set_faults(decode, hang_after_tokens=2)
    task = asyncio.ensure_future(router.generate())
    await wait_for(lambda: router.decoding() == 1)
    # the router's count goes up before its leg reaches the server: wait for the server to be decoding it
    await router.fleet.wait_for(decode, lambda s: s["rids_by_phase"].get("decode"))
    async with aiohttp.ClientSession() as session:
        async with session.post(decode.url + "/release_memory_occupation", json={}) as resp:
            assert resp.status == 400 and "idle" in (await resp.json())["error"]["message"]
        await router.call("/abort_request", {"abort_all": True})
        await task
        async with session.post(decode.url + "/release_memory_occupation", json={"tags": ["kv_cache"]}) as resp:
            assert resp.status == 200 and await resp.json() is None
        assert (await router.fleet.state(decode))["released_memory"] == ["kv_cache"]
        async with session.post(decode.url + "/resume_memory_occupation", json={}) as resp:
            assert resp.status == 200
        assert (await router.fleet.state(decode))["released_memory"] == []


async def test_release_memory_quiesces_and_holds_requests_until_every_tag_is_resumed(sim_router):
    router = await sim_router(1, 1, decode_step_s=0.01)
    running = asyncio.ensure_future(router.generate())
    await wait_for(lambda: router.decoding() == 1)
    status, answer = await router.call("/release_memory_occupation", {})  # waits for the request to finish
    assert status == 200, answer
    assert (await running).outcome == "complete"
    assert answer["memory_released"] == ["cuda_graph", "kv_cache", "weights"]
    for handle in router.fleet.workers:
        assert len((await router.fleet.state(handle))["released_memory"]) == 3
    held = asyncio.ensure_future(router.generate())
    await wait_for(lambda: router.admission.waiting == 1)
    # RL colocation: weights back, update them, then the KV cache and CUDA graphs.
    assert (await router.call("/resume_memory_occupation", {"tags": ["weights"]}))[0] == 200
    assert (await router.call("/update_weights_from_disk", {"model_path": "sim/m", "weight_version": "r2"}))[0] == 200
    assert not held.done() and not router.admission.is_open
    status, answer = await router.call("/resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]})
    assert status == 200 and answer["memory_released"] == []
    assert (await held).weight_version == "r2"
    for handle in router.fleet.workers:
        assert (await router.fleet.state(handle))["released_memory"] == []


async def test_release_memory_with_abort(sim_router):
    router = await sim_router(1, 1)
    await router.fleet.set_faults(router.fleet.decode[0], hang_after_tokens=2)
    running = asyncio.ensure_future(router.generate())
    await wait_for(lambda: router.decoding() == 1)
    status, answer = await router.call("/release_memory_occupation", {"abort_all_requests": True})
    assert status == 200 and (await running).outcome == "abort"
    assert (await router.call("/resume_memory_occupation"))[0] == 200
    assert router.admission.is_open


# ---- bodies and reads --------------------------------------------------------------------------------
@pytest.mark.parametrize("path,body,fragment", [
    ("/update_weights_from_disk", {}, "model_path is required"),
    ("/update_weights_from_disk", {"model_path": 3}, "model_path must be a string"),
    ("/update_weights_from_disk", {"model_path": "m", "abort_all_requests": "yes"}, "abort_all_requests"),
    ("/update_weights_from_disk", {"model_path": "m", "bogus": 1}, "unknown field(s) bogus"),
    ("/update_weights_from_distributed", {"names": ["a"], "dtypes": ["x"], "shapes": [["1"]]}, "shapes"),
    ("/update_weights_from_tensor", {"serialized_named_tensors": "x"}, "serialized_named_tensors"),
    ("/update_weight_version", {"new_version": 2}, "new_version"),
    ("/pause_generation", {"mode": "later"}, "mode must be one of"),
    ("/continue_generation", {"torch_empty_cache": 1}, "torch_empty_cache"),
    ("/abort_request", {}, "rid"),
    ("/abort_request", {"rid": ["a"]}, "rid must be a string"),
    ("/release_memory_occupation", {"tags": "weights"}, "tags"),
    ("/init_weights_update_group", {"master_address": "h"}, "master_port is required"),
    ("/update_weights_from_disk", [1], "JSON object"),
])
async def test_bad_bodies_are_400_and_reach_no_server(sim_router, path, body, fragment):
    router = await sim_router(1, 1)
    resp = await router.http.post(path, json=body)
    assert resp.status == 400
    error = (await resp.json())["error"]
    assert fragment in error["message"]
    for handle in router.fleet.workers:
        counters = (await router.fleet.state(handle))["counters"]
        assert counters["weight_updates"] == 0 and counters["abort_requests"] == 0


async def test_weight_version_reads_show_the_fleet_and_its_disagreement(sim_router):
    router = await sim_router(1, 2)
    status, version = await router.call("/get_weight_version", method="GET")
    assert (status, version["weight_version"], version["consistent"]) == (200, "default", True)
    assert (await router.call("/update_weight_version", {"new_version": "v2"}))[0] == 200
    rogue = router.fleet.decode[1]
    async with aiohttp.ClientSession() as session:  # someone updates one server behind the router's back
        async with session.post(rogue.url + "/update_weight_version", json={"new_version": "rogue"}) as resp:
            assert resp.status == 200
    status, version = await router.call("/get_weight_version", method="GET")
    assert version["weight_version"] is None and version["consistent"] is False
    assert {w["url"]: w["weight_version"] for w in version["workers"]}[rogue.url] == "rogue"
    # The reconciler takes it out of routing; the fleet is consistent again.
    await wait_for(lambda: router.worker(rogue).state is WorkerState.FAILED, timeout=10)
    status, info = await router.call("/model_info", method="GET")
    assert info["weight_version"] == "v2" and info["model_path"]
    answers = await asyncio.gather(*(router.generate() for _ in range(6)))
    assert {a.weight_version for a in answers} == {"v2"}


async def test_an_update_waits_for_a_running_conversion_and_reaches_the_converted_server(sim_router):
    """No server switches role under a fleet operation: the update closes admission (no new conversion can
    start), waits for the one in flight, then updates every server, the converted one included."""
    router = await sim_router(prefill=2, decode=2, decode_step_s=0.02)
    long = asyncio.ensure_future(router.generate({**BODY, "sampling_params": {"max_new_tokens": 40}}))
    await wait_for(lambda: router.decoding() == 1, message="a request is decoding")
    (busy,) = [w for w in router.registry.workers() if w.role.value == "decode" and w.inflight]
    convert = asyncio.ensure_future(router.call(f"/admin/workers/{busy.id}/convert",
                                                {"mode": "drain", "new_role": "prefill"}))
    await wait_for(lambda: busy.state is WorkerState.DRAINING, message="conversion draining")
    update = asyncio.ensure_future(router.call("/update_weights_from_disk",
                                               {"model_path": "sim/m", "weight_version": "v2"}))
    await wait_for(lambda: router.flow.current is not None
                   and router.flow.current.current_step == "conversions", message="update waits")
    assert (await long).outcome == "complete"
    status, converted = await convert
    assert status == 200 and converted["new_role"] == "prefill"
    status, updated = await update
    assert status == 200, updated
    assert busy.role.value == "prefill" and busy.state is WorkerState.ACTIVE
    assert await router.versions() == ["v2"] * 4
    steps = [s["name"] for s in router.flow.history[-1].to_dict()["steps"]]
    assert steps.index("hold") < steps.index("conversions") < steps.index("update")
    await wait_for(lambda: router.inflight() == 0)
