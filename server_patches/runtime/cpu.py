"""CPU enablement (only with --device cpu): what lets SGLang 0.5.23 run a PD pair on a machine without a GPU.

1. sgl_kernel has no CPU wheel: a stub module whose functions raise if ever called (on this path they are
   imported, never called).
2. Prefill's KV sender would copy page indices through pinned memory and a CUDA event; on CPU they already
   live on the host, so MooncakeKVSender says it does not take host tensor indices.
3. Mooncake's engine links libibverbs/libnl: preload the copies the installer unpacked from Debian packages.
4. torchvision 0.28.0 (the release matching torch 2.13) is a CUDA build whose ops fail to load; SGLang imports
   it anyway, and its meta registrations then fail for the missing torchvision:: ops: skip just those.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import importlib.util
import os
import sys
import types

from .base import Patch, PatchRefused, Settings, require_attrs
from .hooks import PostImportHooks

SGLANG_VERSIONS = frozenset({"0.5.23"})

SGL_KERNEL_STUB = "cpu_sgl_kernel_stub"
MOONCAKE_HOST_INDICES = "cpu_mooncake_host_indices"
PRELOAD_RDMA_LIBS = "cpu_preload_rdma_libs"
TORCHVISION_META = "cpu_torchvision_meta"

# Load order matters: libnl-route needs libnl, libibverbs needs both.
RDMA_LIBS = ("libnl-3.so.200", "libnl-route-3.so.200", "libibverbs.so.1")


def _install_sgl_kernel_stub(settings: Settings, hooks: PostImportHooks) -> None:
    if "sgl_kernel" in sys.modules or importlib.util.find_spec("sgl_kernel") is not None:
        return  # a real sgl_kernel is installed: leave it alone

    stub = types.ModuleType("sgl_kernel", "server_patches CPU stub: no sgl_kernel wheel exists for CPU")
    stub.__spec__ = importlib.machinery.ModuleSpec("sgl_kernel", None)
    stub.__version__ = "0.0.0+cpustub"

    def __getattr__(name: str):
        if name.startswith("__"):
            raise AttributeError(name)

        def missing(*args, **kwargs):
            raise NotImplementedError(f"sgl_kernel.{name} called, but this is server_patches' CPU stub")

        missing.__name__ = name
        return missing

    stub.__getattr__ = __getattr__
    sys.modules["sgl_kernel"] = stub


def _install_mooncake_host_indices(settings: Settings, hooks: PostImportHooks) -> None:
    def patch(conn: types.ModuleType) -> None:
        require_attrs(MOONCAKE_HOST_INDICES, conn, ["MooncakeKVSender"])
        sender = conn.MooncakeKVSender
        if getattr(sender, "supports_host_tensor_indices", None) is not True:
            raise PatchRefused(
                MOONCAKE_HOST_INDICES,
                "MooncakeKVSender.supports_host_tensor_indices is not the class attribute True it was",
            )
        sender.supports_host_tensor_indices = False

    def check_prefill(prefill: types.ModuleType) -> None:
        # The flag only matters because prefill.py branches on it; make sure it still does.
        import inspect

        if "supports_host_tensor_indices" not in inspect.getsource(prefill):
            raise PatchRefused(MOONCAKE_HOST_INDICES, "prefill.py no longer reads supports_host_tensor_indices")

    hooks.after("sglang.srt.disaggregation.mooncake.conn", patch)
    hooks.after("sglang.srt.disaggregation.prefill", check_prefill)


def _install_preload_rdma_libs(settings: Settings, hooks: PostImportHooks) -> None:
    for lib in RDMA_LIBS:
        found = [os.path.join(d, lib) for d in settings.lib_dirs if os.path.exists(os.path.join(d, lib))]
        if not found:
            raise PatchRefused(
                PRELOAD_RDMA_LIBS,
                f"{lib} not found in {list(settings.lib_dirs)}; run `python -m server_patches.install`",
            )
        # RTLD_GLOBAL: mooncake's engine.so resolves its symbols against these without LD_LIBRARY_PATH.
        ctypes.CDLL(found[0], mode=ctypes.RTLD_GLOBAL)


def _torchvision_op_exists(op: str) -> bool:
    import torch

    namespace, _, name = op.partition("::")
    try:
        getattr(getattr(torch.ops, namespace), name.split(".")[0])
        return True
    except (AttributeError, RuntimeError):
        return False


def _install_torchvision_meta(settings: Settings, hooks: PostImportHooks) -> None:
    def around(run_module, module: types.ModuleType) -> None:
        import torch

        require_attrs(TORCHVISION_META, torch.library, ["register_fake"])
        original = torch.library.register_fake

        def tolerant_register_fake(op, *args, **kwargs):
            if isinstance(op, str) and op.startswith("torchvision::") and not _torchvision_op_exists(op):
                func = args[0] if args and callable(args[0]) else None
                return func if func is not None else (lambda fn: fn)
            return original(op, *args, **kwargs)

        torch.library.register_fake = tolerant_register_fake
        try:
            run_module(module)
        finally:
            torch.library.register_fake = original

    hooks.around("torchvision._meta_registrations", around)


PATCHES = (
    Patch(SGL_KERNEL_STUB, "stub module for the CUDA-only sgl_kernel", SGLANG_VERSIONS,
          _install_sgl_kernel_stub, cpu_only=True),
    Patch(MOONCAKE_HOST_INDICES, "prefill sends page indices without pinned memory / CUDA events",
          SGLANG_VERSIONS, _install_mooncake_host_indices, cpu_only=True),
    Patch(PRELOAD_RDMA_LIBS, "preload libibverbs/libnl unpacked from Debian packages", SGLANG_VERSIONS,
          _install_preload_rdma_libs, cpu_only=True),
    Patch(TORCHVISION_META, "skip fake registrations of torchvision ops a CPU torch lacks", SGLANG_VERSIONS,
          _install_torchvision_meta, cpu_only=True),
)
