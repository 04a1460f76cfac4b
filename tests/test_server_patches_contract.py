"""Fast tier: the pure parts of server_patches (no SGLang needed)."""

import pytest

from server_patches import convert_contract as c
from server_patches.install import parse_pins, unmet_pins
from server_patches.launch_server import device_of, rewrite_args
from server_patches.runtime.prefix_cache import radix_cache_disabled_in

CPU_PREFILL = c.ServerView(
    role="prefill", bootstrap_port=8998, radix_cache_disabled_in={"prefill": False, "decode": True},
    cuda_graph_disabled=True, device="cpu",
)


def test_empty_body_is_a_plain_conversion():
    req = c.parse_convert_request({})
    assert req == c.ConvertRequest()
    assert c.parse_convert_request(None) == c.ConvertRequest()


def test_seed_design_body_parses():
    req = c.parse_convert_request(
        {"server_url": "http://0.0.0.0:30000", "check_idle": False, "bootstrap_port": 8998,
         "disable_radix_cache": True, "disable_cuda_graph": True, "decode_cuda_graph_bs": [1, 2]}
    )
    assert (req.check_idle, req.bootstrap_port, req.decode_cuda_graph_bs) == (False, 8998, (1, 2))


@pytest.mark.parametrize(
    "body, fragment",
    [
        ([], "JSON object"),
        ({"new_role": "decode"}, "unknown field 'new_role'"),
        ({"check_idle": 1}, "check_idle must be a boolean"),
        ({"check_idle": None}, "check_idle must be a boolean"),
        ({"bootstrap_port": True}, "bootstrap_port must be an integer"),
        ({"bootstrap_port": 70000}, "bootstrap_port must be an integer"),
        ({"idle_timeout_s": 0}, "idle_timeout_s must be"),
        ({"idle_timeout_s": 601}, "idle_timeout_s must be"),
        ({"decode_cuda_graph_memory_gb": -1}, "non-negative"),
        ({"decode_cuda_graph_bs": []}, "non-empty list"),
        ({"decode_cuda_graph_bs": [1, "2"]}, "non-empty list"),
    ],
)
def test_bad_bodies_are_refused_with_the_reason(body, fragment):
    with pytest.raises(c.BadConvertRequest, match=fragment):
        c.parse_convert_request(body)


def test_every_problem_is_reported_at_once():
    with pytest.raises(c.BadConvertRequest) as err:
        c.parse_convert_request({"x": 1, "check_idle": "yes", "bootstrap_port": "8998"})
    assert str(err.value).count(";") == 2


def test_plan_converts_to_the_opposite_role_with_cpu_graph_default():
    plan = c.plan_conversion(c.ConvertRequest(), CPU_PREFILL)
    assert (plan.old_role, plan.new_role, plan.decode_cuda_graph_memory_gb, plan.idle_wait_s) == (
        "prefill", "decode", 0.0, 0.0)
    back = c.plan_conversion(c.ConvertRequest(), c.ServerView(**{**CPU_PREFILL.__dict__, "role": "decode"}))
    assert (back.new_role, back.decode_cuda_graph_memory_gb) == ("prefill", None)


def test_plan_on_gpu_leaves_graph_memory_to_the_caller():
    gpu = c.ServerView(**{**CPU_PREFILL.__dict__, "device": "cuda"})
    assert c.plan_conversion(c.ConvertRequest(), gpu).decode_cuda_graph_memory_gb is None
    req = c.ConvertRequest(decode_cuda_graph_memory_gb=1.5, decode_cuda_graph_bs=(1, 4))
    plan = c.plan_conversion(req, gpu)
    assert (plan.decode_cuda_graph_memory_gb, plan.decode_cuda_graph_bs) == (1.5, [1, 4])


def test_check_idle_false_waits_up_to_the_timeout():
    plan = c.plan_conversion(c.ConvertRequest(check_idle=False, idle_timeout_s=12.0), CPU_PREFILL)
    assert plan.idle_wait_s == 12.0


@pytest.mark.parametrize(
    "req, fragment",
    [
        (c.ConvertRequest(bootstrap_port=9000), "listens on 8998"),
        (c.ConvertRequest(disable_radix_cache=False), "prefix cache disabled"),
        (c.ConvertRequest(disable_cuda_graph=False), "disable_cuda_graph=true"),
    ],
)
def test_what_an_in_place_switch_cannot_do_is_refused(req, fragment):
    with pytest.raises(c.ConversionRefused, match=fragment):
        c.plan_conversion(req, CPU_PREFILL)


def test_matching_expectations_are_accepted():
    req = c.ConvertRequest(bootstrap_port=8998, disable_radix_cache=True, disable_cuda_graph=True)
    assert c.plan_conversion(req, CPU_PREFILL).new_role == "decode"


def test_a_non_pd_server_is_refused():
    with pytest.raises(c.ConversionRefused, match="not a PD server"):
        c.plan_conversion(c.ConvertRequest(), c.ServerView(**{**CPU_PREFILL.__dict__, "role": "null"}))


def test_answer_shape():
    ok = c.answer(True, "converted prefill -> decode", 8998, old_role="prefill", new_role="decode")
    assert set(ok) == {"success", "message", "bootstrap_port", "old_role", "new_role", "safe_to_restore"}
    bad = c.answer(False, "nope", 8998, error=True)
    assert bad["error"] == {"message": "nope"} and bad["success"] is False


@pytest.mark.parametrize(
    "launch_role, launch_disabled, decode_radix, patched, expected",
    [
        ("prefill", False, False, True, {"prefill": False, "decode": True}),  # the fix
        ("prefill", False, True, True, {"prefill": False, "decode": False}),  # decode radix cache asked for
        ("prefill", True, False, True, {"prefill": True, "decode": True}),
        ("decode", True, False, True, {"prefill": True, "decode": True}),
        ("prefill", False, False, False, {"prefill": False, "decode": False}),  # upstream keeps the tree on
    ],
)
def test_prefix_cache_follows_the_role(launch_role, launch_disabled, decode_radix, patched, expected):
    assert dict(radix_cache_disabled_in(launch_role, launch_disabled, decode_radix, patched)) == expected


def test_enable_pd_convert_is_the_role_switch_flag():
    assert rewrite_args(["--port", "1", "--enable-pd-convert"]) == ["--port", "1", "--enable-pd-role-switch"]
    assert rewrite_args(["--enable-pd-convert", "--enable-pd-role-switch"]) == ["--enable-pd-role-switch"]
    assert device_of(["--device", "cpu"]) == "cpu" and device_of(["--device=cuda"]) == "cuda"
    assert device_of(["--port", "1"]) is None


def test_pins_and_local_builds():
    pins = parse_pins(["# comment", "Foo_Bar==1.0", "torch==2.13.0", "", "x==2.0+cpu"])
    assert pins == {"foo-bar": "1.0", "torch": "2.13.0", "x": "2.0+cpu"}
    installed = {"foo-bar": "1.0", "torch": "2.13.0+cpu", "x": "2.0"}
    assert unmet_pins(pins, installed) == ["x==2.0+cpu (have 2.0)"]
    assert unmet_pins({"y": "1"}, {}) == ["y==1 (have nothing)"]


def test_requirements_file_is_all_exact_pins():
    from server_patches.install import REQUIREMENTS

    pins = parse_pins(REQUIREMENTS.read_text().splitlines())
    assert len(pins) > 100 and "mooncake-transfer-engine-non-cuda" in pins
    assert not {"torch", "sglang", "torchvision"} & set(pins)
