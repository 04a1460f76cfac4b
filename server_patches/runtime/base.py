"""What a run-time patch is, and the checks every patch makes before touching SGLang."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable, Iterable


class PatchRefused(RuntimeError):
    """The code a patch would change is not what the patch was written for: refuse rather than guess."""

    def __init__(self, patch: str, reason: str):
        super().__init__(
            f"server_patches: patch {patch!r} refused: {reason}. "
            f"Disable it with PDR_SERVER_PATCHES_DISABLE={patch} only if you know the server does not need it."
        )
        self.patch = patch


@dataclass(frozen=True)
class Settings:
    """Read once per process from the launcher's environment (see server_patches.stack)."""

    cpu: bool
    lib_dirs: tuple[str, ...]
    disabled: frozenset[str]
    sglang_version: str


@dataclass(frozen=True)
class Patch:
    name: str
    summary: str
    sglang_versions: frozenset[str]  # exact releases whose code the patch was checked against
    install: Callable[["Settings", "PostImportHooks"], None]  # noqa: F821 (hooks.PostImportHooks)
    cpu_only: bool = False


def require_attrs(patch: str, owner: object, names: Iterable[str]) -> None:
    owner_name = getattr(owner, "__name__", type(owner).__name__)
    missing = [n for n in names if not hasattr(owner, n)]
    if missing:
        raise PatchRefused(patch, f"{owner_name} has no {', '.join(missing)}")


def require_params(patch: str, func: Callable, expected: Iterable[str]) -> None:
    """The function's leading positional parameters are exactly `expected`, in order."""
    expected = list(expected)
    params = [
        p.name
        for p in inspect.signature(func).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    if params[: len(expected)] != expected:
        name = getattr(func, "__qualname__", repr(func))
        raise PatchRefused(patch, f"{name}{inspect.signature(func)} does not take ({', '.join(expected)}, ...)")


def require_fields(patch: str, struct: type, expected: Iterable[str]) -> None:
    """A msgspec/dataclass-like request type still declares the fields the patch fills in."""
    fields = set(getattr(struct, "__struct_fields__", ()) or getattr(struct, "__dataclass_fields__", {}))
    missing = sorted(set(expected) - fields)
    if missing:
        raise PatchRefused(patch, f"{struct.__name__} lacks field(s) {', '.join(missing)}")
