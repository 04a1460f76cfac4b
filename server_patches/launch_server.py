"""Launch a real SGLang server with server_patches active in every one of its processes.

    python -m server_patches.launch_server <sglang launch args>

Runs `python -m sglang.launch_server` with the real-server venv's interpreter (PDR_REAL_VENV, default
.real-sglang/venv of this checkout; install it with `python -m server_patches.install`), the same arguments,
except that `--enable-pd-convert` (the seed design's flag) is accepted as `--enable-pd-role-switch`. The venv's
site hook then activates server_patches.runtime in the launcher's process and in SGLang's spawned scheduler and
detokenizer processes; the CPU patches only with `--device cpu`. PDR_SERVER_PATCHES_DISABLE=name,... leaves
patches out (names in server_patches/runtime/__init__.py). The process is replaced (exec): same pid, signals
go straight to SGLang. Stdlib only, so any Python can run it.
"""

from __future__ import annotations

import os
import sys
from typing import Optional, Sequence

from .stack import (
    CHECKOUT_ROOT,
    ENV_PATCHES_CPU,
    ENV_PATCHES_LIBDIRS,
    ENV_PATCHES_ROOT,
    StackPaths,
    is_installed,
    log,
    read_manifest,
    resolve_paths,
)

CONVERT_FLAG = "--enable-pd-convert"
ROLE_SWITCH_FLAG = "--enable-pd-role-switch"


def rewrite_args(args: Sequence[str]) -> list[str]:
    """--enable-pd-convert -> --enable-pd-role-switch (once); everything else unchanged."""
    out: list[str] = []
    for arg in args:
        if arg == CONVERT_FLAG:
            arg = ROLE_SWITCH_FLAG
        if arg == ROLE_SWITCH_FLAG and ROLE_SWITCH_FLAG in out:
            continue
        out.append(arg)
    return out


def device_of(args: Sequence[str]) -> Optional[str]:
    device = None
    for i, arg in enumerate(args):
        if arg == "--device" and i + 1 < len(args):
            device = args[i + 1]
        elif arg.startswith("--device="):
            device = arg.split("=", 1)[1]
    return device


def server_environment(paths: StackPaths, args: Sequence[str], base: Optional[dict] = None) -> dict:
    env = dict(os.environ if base is None else base)
    env[ENV_PATCHES_ROOT] = str(CHECKOUT_ROOT)
    env.setdefault("PDR_SERVER_PATCHES_VERBOSE", "1")
    if device_of(args) == "cpu":
        env[ENV_PATCHES_CPU] = "1"
        lib_dirs = read_manifest(paths).get("lib_dirs") or [str(d) for d in paths.lib_dirs]
        env[ENV_PATCHES_LIBDIRS] = os.pathsep.join(lib_dirs)
        env.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    else:
        env.pop(ENV_PATCHES_CPU, None)
    return env


def command(paths: StackPaths, args: Sequence[str]) -> list[str]:
    return [str(paths.python), "-m", "sglang.launch_server", *rewrite_args(args)]


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    paths = resolve_paths()
    if not is_installed(paths):
        log(f"no real-server stack at {paths.venv}: run `python -m server_patches.install` first")
        return 2
    cmd = command(paths, args)
    os.execve(cmd[0], cmd, server_environment(paths, args))
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
