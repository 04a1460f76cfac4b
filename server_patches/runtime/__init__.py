"""Run-time patches for real SGLang servers, activated in every process of a server started by
`python -m server_patches.launch_server` (the venv's site hook imports this package when the launcher's
environment asks for it). Nothing installed is edited: patches wrap module execution or replace attributes.

Patches (names usable in PDR_SERVER_PATCHES_DISABLE):
    cpu_sgl_kernel_stub, cpu_mooncake_host_indices, cpu_preload_rdma_libs, cpu_torchvision_meta  (--device cpu)
    convert_pd_role               POST /convert_pd_role, the seed design's endpoint, over the in-place switch
    prefix_cache_on_role_switch   fix for the prefix-cache leak on a prefill->decode switch
    prefill_endpoint_on_role_switch  fix for decode servers hanging on a server back in prefill after a switch
"""

from __future__ import annotations

import os
from importlib import metadata

from ..stack import ENV_PATCHES_CPU, ENV_PATCHES_DISABLE, ENV_PATCHES_LIBDIRS
from . import convert_endpoint, cpu, prefill_endpoint, prefix_cache
from .base import Patch, PatchRefused, Settings
from .hooks import PostImportHooks

ALL_PATCHES: tuple[Patch, ...] = (*cpu.PATCHES, convert_endpoint.PATCH, prefix_cache.PATCH,
                                  prefill_endpoint.PATCH)
PATCH_NAMES = frozenset(p.name for p in ALL_PATCHES)

_active: list[str] | None = None


def settings_from_env(environ=os.environ) -> Settings:
    disabled = frozenset(n.strip() for n in environ.get(ENV_PATCHES_DISABLE, "").split(",") if n.strip())
    unknown = sorted(disabled - PATCH_NAMES)
    if unknown:
        raise PatchRefused(",".join(unknown), f"unknown patch name(s) in {ENV_PATCHES_DISABLE}; known: "
                           f"{', '.join(sorted(PATCH_NAMES))}")
    try:
        version = metadata.version("sglang")
    except metadata.PackageNotFoundError:
        version = ""
    return Settings(
        cpu=environ.get(ENV_PATCHES_CPU) == "1",
        lib_dirs=tuple(d for d in environ.get(ENV_PATCHES_LIBDIRS, "").split(os.pathsep) if d),
        disabled=disabled,
        sglang_version=version,
    )


def selected(settings: Settings) -> list[Patch]:
    return [p for p in ALL_PATCHES if p.name not in settings.disabled and (settings.cpu or not p.cpu_only)]


def activate(environ=os.environ) -> list[str]:
    """Install every selected patch in this process (idempotent); returns their names."""
    global _active
    if _active is not None:
        return _active
    settings = settings_from_env(environ)
    patches = selected(settings)
    for patch in patches:
        if settings.sglang_version not in patch.sglang_versions:
            raise PatchRefused(
                patch.name,
                f"written for SGLang {', '.join(sorted(patch.sglang_versions))}, found "
                f"{settings.sglang_version or 'no sglang'}",
            )
    hooks = PostImportHooks()
    for patch in patches:
        patch.install(settings, hooks)
    hooks.install()
    _active = [p.name for p in patches]
    return _active
