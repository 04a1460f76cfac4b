"""Run code right before or after a named module executes, in whatever process imports it.

A meta-path finder that defers to the normal finders and only wraps the loader's exec_module of the
modules it was asked about; nothing on disk is changed.
"""

from __future__ import annotations

import importlib.abc
import sys
from collections import defaultdict
from types import ModuleType
from typing import Callable

ModuleHook = Callable[[ModuleType], None]
# Called instead of the module's own execution; must call run_module(module) itself.
AroundHook = Callable[[Callable[[ModuleType], None], ModuleType], None]


class PostImportHooks(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self._after: dict[str, list[ModuleHook]] = defaultdict(list)
        self._around: dict[str, list[AroundHook]] = defaultdict(list)

    def after(self, module_name: str, hook: ModuleHook) -> None:
        """hook(module) once module_name has executed (now, if it already has)."""
        loaded = sys.modules.get(module_name)
        if loaded is not None and getattr(loaded, "__spec__", None) is not None:
            hook(loaded)
        else:
            self._after[module_name].append(hook)

    def around(self, module_name: str, hook: AroundHook) -> None:
        if module_name in sys.modules:
            raise RuntimeError(f"{module_name} is already imported; too late to wrap its execution")
        self._around[module_name].append(hook)

    def install(self) -> None:
        if self not in sys.meta_path:
            sys.meta_path.insert(0, self)

    def find_spec(self, fullname, path, target=None):
        if fullname not in self._after and fullname not in self._around:
            return None
        spec = None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        after = self._after.pop(fullname, [])
        around = self._around.pop(fullname, [])
        run_module = spec.loader.exec_module
        for wrap in around:
            run_module = (lambda inner, w: (lambda module: w(inner, module)))(run_module, wrap)

        def exec_module(module: ModuleType) -> None:
            run_module(module)
            for hook in after:
                hook(module)

        spec.loader.exec_module = exec_module
        return spec
