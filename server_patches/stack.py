"""Where the real-server stack lives, and the environment contract between launcher and patched processes.

Stdlib only: imported by the installer, the launcher and the pair manager, which may run on any Python.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

CHECKOUT_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_HOME = CHECKOUT_ROOT / ".real-sglang"

# Overrides for the default locations (flags win over these).
ENV_VENV = "PDR_REAL_VENV"
ENV_WORK = "PDR_REAL_WORK"

# Set by the launcher, read in every SGLang process by the site hook and server_patches.runtime.
ENV_PATCHES_ROOT = "PDR_SERVER_PATCHES_ROOT"  # checkout holding server_patches; its presence activates
ENV_PATCHES_CPU = "PDR_SERVER_PATCHES_CPU"  # "1" when launched with --device cpu
ENV_PATCHES_LIBDIRS = "PDR_SERVER_PATCHES_LIBDIRS"  # os.pathsep-joined dirs of the unpacked .deb libraries
ENV_PATCHES_DISABLE = "PDR_SERVER_PATCHES_DISABLE"  # comma-separated patch names to leave out

# Files the installer writes into the venv's site-packages (ours alone; no other package's file is touched).
SITE_HOOK_MODULE = "_pdr_server_patches"
SITE_HOOK_PTH = "pdr_server_patches.pth"
# Written into the venv root: what the installer put where, for the launcher.
STACK_MANIFEST = "pdr-stack.json"


@dataclass(frozen=True)
class StackPaths:
    venv: Path
    work: Path

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def debs(self) -> Path:
        return self.work / "debs"

    @property
    def debs_root(self) -> Path:
        return self.debs / "root"

    @property
    def lib_dirs(self) -> list[Path]:
        return [self.debs_root / "usr/lib/x86_64-linux-gnu", self.debs_root / "lib/x86_64-linux-gnu"]

    @property
    def tiny_model(self) -> Path:
        return self.work / "tinymodel"

    @property
    def manifest(self) -> Path:
        return self.venv / STACK_MANIFEST

    def site_packages(self) -> Path:
        """purelib of the venv, without running its interpreter (layout of a CPython venv on Linux)."""
        libs = sorted((self.venv / "lib").glob("python3.*/site-packages"))
        if not libs:
            raise FileNotFoundError(f"no site-packages under {self.venv}/lib")
        return libs[0]


def resolve_paths(venv: str | os.PathLike | None = None, work: str | os.PathLike | None = None) -> StackPaths:
    """Flag, else environment, else the git-ignored `.real-sglang/` in this checkout."""
    venv_path = Path(venv or os.environ.get(ENV_VENV) or DEFAULT_HOME / "venv")
    work_path = Path(work or os.environ.get(ENV_WORK) or DEFAULT_HOME / "work")
    return StackPaths(venv=venv_path.absolute(), work=work_path.absolute())


def read_manifest(paths: StackPaths) -> dict:
    try:
        return json.loads(paths.manifest.read_text())
    except FileNotFoundError:
        return {}


def is_installed(paths: StackPaths) -> bool:
    """The installer finished (it writes the manifest last) and the site hook is in place."""
    if not paths.manifest.is_file() or not paths.python.exists():
        return False
    try:
        return (paths.site_packages() / SITE_HOOK_PTH).is_file()
    except FileNotFoundError:
        return False


def log(msg: str) -> None:
    print(f"[server_patches] {msg}", file=sys.stderr, flush=True)
