"""The package shows its layers: import direction, no cycles, small modules, typed wiring (issues 12 and 22).

Imports are read from the source (AST), so the test sees what a newcomer reads, and every import counts: at
the top of a module, inside a function, and under `if TYPE_CHECKING:` (an arrow a type checker follows is an
arrow a reader follows). Each rule is a function from a checkout's root to its violations, so that
`test_each_rule_catches_a_planted_violation` can run it on a copy with one planted.
"""

from __future__ import annotations

import ast
import functools
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 600
MAX_TOP_LEVEL_MODULES = 8
SIZED = ("router", "policies", "simulator")  # no module of these over MAX_LINES
ACYCLIC = ("router", "policies", "simulator")  # no import cycle within each

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
# What a `setup(app)` may not do: it adds routes; the composition root (server/composition.py) builds, stores
# and starts everything else.
APP_LIFE = frozenset({"cleanup_ctx", "on_startup", "on_cleanup", "on_shutdown"})
# "Abort again until they end" has one home, `abort_until_ended` (issue 32): anywhere else, a loop that sends an
# abort and pauses (a sleep, a bounded wait for a worker's idle) is a second re-abort loop with its own timing.
REABORT_KERNEL = "router/core/reabort.py"
PAUSES = frozenset({"sleep", "wait_idle"})
# a call sends an abort when its name starts with the verb (`abort`, `abort_all`, `_abort_rids`, `abort_on`,
# `send_aborts`) or it posts to `/abort_request`; these names start with it but send nothing themselves
NOT_ABORT_SENDS = frozenset({"abort_response", "abort_until_ended"})
# A free port has one home, `harness/processes.py` (`free_port`, `free_ports`; `tests/helpers` re-exports it):
# the packages that may import it define no helper of their own that binds port 0 and hands back its number.
HARNESS_USERS = ("simulator", "tests", "bench", "loadtest", "server_patches")
# Router tests run against simulated workers (`sim_workers`); the hand-made fake (tests/fakes.py, whose docstring
# says what only it does) serves these modules' remaining tests, and no others (issue 32).
FAKE_WORKER = "tests.fakes"
FAKE_FIXTURE = "fake_fleet"
FAKE_WORKER_USERS = frozenset({
    "tests/conftest.py",  # defines `fake_fleet`
    "tests/hostile/test_bounds.py", "tests/hostile/test_poison.py", "tests/hostile/test_request_fields.py",
    "tests/test_admin_inputs.py", "tests/test_conversion_api.py", "tests/test_discovery_file.py",
    "tests/test_failures.py", "tests/test_leg_accounting.py", "tests/test_live_state.py", "tests/test_policy_routing.py",
    "tests/test_proxy.py", "tests/test_redaction.py", "tests/test_rollout_burst.py", "tests/test_shared_answers.py",
    "tests/test_shutdown.py", "tests/test_upstream_silence.py", "tests/test_workers_api.py",
})


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@functools.lru_cache(maxsize=None)
def _tree(source: str) -> ast.Module:
    return ast.parse(source)


def tree_of(path: Path) -> ast.Module:
    return _tree(path.read_text())


def imports_of(path: Path, root: Path = ROOT) -> set[str]:
    """Absolute names of the modules (and module attributes) a module imports, wherever the import is."""
    return set(_imports(path.read_text(), module_name(path, root), path.name == "__init__.py"))


@functools.lru_cache(maxsize=None)
def _imports(source: str, this: str, is_package: bool) -> frozenset[str]:
    tree = _tree(source)
    package = this if is_package else this.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
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
    return frozenset(found)


def modules_of(root: Path, package: str) -> dict[str, Path]:
    return {module_name(p, root): p for p in sorted((root / package).rglob("*.py"))}


# ---- the rules: each returns its violations ------------------------------------------------------------------
def oversized(root: Path) -> list[str]:
    return [f"{p.relative_to(root)}: {n} lines" for package in SIZED for p in sorted((root / package).rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_LINES]


def wrong_layers(root: Path) -> list[str]:
    """Imports against the layer order (type checkers' included: core names no layer above it at all)."""
    modules = modules_of(root, "router")
    wrong = []
    for name, path in modules.items():
        parts = name.split(".")
        if len(parts) < 3:
            continue  # router/__init__, router/__main__ assemble everything
        allowed = ALLOWED[parts[1]] | {parts[1]}
        for target in sorted(imports_of(path, root) & modules.keys()):
            tparts = target.split(".")
            if len(tparts) >= 2 and tparts[1] not in allowed:
                wrong.append(f"{name} -> {target}")
    return wrong


def request_path_internals(root: Path) -> list[str]:
    """The flows and the admin API reach the request path only through core's interfaces."""
    modules = modules_of(root, "router")
    wrong = []
    for name, path in modules.items():
        targets = imports_of(path, root)
        if name.startswith(("router.flows", "router.api")):
            wrong += [f"{name} -> {t}" for t in sorted(targets) if t.startswith("router.dataplane")]
        if name.startswith("router.dataplane"):
            wrong += [f"{name} -> {t}" for t in sorted(targets) if t.startswith("router.api")]
    return wrong


def cycles(root: Path) -> list[list[str]]:
    """Import cycles within each package (every import counts, see the module's docstring)."""
    found = []
    for package in ACYCLIC:
        modules = modules_of(root, package)
        graph = {name: (imports_of(path, root) & modules.keys()) - {name} for name, path in modules.items()}
        state: dict[str, int] = {}
        stack: list[str] = []

        def dfs(node: str) -> None:
            state[node] = 1
            stack.append(node)
            for nxt in sorted(graph[node]):
                if state.get(nxt) == 1:
                    found.append(stack[stack.index(nxt):] + [nxt])
                elif nxt not in state:
                    dfs(nxt)
            stack.pop()
            state[node] = 2

        for node in graph:
            if node not in state:
                dfs(node)
    return found


def untyped_app_keys(root: Path) -> list[str]:
    """Every `web.AppKey` is `web.AppKey(name, Type)` with a real type: no key typed `object` (or Any), and
    none typed for type checkers only."""
    wrong = []
    for path in sorted((root / "router").rglob("*.py")):
        for node in ast.walk(tree_of(path)):
            if not (isinstance(node, ast.Call) and _name(node.func) == "AppKey"):
                continue
            kind = node.args[1] if len(node.args) > 1 else None
            if kind is None or _name(kind) in ("object", "Any", "None"):
                wrong.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
    return wrong


def setups_beyond_routes(root: Path) -> list[str]:
    """A module's `setup(app)` adds routes, nothing more: no object stored in the app, no start-up or
    clean-up hook (that is the composition root's)."""
    wrong = []
    for path in sorted((root / "router").rglob("*.py")):
        for node in ast.walk(tree_of(path)):
            if not (isinstance(node, ast.FunctionDef) and node.name == "setup"):
                continue
            for inner in ast.walk(node):
                stored = isinstance(inner, ast.Subscript) and isinstance(inner.ctx, ast.Store)
                hooked = isinstance(inner, ast.Attribute) and inner.attr in APP_LIFE
                if stored or hooked:
                    wrong.append(f"{path.relative_to(root)}:{inner.lineno}: {ast.unparse(inner)[:100]}")
    return wrong


def re_abort_loops(root: Path) -> list[str]:
    """No loop outside the kernel both sends an abort and pauses: it aborts again through `abort_until_ended`."""
    wrong = []
    for path in sorted((root / "router").rglob("*.py")):
        if path.relative_to(root).as_posix() == REABORT_KERNEL:
            continue
        for node in ast.walk(tree_of(path)):
            if not isinstance(node, (ast.While, ast.For, ast.AsyncFor)):
                continue
            calls = list(_own_calls(node))
            if any(_sends_abort(c) for c in calls) and any(_name(c.func) in PAUSES for c in calls):
                wrong.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node).splitlines()[0]}")
    return wrong


def free_port_copies(root: Path) -> list[str]:
    """No function outside the harness binds port 0 and returns the port the OS chose."""
    wrong = []
    for package in HARNESS_USERS:
        for path in sorted((root / package).rglob("*.py")):
            for node in ast.walk(tree_of(path)):
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                binds_port_0 = any(isinstance(c, ast.Call) and _name(c.func) == "bind" and c.args
                                   and isinstance(c.args[0], ast.Tuple) and len(c.args[0].elts) == 2
                                   and isinstance(c.args[0].elts[1], ast.Constant) and c.args[0].elts[1].value == 0
                                   for c in ast.walk(node))
                hands_it_back = any(isinstance(r, ast.Return) and r.value is not None and any(
                    isinstance(c, ast.Call) and _name(c.func) == "getsockname" for c in ast.walk(r.value))
                    for r in ast.walk(node))
                if binds_port_0 and hands_it_back:
                    wrong.append(f"{path.relative_to(root)}:{node.lineno}: {node.name}")
    return wrong


def fake_worker_uses(root: Path) -> list[str]:
    """Only the allowed test modules import the fake worker or ask for its fixture, and each of them still does
    (a module moved to simulated workers leaves the list)."""
    wrong = []
    for path in sorted((root / "tests").rglob("*.py")):
        where = path.relative_to(root).as_posix()
        if where == "tests/fakes.py":
            continue
        imports = any(name == FAKE_WORKER or name.startswith(FAKE_WORKER + ".") for name in imports_of(path, root))
        asks = any(isinstance(node, ast.arg) and node.arg == FAKE_FIXTURE for node in ast.walk(tree_of(path)))
        if (imports or asks) and where not in FAKE_WORKER_USERS:
            wrong.append(f"{where}: uses the fake worker; run it on simulated workers (`sim_workers`)")
        elif where in FAKE_WORKER_USERS and not (imports or asks):
            wrong.append(f"{where}: no longer uses the fake worker; take it off FAKE_WORKER_USERS")
    return wrong


def _own_calls(node: ast.AST):
    """The calls a loop makes itself (not those of the functions or lambdas it defines)."""
    stack = list(ast.iter_child_nodes(node))
    while stack:
        inner = stack.pop()
        if isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        if isinstance(inner, ast.Call):
            yield inner
        stack.extend(ast.iter_child_nodes(inner))


def _sends_abort(call: ast.Call) -> bool:
    name = (_name(call.func) or "").lstrip("_")
    verb = name.split("_")[0] == "abort" or name.startswith("send_aborts")
    posted = any(isinstance(arg, ast.Constant) and arg.value == "/abort_request" for arg in call.args)
    return (verb and name not in NOT_ABORT_SENDS) or posted


APP_HOLDERS = ("api", "server")  # router/'s layers that may look objects up on the aiohttp app


def app_lookups(root: Path) -> list[str]:
    """Outside api/ and server/, nothing takes the app or looks an object up on it (`app[KEY]`,
    `request.app.get(KEY)`): what a flow or a component needs, the composition root passes it explicitly."""
    wrong = []
    for name, path in modules_of(root, "router").items():
        parts = name.split(".")
        if len(parts) < 3 or parts[1] in APP_HOLDERS:
            continue
        for node in ast.walk(tree_of(path)):
            target = None
            if isinstance(node, ast.Subscript):
                target = node.value
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
                target = node.func.value
            if target is not None and _name(target) == "app":
                wrong.append(f"{name}:{node.lineno}: looks an object up on the app")
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                arguments = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                wrong += [f"{name}:{node.lineno}: {node.name} takes the app" for a in arguments if a.arg == "app"]
    return wrong


def repeated_module_names(root: Path) -> list[str]:
    """A module's file name says its layer's job: no two modules of router/ share one (`keys.py` in core/ and
    in cluster/ made a reader open both to learn which is meant)."""
    where: dict[str, list[str]] = {}
    for path in sorted((root / "router").rglob("*.py")):
        if path.name not in ("__init__.py", "__main__.py"):
            where.setdefault(path.name, []).append(path.relative_to(root).as_posix())
    return [f"{name}: {', '.join(paths)}" for name, paths in sorted(where.items()) if len(paths) > 1]


OWNERSHIP_KERNEL = "router/flows/ownership.py"
OPERATION_CALLS = frozenset({"acquire", "release", "progress", "stop_routing", "inflight_elsewhere",
                             "wait_idle_elsewhere", "wait_lost"})


def operations_owned_by_hand(root: Path) -> list[str]:
    """A flow owns an operation only through `Owned` (flows/ownership.py): no flow calls the coordinator's
    operation calls or `while_owned` itself, so none keeps a ticket or wraps a lost lease its own way."""
    wrong = []
    for path in sorted((root / "router" / "flows").rglob("*.py")):
        if path.relative_to(root).as_posix() == OWNERSHIP_KERNEL:
            continue
        for node in ast.walk(tree_of(path)):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in OPERATION_CALLS and _name(func.value) == "coordinator":
                wrong.append(f"{path.relative_to(root)}:{node.lineno}: coordinator.{func.attr}")
            elif _name(func) == "while_owned":
                wrong.append(f"{path.relative_to(root)}:{node.lineno}: while_owned")
    return wrong


# An object's observers are given at its construction (issue 32): nothing outside it adds to them afterwards,
# which hid who is told of what until the root's last lines ran. So are the cluster's callbacks its runtime once
# set from outside (`publisher.fleet_now = ...`); those wired afterwards there take each other (runtime.py says).
ADDED_TO = frozenset({"append", "extend", "insert"})
CALLBACKS_GIVEN = frozenset({"fleet_now", "apply_flags", "current_op"})
# The request path's objects are given their collaborators by the composition root; they build none themselves.
GIVEN_ONLY = frozenset({"Proxy", "Dispatcher"})


def observers_wired_afterwards(root: Path) -> list[str]:
    """No `x.leg_observers.append(f)`, `x.request_observers += (f,)`, `x.observers = [...]` or
    `x.fleet_now = f` on another object (`self.` is its owner's own business)."""
    wrong = []
    for path in sorted((root / "router").rglob("*.py")):
        for node in ast.walk(tree_of(path)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ADDED_TO:
                targets = [node.func.value]
            elif isinstance(node, ast.AugAssign):
                targets = [node.target]
            elif isinstance(node, ast.Assign):
                targets = node.targets
            else:
                continue
            for target in targets:
                if (isinstance(target, ast.Attribute) and _given_at_construction(target.attr)
                        and _name(target.value) != "self"):
                    wrong.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)[:100]}")
    return wrong


def _given_at_construction(attr: str) -> bool:
    return attr == "observers" or attr.endswith("_observers") or attr in CALLBACKS_GIVEN


# The coordinator's roles (issue 32): each consumer is given the narrowest protocol of core/coordination.py that
# covers what it asks (`OperationCoordinator` for `Owned`, `FleetMembership` for the worker lifecycle...); the
# whole is named only where it is declared, implemented, built and stored under its app key.
WIDE_COORDINATOR = "Coordinator"
HOLD_THE_WHOLE = frozenset({"router/core/coordination.py", "router/cluster/coordinator.py",
                            "router/server/composition.py", "router/core/keys.py"})


def wide_coordinator_named(root: Path) -> list[str]:
    """No module but those of HOLD_THE_WHOLE imports, annotates with or otherwise names `Coordinator`."""
    wrong = []
    for path in sorted((root / "router").rglob("*.py")):
        where = path.relative_to(root).as_posix()
        if where in HOLD_THE_WHOLE:
            continue
        for node in ast.walk(tree_of(path)):
            named = (node.name if isinstance(node, ast.alias) else
                     _name(node) if isinstance(node, (ast.Name, ast.Attribute)) else None)
            if named == WIDE_COORDINATOR:
                wrong.append(f"{where}:{getattr(node, 'lineno', '?')}: names the whole coordinator")
    return wrong


def collaborators_built_inside(root: Path) -> list[str]:
    """`Proxy.__init__` and `Dispatcher.__init__` construct nothing (no call of a class, by its capitalised
    name): the composition root builds the dispatcher, the live requests, the leg room and the PD admission and
    passes them in."""
    wrong = []
    for path in sorted((root / "router").rglob("*.py")):
        for node in ast.walk(tree_of(path)):
            if not (isinstance(node, ast.ClassDef) and node.name in GIVEN_ONLY):
                continue
            for method in node.body:
                if not (isinstance(method, ast.FunctionDef) and method.name == "__init__"):
                    continue
                wrong += [f"{path.relative_to(root)}:{call.lineno}: {node.name}.__init__ builds "
                          f"{ast.unparse(call)[:80]}" for call in ast.walk(method)
                          if isinstance(call, ast.Call) and (_name(call.func) or "")[:1].isupper()]
    return wrong


CONFIG_MODEL = "router/core/config_model.py"


def hand_written_validation(root: Path) -> list[str]:
    """A config's rules have one home, the pydantic model (core/config_model.py's `ConfigModel`): no function
    named `problems` in router/ outside it, so no group goes back to listing its own problems by hand."""
    wrong = []
    for path in sorted((root / "router").rglob("*.py")):
        if path.relative_to(root).as_posix() == CONFIG_MODEL:
            continue
        wrong += [f"{path.relative_to(root)}:{node.lineno}: def {node.name}" for node in ast.walk(tree_of(path))
                  if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == "problems"]
    return wrong


def _name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


# ---- the checkout holds them ------------------------------------------------------------------------------
def test_router_top_level_has_few_modules():
    top = [p.name for p in (ROOT / "router").glob("*.py")]
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top


def test_no_module_of_router_policies_or_simulator_is_over_the_limit():
    assert not oversized(ROOT), oversized(ROOT)


def test_each_layer_imports_only_the_layers_below_it():
    wrong = wrong_layers(ROOT)
    assert not wrong, "\n".join(wrong)


def test_flows_and_the_rebalancer_stay_off_the_request_path_internals():
    wrong = request_path_internals(ROOT)
    assert not wrong, "\n".join(wrong)


def test_no_import_cycle():
    found = cycles(ROOT)
    assert not found, found


def test_every_app_key_is_typed():
    wrong = untyped_app_keys(ROOT)
    assert not wrong, "\n".join(wrong)


def test_setup_functions_only_add_routes():
    wrong = setups_beyond_routes(ROOT)
    assert not wrong, "\n".join(wrong)


def test_flows_abort_again_only_through_the_kernel():
    wrong = re_abort_loops(ROOT)
    assert not wrong, "\n".join(wrong)


def test_only_the_api_and_the_composition_root_hold_the_app():
    wrong = app_lookups(ROOT)
    assert not wrong, "\n".join(wrong)


def test_no_two_modules_share_a_name():
    wrong = repeated_module_names(ROOT)
    assert not wrong, "\n".join(wrong)


def test_flows_own_operations_only_through_the_kernel():
    wrong = operations_owned_by_hand(ROOT)
    assert not wrong, "\n".join(wrong)


def test_one_free_port_helper():
    wrong = free_port_copies(ROOT)
    assert not wrong, "\n".join(wrong)


def test_observers_are_given_at_construction():
    wrong = observers_wired_afterwards(ROOT)
    assert not wrong, "\n".join(wrong)


def test_consumers_are_given_a_role_of_the_coordinator_not_the_whole():
    wrong = wide_coordinator_named(ROOT)
    assert not wrong, "\n".join(wrong)


def test_the_request_path_is_given_its_collaborators():
    wrong = collaborators_built_inside(ROOT)
    assert not wrong, "\n".join(wrong)


def test_config_rules_live_in_the_model():
    wrong = hand_written_validation(ROOT)
    assert not wrong, "\n".join(wrong)


def test_only_the_allowed_modules_use_the_fake_worker():
    wrong = fake_worker_uses(ROOT)
    assert not wrong, "\n".join(wrong)


def test_every_test_has_a_deadline(pytestconfig):
    """pytest-timeout bounds each test (pyproject's `timeout`), so a hang fails one test, not the run."""
    assert pytestconfig.pluginmanager.hasplugin("timeout")
    assert float(pytestconfig.getini("timeout")) > 0


# ---- and each rule can fail ---------------------------------------------------------------------------------
PLANTS = {
    # rule -> (file, text appended)
    "oversized": (oversized, "simulator/planted.py", "x = 1\n" * (MAX_LINES + 1)),
    "core names an upper layer for type checkers": (
        wrong_layers, "router/core/planted.py",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from router.dataplane.proxy import Proxy\n"),
    "a flow reaches into the request path": (
        request_path_internals, "router/flows/planted.py", "def f():\n    from router.dataplane import live\n"),
    "a cycle through a type checker's import": (
        cycles, "simulator/planted_a.py",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .worker import Worker\n"),
    "a cycle in policies/ through a type checker's import": (
        cycles, "policies/planted_a.py",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .rebalance import Decision\n"),
    "a cycle through a function's import": (
        cycles, "router/core/planted_a.py", "def f():\n    from router.core import planted_b\n"),
    "a key typed object": (untyped_app_keys, "router/api/planted.py",
                           "from aiohttp import web\nTHING = web.AppKey('thing', object)\n"),
    "a key typed for type checkers only": (untyped_app_keys, "router/api/planted.py",
                                           "from aiohttp import web\nTHING: web.AppKey[int] = web.AppKey('thing')\n"),
    "a setup that stores an object": (setups_beyond_routes, "router/api/planted.py",
                                      "def setup(app):\n    app[KEY] = object()\n    app.router.add_get('/x', h)\n"),
    "a setup that adds a clean-up context": (setups_beyond_routes, "router/obs/planted.py",
                                             "def setup(app):\n    app.cleanup_ctx.append(ctx)\n"),
    "a flow that aborts again in a loop of its own": (
        re_abort_loops, "router/flows/planted.py",
        "import asyncio\nasync def f(traffic, requests):\n    while requests := traffic.still_live(requests):\n"
        "        traffic.abort(requests)\n        await asyncio.sleep(1.0)\n"),
    "abort_request posted again while waiting for a worker's idle": (
        re_abort_loops, "router/cluster/planted.py",
        "async def f(registry, upstream, worker):\n    for _ in range(3):\n"
        "        await upstream.post(worker.url, '/abort_request', {'abort_all': True})\n"
        "        await registry.wait_idle(worker, 0.25)\n"),
    "a flow that looks a service up on the app": (
        app_lookups, "router/flows/planted.py",
        "async def f(request):\n    return request.app[KEY].find('x')\n"),
    "a component handed the app": (
        app_lookups, "router/control/planted.py", "def build(app, registry):\n    return registry\n"),
    "a middleware outside the api reading the app": (
        app_lookups, "router/obs/planted.py", "async def mw(request, handler):\n    m = request.app.get(KEY)\n"),
    "a module named as one of another layer": (
        repeated_module_names, "router/flows/registry.py", "x = 1\n"),
    "a flow that takes a ticket itself": (
        operations_owned_by_hand, "router/flows/planted.py",
        "async def f(self):\n    self.ticket = await self.coordinator.acquire('x', 'fleet', {})\n"),
    "a flow that runs its waits under the lease itself": (
        operations_owned_by_hand, "router/flows/planted.py",
        "from router.core.coordination import while_owned\nasync def f(c, t, w):\n    await while_owned(c, t, w)\n"),
    "a leg observer appended after construction": (
        observers_wired_afterwards, "router/server/planted.py",
        "def wire(proxy, health):\n    proxy.dispatcher.leg_observers.append(health.on_leg)\n"),
    "request observers added to afterwards": (
        observers_wired_afterwards, "router/server/planted.py",
        "def wire(proxy, metrics):\n    proxy.request_observers += (metrics.observe_request,)\n"),
    "a flow's observers replaced from outside": (
        observers_wired_afterwards, "router/server/planted.py",
        "def wire(conversions, f):\n    conversions.observers = [f]\n"),
    "a cluster callback set from outside": (
        observers_wired_afterwards, "router/cluster/planted.py",
        "def wire(publisher, cluster):\n    publisher.fleet_now = cluster.fleet_record\n"),
    "a flow given the whole coordinator": (
        wide_coordinator_named, "router/flows/planted.py",
        "from router.core.coordination import Coordinator\nclass F:\n"
        "    def __init__(self, coordinator: Coordinator) -> None:\n        self.coordinator = coordinator\n"),
    "an api module annotated with the whole coordinator through its module": (
        wide_coordinator_named, "router/api/planted.py",
        "from router.core import coordination\ndef f(c: coordination.Coordinator) -> None:\n    pass\n"),
    "a proxy that builds its own live requests": (
        collaborators_built_inside, "router/dataplane/planted.py",
        "class Proxy:\n    def __init__(self, registry):\n        self.live = LiveRequests()\n"),
    "a dispatcher that builds its own abort sender": (
        collaborators_built_inside, "router/dataplane/planted.py",
        "class Dispatcher:\n    def __init__(self, legs, spawn):\n"
        "        self.aborts = leg_aborts.LegAborts(legs, spawn)\n"),
    "a config group that lists its problems by hand": (
        hand_written_validation, "router/core/planted.py",
        "class PlantedConfig:\n    def problems(self):\n        return ['--planted must be positive']\n"),
    "a free port of the simulator's own": (
        free_port_copies, "simulator/planted.py",
        "import socket\ndef free_port():\n    with socket.socket() as sock:\n"
        "        sock.bind(('127.0.0.1', 0))\n        return sock.getsockname()[1]\n"),
    "a new test module importing the fake worker": (
        fake_worker_uses, "tests/test_planted.py", "from .fakes import FakeWorker\n"),
    "a new test module asking for the fake fleet": (
        fake_worker_uses, "tests/test_planted.py", "async def test_x(fake_fleet):\n    await fake_fleet(1, 1)\n"),
    "an allowed module that no longer uses the fake worker": (
        fake_worker_uses, "tests/test_leg_accounting.py", "async def test_x(sim_workers):\n    pass\n"),
}
PLANTED_PARTNERS = {  # the other half of a planted cycle
    "simulator/planted_a.py": ("simulator/worker.py", "from . import planted_a\n"),
    "policies/planted_a.py": ("policies/rebalance.py", "from . import planted_a\n"),
    "router/core/planted_a.py": ("router/core/planted_b.py", "from router.core import planted_a\n"),
}


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    """A copy of the packages the rules read, which the checkout's own tests find clean."""
    copy = tmp_path_factory.mktemp("checkout")
    for package in ("router", "policies", "simulator", "tests"):
        shutil.copytree(ROOT / package, copy / package, ignore=shutil.ignore_patterns("__pycache__", "data"))
    return copy


@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_each_rule_catches_a_planted_violation(checkout, plant):
    rule, where, text = PLANTS[plant]
    partner, line = PLANTED_PARTNERS.get(where, (None, ""))
    before = (checkout / partner).read_text() if partner and (checkout / partner).exists() else None
    replaced = (checkout / where).read_text() if (checkout / where).exists() else None  # a module planted over
    (checkout / where).write_text(text)
    if partner:
        (checkout / partner).write_text((before or "") + line)
    try:
        assert rule(checkout), f"{rule.__name__} did not see: {plant}"
    finally:  # the copy is clean again for the next plant
        if replaced is None:
            (checkout / where).unlink()
        else:
            (checkout / where).write_text(replaced)
        if partner and before is None:
            (checkout / partner).unlink()
        elif partner:
            (checkout / partner).write_text(before)
