"""PUT /workers/{id} (SMG's update of a worker): a role change runs a live conversion, a prefill's bootstrap port
is corrected, the peers' other fields are named as ignored, and what cannot be is refused."""

from __future__ import annotations

import pytest

from router.core.registry import Role
from simulator.fleet import Fleet

from .sim_support import FAST


@pytest.fixture
async def fleet():
    async with Fleet(1, 2, **FAST) as f:
        yield f


async def test_put_converts_corrects_the_port_and_refuses_what_it_cannot(fleet, make_router):
    router = await make_router(fleet.prefill, fleet.decode)
    registry = router.registry
    decode = registry.get(fleet.decode[1].url)
    prefill = registry.get(fleet.prefill[0].url)

    resp = await router.put(f"/workers/{decode.id}", json={"worker_type": "prefill", "labels": {"zone": "a"},
                                                           "priority": 10})
    body = await resp.json()
    assert resp.status == 200, body
    assert body["conversion"]["outcome"] == "converted" and body["worker"]["role"] == "prefill"
    assert decode.role is Role.PREFILL and decode.routable
    assert "ignored_fields" not in body  # labels and priority are kept on the worker
    assert body["worker"]["labels"] == {"zone": "a"} and body["worker"]["priority"] == 10
    resp = await router.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}})
    assert resp.status == 200  # the fleet serves on, 2P+1D

    port = prefill.bootstrap_port
    resp = await router.put(f"/workers/{prefill.id}", json={"bootstrap_port": port + 1})
    assert resp.status == 200 and prefill.bootstrap_port == port + 1
    resp = await router.put(f"/workers/{prefill.id}", json={"url": fleet.prefill[0].url, "bootstrap_port": port})
    assert resp.status == 200 and prefill.bootstrap_port == port

    for body, fragment in [({"boostrap_port": 1}, "unknown field 'boostrap_port'"),
                           ({"url": fleet.decode[0].url}, "is not worker"),
                           ({"worker_type": "encode"}, "must be 'prefill' or 'decode'")]:
        resp = await router.put(f"/workers/{prefill.id}", json=body)
        assert resp.status == 400 and fragment in (await resp.json())["error"]["message"], body
    only = registry.get(fleet.decode[0].url)
    resp = await router.put(f"/workers/{only.id}", json={"bootstrap_port": 9})
    assert resp.status == 400 and "only a prefill" in (await resp.json())["error"]["message"]
    assert (await router.put("/workers/nope", json={})).status == 404
    resp = await router.patch(f"/workers/{prefill.id}", json={"cost": 2.0, "health": {"timeout_secs": 3}})
    answer = await resp.json()
    assert resp.status == 200 and answer["ignored_fields"] == ["health"] and answer["worker"]["cost"] == 2.0
    assert prefill.bootstrap_port == port and only.role is Role.DECODE
