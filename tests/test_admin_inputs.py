"""Admin inputs cannot override what the router decided: router-owned fields of a conversion, abort by rid
(never by an arbitrary prefix), forwarded query values, and the admin bodies' own size bound."""

from __future__ import annotations

import asyncio
import io

import orjson
import pytest

from router.core.config import AdmissionConfig
from router.dataplane.proxy import PROXY
from router.dataplane.live import LiveRequests

from .helpers import wait_for

MIB = 1024 * 1024


# ---- conversion: the plan's fields are the router's -------------------------------------------------------
@pytest.mark.parametrize("path,body", [
    ("/pd_role_switch", {"new_role": "prefill", "server_options": {"new_role": "decode"}}),
    ("/convert_pd_role", {"server_options": {"server_url": "http://elsewhere:1"}}),
    ("/admin/workers/ID/convert", {"new_role": "prefill", "server_options": {"new_role": "decode", "x": 1}}),
])
async def test_server_options_may_not_override_the_plan(sim_workers, make_router, path, body):
    p, d1, d2 = await sim_workers(1, 2)
    client = await make_router([p], [d1, d2])
    worker = client.registry.find(d1.url)
    url_field = {"/pd_role_switch": "worker_url", "/convert_pd_role": "server_url"}.get(path)
    body = {**body, url_field: d1.url} if url_field else body
    resp = await client.post(path.replace("ID", worker.id), json=body)
    error = (await resp.json())["error"]
    assert resp.status == 400 and error["param"] == "server_options", error
    owned = next(iter(body["server_options"]))
    assert f"server_options: {owned} may not be given here" in error["message"]
    assert d1.switch_calls == [] and worker.role.value == "decode"


async def test_other_server_options_still_reach_the_server_with_the_plans_role(sim_workers, make_router):
    p, d1, d2 = await sim_workers(1, 2)
    client = await make_router([p], [d1, d2])
    resp = await client.post("/pd_role_switch", json={"worker_url": d1.url, "new_role": "prefill",
                                                      "server_options": {"custom": 1}})
    assert resp.status == 200, await resp.text()
    assert d1.switch_calls == [{"custom": 1, "new_role": "prefill"}]


# ---- abort by rid ------------------------------------------------------------------------------------------
class Held:
    """A stand-in for an attempt in LiveRequests: what the index reads (its rids)."""

    def __init__(self, *rids: str) -> None:
        self.rids = list(rids)
        self.abort_action = None


@pytest.mark.parametrize("asked,found", [
    ("abc", ["abc", "abc_0", "abc_1"]),  # a parent rid with its n>1 sequences
    ("abc_1", ["abc_1"]),
    ("ab", None), ("abc_", None), ("abc_1x", None), ("bc", None), ("abc_00", None),
    ("batch", ["batch_0", "batch_1"]),  # a parent the attempt does not carry itself
    ("batch_1", ["batch_1"]),
])
def test_abort_by_rid_matches_the_rid_or_its_sequences_never_a_prefix(asked, found):
    live = LiveRequests()
    parent, batch, other = Held("abc", "abc_0", "abc_1"), Held("batch_0", "batch_1"), Held("abcd")
    for held in (parent, batch, other):
        live.add(held)
    result = live.by_rid(asked)
    assert (result[1] if result else None) == found
    if result:
        assert result[0] is (parent if asked.startswith("abc") else batch)


async def test_abort_of_a_prefix_aborts_no_routed_request(sim_workers, make_router):
    """`{"rid": "abc"}` is not "abc-123": the router aborts nothing of its own and forwards the rid as given
    to every server, which apply SGLang's own rule to it."""
    p, d = await sim_workers(1, 1)
    client = await make_router([p], [d])
    d.set_faults(hang_after_tokens=1)  # the decode stalls after the prefill's token
    pending = asyncio.ensure_future(client.post("/generate", json={"text": "hi", "rid": "abc-123"}))
    live = client.app[PROXY].live
    await wait_for(lambda: live.by_rid("abc-123") is not None and d.bodies(), message="request on its pair")
    attempt, _ = live.by_rid("abc-123")

    resp = await client.post("/abort_request", json={"rid": "abc"})
    assert resp.status == 200, await resp.text()
    assert p.aborts == [{"rid": "abc"}] and d.aborts == [{"rid": "abc"}]
    assert attempt.abort_action is None and not pending.done()

    d.set_faults(hang_after_tokens=None)
    answer = await pending
    assert answer.status == 200 and (await answer.json())["meta_info"]["finish_reason"]["type"] == "length"


# ---- forwarded query values --------------------------------------------------------------------------------
async def test_flush_cache_forwards_its_timeout_encoded(fake_fleet, make_router):
    p, d = await fake_fleet(1, 1)
    client = await make_router([p], [d])
    resp = await client.post("/flush_cache?timeout=%2B2.5")
    assert resp.status == 200, await resp.text()
    for fake in (p, d):
        assert fake.queries == [("/flush_cache", {"timeout": "+2.5"})]


@pytest.mark.parametrize("timeout", ["x", "-1", "nan", "", "5&abort=1#x"])
async def test_flush_cache_refuses_a_timeout_sglang_would_refuse(fake_fleet, make_router, timeout):
    """SGLang 0.5.23 answers 422 to a timeout that is not seconds >= 0: the router says so itself, with an
    `error` object, and calls no worker (relayed, every worker's 422 read as a failed flush)."""
    p, d = await fake_fleet(1, 1)
    client = await make_router([p], [d])
    resp = await client.post("/flush_cache", params={"timeout": timeout})
    assert resp.status == 400, await resp.text()
    error = (await resp.json())["error"]
    assert "timeout" in error["message"] and repr(timeout) in error["message"] and error["param"] == "timeout"
    assert p.queries == [] and d.queries == []


# ---- admin bodies' size bound ------------------------------------------------------------------------------
def padded(size: int) -> bytes:
    """A JSON object of exactly `size` bytes."""
    return b'{"pad": "' + b"x" * (size - 11) + b'"}'


def sized(data: bytes) -> io.BytesIO:
    """A body sent with its Content-Length (aiohttp warns about big raw bytes)."""
    return io.BytesIO(data)


async def chunked(data: bytes):
    for start in range(0, len(data), 64 * 1024):
        yield data[start:start + 64 * 1024]


async def test_an_admin_body_over_its_bound_is_413_before_it_is_parsed(sim_workers, make_router):
    p, d = await sim_workers(1, 1)
    client = await make_router([p], [d])
    assert (await client.post("/workers", data=sized(padded(MIB)),
                              headers={"Content-Type": "application/json"})).status == 400  # read, parsed, refused
    for data in (sized(padded(MIB + 1)), chunked(padded(4 * MIB))):  # with a Content-Length, and without one
        resp = await client.post("/workers", data=data, headers={"Content-Type": "application/json"})
        error = (await resp.json())["error"]
        assert resp.status == 413 and error["type"] == "payload_too_large" and error["limit"] == MIB, error
        assert "--max-admin-payload-size" in error["message"]
    assert len(client.registry.workers()) == 2


async def test_generation_keeps_max_payload_size(sim_workers, make_router):
    p, d = await sim_workers(1, 1)
    client = await make_router([p], [d], admission=AdmissionConfig(max_admin_payload_size=1000))
    resp = await client.post("/generate", data=sized(orjson.dumps({"text": "x" * (MIB // 2)})),
                             headers={"Content-Type": "application/json"})
    assert resp.status == 200, await resp.text()
    resp = await client.post("/workers", json={"url": "http://127.0.0.1:1", "pad": "x" * 1000})
    assert resp.status == 413
    # Serialized tensors are big by nature: that admin route keeps the generation bound.
    resp = await client.post("/update_weights_from_tensor", json={"serialized_named_tensors": "x" * 2000})
    assert resp.status == 400 and "serialized_named_tensors" in (await resp.json())["error"]["message"]
