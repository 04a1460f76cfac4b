"""No test module may monkey-patch the pytest process: importing locust (gevent's patch_all) at collection turned
every later test's threads into greenlets, and the suite hung in tests/test_tracing (its OTLP receiver's gRPC
server waited on gevent's hub). Collection of the whole tree is checked: this session's own, when it collected the whole tree (the full
suite), else one run in a child process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from . import conftest

REPO = Path(__file__).resolve().parent.parent

CHECK = """
import sys, pytest
pytest.main(["-q", "--collect-only", "-p", "no:cacheprovider", "tests"])
patched = [m for m in ("gevent", "locust") if m in sys.modules]
print("PATCHED=" + ",".join(patched))
"""


def test_collecting_the_suite_imports_neither_gevent_nor_locust():
    if conftest.COLLECTION_IMPORTS is not None:  # this session collected the whole tree: its own imports tell
        line = ["PATCHED=" + ",".join(conftest.COLLECTION_IMPORTS["patched"])]
        assert line[-1] == "PATCHED=", line[-1]
        return
    out = subprocess.run([sys.executable, "-c", CHECK], cwd=REPO, capture_output=True, text=True, timeout=240)
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("PATCHED=")]
    assert line, out.stdout[-2000:] + out.stderr[-2000:]
    assert line[-1] == "PATCHED=", line[-1]
