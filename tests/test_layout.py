"""The package shows its layers: import direction, no cycles, small modules (issue 12).

Imports are read from the source (AST), so the test sees what a newcomer reads. Imports under
`if TYPE_CHECKING:` are for type checkers only and do not count.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ROUTER = ROOT / "router"
MAX_LINES = 600
MAX_TOP_LEVEL_MODULES = 8

# layer -> layers of router/ it may import (besides itself); policies/ is outside router/ and below it
ALLOWED = {
    "core": set(),
    "dataplane": {"core"},
    "control": {"core"},
    "obs": {"core", "control", "dataplane", "flows"},
    "flows": {"core", "control"},
    "cluster": {"core", "control"},
    "api": {"core", "control", "flows", "obs"},
    "ctl": set(),
    "server": {"core", "control", "dataplane", "flows", "api", "obs", "cluster"},
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(path: Path, *, top_level_only: bool) -> set[str]:
    """Absolute names of the router/policies modules a module imports at run time."""
    tree = ast.parse(path.read_text())
    this = module_name(path)
    package = this if path.name == "__init__.py" else this.rpartition(".")[0]
    found: set[str] = set()

    def visit(nodes, nested: bool) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and _is_type_checking(node):
                visit(node.orelse, nested)
                continue
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(parent + ([base] if base else []))
                found.add(base)
                for alias in node.names:  # `from router.api import info` imports a module
                    found.add(f"{base}.{alias.name}")
            if top_level_only and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef | ast.If | ast.Try
                          | ast.With | ast.AsyncWith | ast.For | ast.AsyncFor | ast.While):
                visit(getattr(node, "body", []), True)
                visit(getattr(node, "orelse", []), True)
                visit(getattr(node, "finalbody", []), True)
                for handler in getattr(node, "handlers", []):
                    visit(handler.body, True)

    visit(tree.body, False)
    return found


def router_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(ROUTER.rglob("*.py"))}


def _known(names: set[str], modules: dict[str, Path]) -> set[str]:
    return {n for n in names if n in modules}


def test_router_top_level_has_few_modules():
    top = [p.name for p in ROUTER.glob("*.py")]
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top


def test_no_module_of_router_or_policies_is_over_the_limit():
    too_long = {str(p.relative_to(ROOT)): n for p in [*ROUTER.rglob("*.py"), *(ROOT / "policies").rglob("*.py")]
                if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not too_long, too_long


def test_each_layer_imports_only_the_layers_below_it():
    modules = router_modules()
    wrong = []
    for name, path in modules.items():
        parts = name.split(".")
        if len(parts) < 3:
            continue  # router/__init__, router/__main__ assemble everything
        layer = parts[1]
        allowed = ALLOWED[layer] | {layer}
        for target in _known(imports_of(path, top_level_only=False), modules):
            tparts = target.split(".")
            if len(tparts) >= 2 and tparts[1] not in allowed and tparts[1] not in ("__init__",):
                wrong.append(f"{name} -> {target}")
    assert not wrong, "\n".join(wrong)


def test_flows_and_the_rebalancer_stay_off_the_request_path_internals():
    modules = router_modules()
    for name, path in modules.items():
        if name.startswith("router.flows") or name.startswith("router.api"):
            dataplane = {t for t in imports_of(path, top_level_only=False) if t.startswith("router.dataplane")}
            assert not dataplane, f"{name} imports {dataplane}"
    for name, path in modules.items():
        if name.startswith("router.dataplane"):
            api = {t for t in imports_of(path, top_level_only=False) if t.startswith("router.api")}
            assert not api, f"{name} imports {api}"


def test_no_import_cycle():
    modules = router_modules()
    graph = {name: _known(imports_of(path, top_level_only=True), modules) - {name}
             for name, path in modules.items()}
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def dfs(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in graph[node]:
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                dfs(nxt)
        stack.pop()
        state[node] = 2

    for node in graph:
        if node not in state:
            dfs(node)
    assert not cycles, cycles
