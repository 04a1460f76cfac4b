"""The flows' place in the layers: they reach the request path only through core's RequestPathControl, and
the modules they were split into stay small."""

from __future__ import annotations

import ast
from pathlib import Path

import router.flows

FLOWS = Path(router.flows.__file__).parent
ALLOWED = ("router.core", "router.control", "router.flows", "policies")  # policies: the rebalancer's pure core


def imports_of(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
    return found


def test_flows_import_only_core_control_and_each_other():
    strays = {path.name: sorted(m for m in imports_of(path)
                                if m.split(".")[0] in ("router", "policies") and not m.startswith(ALLOWED))
              for path in sorted(FLOWS.glob("*.py"))}
    assert {name: mods for name, mods in strays.items() if mods} == {}


def test_no_flow_module_is_over_600_lines():
    lengths = {path.name: len(path.read_text().splitlines()) for path in FLOWS.glob("*.py")}
    assert {name: n for name, n in lengths.items() if n > 600} == {}


def test_flows_mark_requests_only_through_the_coordinator():
    """One way of marking requests before the router aborts their servers: core's `stop_here`, which
    `Coordinator.stop_routing` runs at every replica, the operation's own first. No flow marks on its own (it
    would read differently with one replica than with five)."""
    marking = ("mark_on", "mark_all", "mark_waiting_on_prefill", "mark_aborted")
    calls = {path.name: sorted({node.func.attr for node in ast.walk(ast.parse(path.read_text()))
                                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                                and node.func.attr in marking})
             for path in sorted(FLOWS.glob("*.py"))}
    assert {name: found for name, found in calls.items() if found} == {}
