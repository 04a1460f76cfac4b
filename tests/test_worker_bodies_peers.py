"""POST /workers takes every field of the peers' worker bodies (sgl-router 0.3.2's WorkerConfigRequest, SMG
1.13's WorkerSpec), names the ones it does not act on, and refuses only a field no peer knows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from router.core.worker_entry import PEER_FIELDS, SETTINGS, WorkerEntryError, parse_worker_entry

API = json.loads((Path(__file__).resolve().parent / "fixtures" / "peers" / "worker_api.json").read_text())
PEER_BODY_FIELDS = (set(API["sglang_router-0.3.2"]["POST /workers"]["fields"])
                    | set(API["smg-1.13.0"]["POST /workers"]["fields"]))
SAMPLE = {str: "x", int: 3, dict: {}, list: [], bool: True, None: None, (int, float): 1.5}


def test_every_peer_field_is_known():
    assert PEER_BODY_FIELDS - {"url", "worker_type", "bootstrap_port"} == set(PEER_FIELDS)


async def test_a_peer_body_registers_and_its_other_fields_are_named(sim_workers, make_router):
    p, p2, d = await sim_workers(prefill=2, decode=1)
    router = await make_router([p], [d])
    body = {"url": p2.url, "worker_type": "prefill", "bootstrap_port": p2.bootstrap_port,
            "labels": {"zone": "a"}, "priority": 80, "cost": 2.0, "api_key": "sk-never-shown", "model_id": "m",
            **{name: SAMPLE[kind] for name, kind in PEER_FIELDS.items()
               if name not in ("labels", "priority", "cost", "api_key", "model_id")}}
    resp = await router.post("/workers", json=body)
    answer = await resp.json()
    assert resp.status == 200, answer
    assert set(answer["ignored_fields"]) == set(PEER_FIELDS) - set(SETTINGS)  # those four the worker keeps
    assert answer["worker"]["labels"] == {"zone": "a"} and answer["worker"]["priority"] == 80
    assert answer["worker"]["role"] == "prefill" and answer["worker"]["bootstrap_port"] == p2.bootstrap_port
    assert "sk-never-shown" not in json.dumps(answer)  # the api_key is not echoed back
    # an SMG body of only what pd-router reads has nothing ignored
    resp = await router.post("/workers", json={"url": d.url.replace("127.0.0.1", "localhost")})
    assert "ignored_fields" not in await resp.json()


@pytest.mark.parametrize("body,fragment", [
    ({"boostrap_port": 9000}, "unknown field 'boostrap_port'"),
    ({"labels": ["zone"]}, "labels must be an object"),
    ({"labels": {"zone": 1}}, "labels must map strings to strings"),
    ({"priority": "high"}, "priority must be an integer"),
    ({"priority": True}, "priority must be an integer"),
    ({"cost": "1"}, "cost must be a number"),
])
async def test_a_field_no_peer_knows_or_of_the_wrong_type_is_400(sim_workers, make_router, body, fragment):
    p, d = await sim_workers()
    router = await make_router([p], [d])
    resp = await router.post("/workers", json={"url": "http://127.0.0.1:1", **body})
    answer = await resp.json()
    assert resp.status == 400 and fragment in answer["error"]["message"], answer
    assert len(router.registry.workers()) == 2


def test_other_ways_in_take_the_peer_fields_too_but_register_keeps_its_names():
    entry = parse_worker_entry({"url": "http://h:1", "labels": {"a": "b"}, "model_id": "m"})
    assert entry.ignored == ("model_id",) and entry.settings == {"labels": {"a": "b"}}
    with pytest.raises(WorkerEntryError, match="unknown field 'ignored'"):
        parse_worker_entry({"url": "http://h:1", "ignored": ["x"]})
