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
    assert {p.name for p in runtime.selected(gpu)} == {"convert_pd_role", "prefix_cache_on_role_switch"}
    assert len(runtime.selected(cpu)) == 6


def test_disabling_a_patch_and_refusing_unknown_names():
    settings = runtime.settings_from_env({"PDR_SERVER_PATCHES_DISABLE": "prefix_cache_on_role_switch"})
    assert "prefix_cache_on_role_switch" not in {p.name for p in runtime.selected(settings)}
    with pytest.raises(PatchRefused, match="unknown patch name"):
        runtime.settings_from_env({"PDR_SERVER_PATCHES_DISABLE": "prefix_cache"})


def test_every_patch_states_its_sglang_versions():
    for patch in runtime.ALL_PATCHES:
        assert patch.sglang_versions == frozenset({"0.5.23"}), patch.name
