"""Admin body models: SGLang's fields pass through as sent, strict JSON types, every problem in one 400."""

from __future__ import annotations

import pytest

from router.api.bodies import Empty, parse_body
from router.api.control_bodies import (AbortRequest, BeginUpdate, ContinueGeneration, DestroyUpdateGroup,
                                       InitUpdateGroup, PauseGeneration, ReleaseMemory, ResumeMemory, Retryable,
                                       UpdateFromDisk, UpdateFromDistributed, UpdateFromTensor, UpdateVersion)
from router.api.conversion_bodies import ConvertPdRole, ConvertWorker, PdRoleSwitch
from router.core.errors import BadRequest
from router.core.registry import Role
from router.flows.conversion_record import DrainMode
from router.flows.role_switch import CONVERT_PD_ROLE

UPDATE_COMMON = {"abort_all_requests": True, "weight_version": "v2", "load_format": None, "flush_cache": False,
                 "torch_empty_cache": True}
# Every field of SGLang 0.5.23's bodies that the router forwards, with a value of its type.
SGLANG_BODIES = [
    (UpdateFromDisk, {"model_path": "/m", **UPDATE_COMMON, "is_async": True, "keep_pause": False,
                      "recapture_cuda_graph": True, "token_step": 3, "manifest": {"files": ["a"]}}),
    (UpdateFromDisk, {"model_path": "/m", "weight_version": None, "manifest": None}),
    (UpdateFromDistributed, {"names": ["w"], "dtypes": ["bf16"], "shapes": [[2, 3]], "group_name": "g",
                             "selector": "draft", **UPDATE_COMMON}),
    (UpdateFromTensor, {"serialized_named_tensors": ["YQ=="], "selector": "all", **UPDATE_COMMON}),
    (UpdateVersion, {"new_version": "v3", "abort_all_requests": False}),
    (InitUpdateGroup, {"master_address": "h", "master_port": 1, "rank_offset": 1, "world_size": 3,
                       "group_name": "g", "backend": "nccl"}),
    (DestroyUpdateGroup, {"group_name": "g"}),
    (BeginUpdate, {"selector": "target"}),
    (AbortRequest, {"rid": "r1", "abort_all": False}),
    (PauseGeneration, {"mode": "retract"}),
    (ContinueGeneration, {"torch_empty_cache": True}),
    (ReleaseMemory, {"tags": ["kv_cache", "weights"]}),
    (ResumeMemory, {"tags": None}),
]


@pytest.mark.parametrize("model,body", SGLANG_BODIES)
def test_sglang_fields_are_forwarded_as_sent(model, body):
    assert parse_body(model, body, "x").forwarded() == body


@pytest.mark.parametrize("model,body", [(m, b) for m, b in SGLANG_BODIES if issubclass(m, Retryable)])
def test_retry_aborted_is_the_routers_own(model, body):
    parsed = parse_body(model, {**body, "retry_aborted": False}, "x")
    assert parsed.forwarded() == body and parsed.retry(default=True) is False


def test_a_field_left_out_is_not_forwarded_and_defaults_stay_the_routers():
    body = parse_body(UpdateFromDisk, {"model_path": "/m"}, "update_weights_from_disk")
    assert body.forwarded() == {"model_path": "/m"} and body.abort_all_requests is False
    version = parse_body(UpdateVersion, {"new_version": "v"}, "update_weight_version")
    assert version.forwarded() == {"new_version": "v"} and version.abort_all_requests is True


def test_router_fields_are_read_not_forwarded():
    body = parse_body(ReleaseMemory, {"tags": ["weights"], "abort_all_requests": True, "retry_aborted": False},
                      "release_memory_occupation")
    assert body.forwarded() == {"tags": ["weights"]}
    assert body.abort_all_requests is True and body.retry(default=True) is False
    assert parse_body(ReleaseMemory, {}, "release_memory_occupation").retry(default=True) is True


def problems_of(model, body) -> dict:
    with pytest.raises(BadRequest) as info:
        parse_body(model, body, "update_weights_from_distributed")
    return info.value.body()["error"]


def test_every_problem_is_reported_at_once_unknown_then_missing_then_as_written():
    error = problems_of(UpdateFromDistributed, {"shapes": [["1"]], "zz": 1, "retry_aborted": None,
                                                "selector": "both", "aa": None})
    assert error["code"] == 400 and error["type"] == "invalid_request_error" and error["param"] == "aa"
    assert error["problems"][0].startswith("unknown field(s) aa, zz (accepted: abort_all_requests, dtypes,")
    assert error["problems"][1:] == [
        "names is required", "dtypes is required",
        "shapes must be a list of lists of integers, got [['1']]",
        "retry_aborted must be true or false, got None",
        "selector must be one of target, draft, all, got 'both'",
    ]
    assert error["message"] == "invalid update_weights_from_distributed request: " + "; ".join(error["problems"])


@pytest.mark.parametrize("model,body,field", [
    (InitUpdateGroup, {"master_address": "h", "master_port": "29500", "rank_offset": 0, "world_size": 1},
     "master_port"),
    (InitUpdateGroup, {"master_address": "h", "master_port": 1, "rank_offset": True, "world_size": 1},
     "rank_offset"),
    (InitUpdateGroup, {"master_address": "h", "master_port": 1, "rank_offset": 0, "world_size": 1.0},
     "world_size"),
    (UpdateFromDisk, {"model_path": "m", "abort_all_requests": 1}, "abort_all_requests"),
    (UpdateFromDisk, {"model_path": "m", "flush_cache": None}, "flush_cache"),
    (AbortRequest, {"rid": None, "abort_all": True}, "rid"),
    (PdRoleSwitch, {"worker_url": "http://h:1", "new_role": "decode", "bootstrap_port": True}, "bootstrap_port"),
    (ConvertWorker, {"timeout_s": "5"}, "timeout_s"),
    (ConvertWorker, {"decode_cuda_graph_bs": []}, "decode_cuda_graph_bs"),
])
def test_json_types_are_taken_as_they_are(model, body, field):
    error = problems_of(model, body)
    assert error["param"] == field and error["problems"][0].startswith(f"{field} must be ")


def test_conversion_null_means_not_given_but_an_unknown_null_is_refused():
    body = parse_body(PdRoleSwitch, {"worker_url": "http://h:1", "new_role": "decode", "mode": None,
                                     "drain_timeout_secs": None, "bootstrap_port": None}, "pd_role_switch")
    assert body.mode is DrainMode.DRAIN and body.plan().server_options == {}
    assert problems_of(PdRoleSwitch, {"worker_url": None, "new_role": "decode"})["problems"] == [
        "worker_url is required"]
    assert problems_of(ConvertWorker, {"drain": None})["param"] == "drain"


def test_a_worker_url_says_what_is_wrong_with_it():
    error = problems_of(ConvertPdRole, {"server_url": "http://h:1/path"})
    assert error["problems"] == ["server_url: invalid worker url 'http://h:1/path': must be scheme://host:port only"]


def test_conversion_bodies_become_plans():
    plan = parse_body(PdRoleSwitch, {"worker_url": "http://h:1", "new_role": "decode", "mode": "abort",
                                     "drain_timeout_secs": 5, "decode_cuda_graph_memory_gb": 0,
                                     "server_options": {"prepare_only": True}}, "pd_role_switch").plan()
    assert (plan.mode, plan.new_role, plan.empty_timeout_s, plan.api) == (DrainMode.ABORT, Role.DECODE, 5, None)
    assert plan.server_options == {"decode_cuda_graph_memory_gb": 0}
    assert plan.raw_server_options == {"prepare_only": True}
    seed = parse_body(ConvertPdRole, {"server_url": "http://h:1", "disable_radix_cache": True,
                                      "switch_timeout_secs": 2.5}, "convert_pd_role").plan()
    assert (seed.new_role, seed.switch_timeout_s, seed.api) == (None, 2.5, CONVERT_PD_ROLE)
    assert seed.server_options == {"disable_radix_cache": True}
    admin = parse_body(ConvertWorker, {"verify_timeout_s": 1, "wait": False}, "convert")
    assert admin.wait is False and admin.plan().verify_timeout_s == 1 and admin.plan().new_role is None


def test_an_empty_body_takes_no_field():
    assert parse_body(Empty, {}, "reinstate") == Empty()
    assert problems_of(Empty, {"force": True})["problems"] == ["unknown field(s) force (accepted: none)"]


# ---- over HTTP ------------------------------------------------------------------------------------------
async def test_a_bad_admin_body_answers_every_problem_in_the_error_shape(sim_workers, make_router):
    p1, d1 = await sim_workers(1, 1)
    client = await make_router([p1], [d1])
    resp = await client.post("/pd_role_switch", json={"worker_url": p1.url, "new_role": "regular",
                                                      "drain_timeout_secs": 0, "bogus": 1})
    answer = await resp.json()
    assert resp.status == 400 and answer["success"] is False and answer["old_role"] is None
    assert answer["error"]["param"] == "bogus" and len(answer["error"]["problems"]) == 3
    assert answer["message"] == answer["error"]["message"]
    resp = await client.post("/update_weights_from_disk", json={"model_path": 1, "token_step": "2"})
    error = (await resp.json())["error"]
    assert resp.status == 400 and error["problems"] == ["model_path must be a string, got 1",
                                                        "token_step must be an integer, got '2'"]
    assert p1.switch_calls == []
