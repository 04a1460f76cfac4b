"""Fast tier: the patch machinery (post-import hooks, activation rules, shape checks) without SGLang."""

import sys

import pytest

from server_patches import runtime
from server_patches.runtime.base import PatchRefused, require_attrs, require_fields, require_params
from server_patches.runtime.hooks import PostImportHooks


@pytest.fixture
def module_dir(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    names = []

    def write(name, source):
        (tmp_path / f"{name}.py").write_text(source)
        names.append(name)
        return name

    yield write
    for name in names:
        sys.modules.pop(name, None)


@pytest.fixture
def hooks():
    h = PostImportHooks()
    h.install()
    yield h
    sys.meta_path.remove(h)


def test_after_hook_runs_once_the_module_executed(module_dir, hooks):
    name = module_dir("pdr_hooked_a", "VALUE = 1\n")
    seen = []
    hooks.after(name, lambda m: seen.append(m.VALUE))
    assert seen == []
    __import__(name)
    assert seen == [1]


def test_after_hook_on_an_imported_module_runs_now(module_dir, hooks):
    name = module_dir("pdr_hooked_b", "VALUE = 2\n")
    __import__(name)
    seen = []
    hooks.after(name, lambda m: seen.append(m.VALUE))
    assert seen == [2]


def test_around_hook_wraps_execution_and_a_refusal_fails_the_import(module_dir, hooks):
    name = module_dir("pdr_hooked_c", "import builtins\nVALUE = builtins.PDR_AROUND\n")
    import builtins

    def around(run, module):
        builtins.PDR_AROUND = 3
        try:
            run(module)
        finally:
            del builtins.PDR_AROUND

    hooks.around(name, around)
    assert __import__(name).VALUE == 3 and not hasattr(builtins, "PDR_AROUND")

    other = module_dir("pdr_hooked_d", "X = 1\n")

    def refuse(m):
        raise PatchRefused("demo", "not the code it was written for")

    hooks.after(other, refuse)
    with pytest.raises(PatchRefused, match="patch 'demo' refused"):
        __import__(other)


def test_shape_checks_name_what_is_missing():
    class Thing:
        a = 1

        def method(self, obj, request=None):
            pass

    require_attrs("p", Thing, ["a"])
    with pytest.raises(PatchRefused, match="has no b"):
        require_attrs("p", Thing, ["a", "b"])
    require_params("p", Thing.method, ["self", "obj", "request"])
    with pytest.raises(PatchRefused, match="does not take"):
        require_params("p", Thing.method, ["self", "req"])

    class Struct:
        __struct_fields__ = ("new_role", "prepare_only")

    require_fields("p", Struct, ["new_role"])
    with pytest.raises(PatchRefused, match="lacks field"):
        require_fields("p", Struct, ["new_role", "decode_cuda_graph_bs"])


def test_cpu_patches_only_with_device_cpu():
    gpu = runtime.settings_from_env({})
    cpu = runtime.settings_from_env({"PDR_SERVER_PATCHES_CPU": "1"})
    assert {p.name for p in runtime.selected(gpu)} == {"convert_pd_role", "prefix_cache_on_role_switch",
                                                      "prefill_endpoint_on_role_switch"}
    assert len(runtime.selected(cpu)) == 7


def test_disabling_a_patch_and_refusing_unknown_names():
    settings = runtime.settings_from_env({"PDR_SERVER_PATCHES_DISABLE": "prefix_cache_on_role_switch"})
    assert "prefix_cache_on_role_switch" not in {p.name for p in runtime.selected(settings)}
    with pytest.raises(PatchRefused, match="unknown patch name"):
        runtime.settings_from_env({"PDR_SERVER_PATCHES_DISABLE": "prefix_cache"})


def test_every_patch_states_its_sglang_versions():
    for patch in runtime.ALL_PATCHES:
        assert patch.sglang_versions == frozenset({"0.5.23"}), patch.name


# ---- prefill_endpoint_on_role_switch, on stand-ins for SGLang's KV manager and socket factory --------------
class _FakeSocket:
    def __init__(self, taken=()):
        self.bound: list[str] = []
        self.taken = set(taken)

    def bind(self, endpoint: str) -> None:
        if int(endpoint.rsplit(":", 1)[1]) in self.taken:
            raise OSError("Address already in use")
        self.bound.append(endpoint)


def _fake_kv_stack(taken=()):
    import itertools
    import types as types_

    ports = itertools.count(5000)
    sockets: list[_FakeSocket] = []

    def get_zmq_socket_on_host(context, socket_type, host=None):
        sockets.append(_FakeSocket(taken))
        return next(ports), sockets[-1]

    common = types_.SimpleNamespace(get_zmq_socket_on_host=get_zmq_socket_on_host)

    class Manager:
        def __init__(self, args, disaggregation_mode, server_args=None):
            self.disaggregation_mode = disaggregation_mode
            self.rank_port, self.server_socket = common.get_zmq_socket_on_host(None, "PULL", "10.0.0.1")
            if disaggregation_mode == "prefill":
                self.decode_kv_args_table = {}

        def _publish_peer_registration(self, mooncake_session_id, decode_kv_args):
            self.decode_kv_args_table[mooncake_session_id] = decode_kv_args

        def teardown(self):
            self.torn_down = True

    return common, Manager, sockets


def test_a_prefill_back_from_decode_listens_where_it_did_with_its_decode_registrations():
    from server_patches.runtime.prefill_endpoint import apply

    common, Manager, sockets = _fake_kv_stack()
    apply(common, Manager, "prefill")
    first = Manager(None, "prefill")
    first._publish_peer_registration("decode-a:1", "kv-args-a")
    first.teardown()
    assert first.torn_down
    as_decode = Manager(None, "decode")  # a decode KV manager makes nothing extra
    as_decode.teardown()
    second = Manager(None, "prefill")
    assert second.rank_port != first.rank_port
    assert second.server_socket.bound == [f"tcp://10.0.0.1:{first.rank_port}"]
    assert second.decode_kv_args_table == {"decode-a:1": "kv-args-a"}
    second._publish_peer_registration("decode-b:1", "kv-args-b")
    second.teardown()
    third = Manager(None, "prefill")
    assert third.server_socket.bound == [f"tcp://10.0.0.1:{first.rank_port}", f"tcp://10.0.0.1:{second.rank_port}"]
    assert third.decode_kv_args_table == {"decode-a:1": "kv-args-a", "decode-b:1": "kv-args-b"}
    assert [s.bound for s in sockets if s not in (second.server_socket, third.server_socket)] == [[], []]


def test_a_former_port_taken_meanwhile_is_skipped():
    from server_patches.runtime.prefill_endpoint import apply

    common, Manager, _ = _fake_kv_stack(taken={5000})
    apply(common, Manager, "prefill")
    first = Manager(None, "prefill")
    first.teardown()
    again = Manager(None, "prefill")
    assert again.rank_port == 5001 and again.server_socket.bound == []
