"""The real-server tier: real SGLang servers (CPU) started through server_patches. Skipped unless `--real`
(or env PDR_REAL=1). Needs the stack: `python -m server_patches.install` (`.ci/real` does both).

One prefill+decode pair per session, with the prefix cache on (the leak fix is exercised on it); tests that
change roles put them back before they return. While developing, PDR_REAL_PAIR=RUN_DIR reuses a pair started
with `python -m server_patches.pair start --radix-cache --run-dir RUN_DIR` instead of launching one.
"""

from __future__ import annotations

import os

import pytest

from server_patches.pair import RealPair
from server_patches.stack import is_installed, resolve_paths

from .real_client import convert, live_role


def pytest_addoption(parser):
    parser.addoption("--real", action="store_true", default=False, help="run the real-SGLang-server tier")


def _real_enabled(config) -> bool:
    return bool(config.getoption("--real", default=False)) or os.environ.get("PDR_REAL") == "1"


def pytest_collection_modifyitems(config, items):
    real_dir = os.path.dirname(__file__)
    skip = pytest.mark.skip(reason="real-server tier: pass --real or set PDR_REAL=1")
    for item in items:
        if str(item.fspath).startswith(real_dir):
            item.add_marker(pytest.mark.real)
            if not _real_enabled(config):
                item.add_marker(skip)


@pytest.fixture(scope="session")
def stack_paths():
    paths = resolve_paths()
    if not is_installed(paths):
        pytest.fail(f"no real-server stack at {paths.venv}: run `python -m server_patches.install`")
    return paths


@pytest.fixture(scope="session")
def pair(stack_paths, tmp_path_factory):
    attach_to = os.environ.get("PDR_REAL_PAIR")  # a run dir of `pair start --radix-cache`: reuse, don't launch
    if attach_to:
        yield RealPair.attach(attach_to)
        return
    with RealPair.launch(paths=stack_paths, run_dir=tmp_path_factory.mktemp("pair"), radix_cache=True) as p:
        yield p


@pytest.fixture
def pd_pair(pair):
    """The session pair as launched (prefill, decode): a role a failed test left converted is converted back."""
    for server, role in ((pair.prefill, "prefill"), (pair.decode, "decode")):
        assert server.alive(), f"{role} server died; log tail:\n{server.log_tail()}"
        if live_role(server.url) != role:
            status, answer = convert(server.url, {"check_idle": False, "idle_timeout_s": 120})
            assert status == 200 and live_role(server.url) == role, answer
    return pair
