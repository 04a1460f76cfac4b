"""Install the real-server stack (SGLang 0.5.23 on CPU torch) into its own virtual environment.

    python -m server_patches.install [--venv DIR] [--work DIR] [--python PY] [--check | --no-check]

Defaults: the git-ignored `.real-sglang/{venv,work}` of this checkout (env PDR_REAL_VENV / PDR_REAL_WORK).
Idempotent: every step looks first and skips what is already there; each prints its time. Steps:
  venv        python -m venv
  torch       torch 2.13.0 CPU build, no deps (the closure pins them): pip finds the local wheel
  closure     requirements-real.txt: the exact pins of every other package
  sglang      sglang==0.5.23 --no-deps (its metadata asks for torch 2.14.1 and CUDA-only packages)
  torchvision torchvision==0.28.0 --no-deps (the release matching torch 2.13; a CUDA build, see runtime/cpu.py)
  debs        libibverbs1, libnl-3-200, libnl-route-3-200: `apt-get download` + `dpkg -x` into WORK/debs/root
              (unpacked, never installed; preloaded at run time by the cpu_preload_rdma_libs patch)
  site-hook   our own `.pth` + module in the venv's site-packages that activate server_patches.runtime in
              every process of a server started by server_patches.launch_server (no other package's file edited)
  check       import SGLang's HTTP server with every patch active, in a fresh process of the venv
sglang and torch never enter pd-router's own install: this venv is separate.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

from .stack import (
    CHECKOUT_ROOT,
    ENV_PATCHES_CPU,
    ENV_PATCHES_LIBDIRS,
    ENV_PATCHES_ROOT,
    SITE_HOOK_MODULE,
    SITE_HOOK_PTH,
    StackPaths,
    log,
    resolve_paths,
)

HERE = Path(__file__).resolve().parent
REQUIREMENTS = HERE / "requirements-real.txt"
SITE_HOOK_SOURCE = HERE / "site_hook.py"

ENV_TORCH_SPEC = "PDR_REAL_TORCH_SPEC"
# The CPU build by its local version: with no such wheel at hand pip fails here instead of fetching a CUDA build.
DEFAULT_TORCH_SPEC = "torch==2.13.0+cpu"
SGLANG_SPEC = "sglang==0.5.23"
TORCHVISION_SPEC = "torchvision==0.28.0"
# Debian bookworm versions verified with the stack; unpinned names are the fallback on another release.
DEBS = (("libibverbs1", "44.0-2"), ("libnl-3-200", "3.7.0-0.2+b1"), ("libnl-route-3-200", "3.7.0-0.2+b1"))
RDMA_LIBS = ("libnl-3.so.200", "libnl-route-3.so.200", "libibverbs.so.1")
PYTHON_VERSION = (3, 11)

CHECK_SCRIPT = """
import sglang.srt.entrypoints.http_server as http_server
import sglang.srt.disaggregation.mooncake.conn as conn
import sglang.srt.disaggregation.role_switch as role_switch
routes = {getattr(r, "path", None) for r in http_server.app.router.routes}
assert "/convert_pd_role" in routes, "convert_pd_role route missing"
assert conn.MooncakeKVSender.supports_host_tensor_indices is False, "mooncake patch missing"
assert role_switch.handle_pd_role_switch.__module__.startswith("server_patches"), "prefix-cache patch missing"
assert conn.MooncakeKVManager.teardown.__module__.startswith("server_patches"), "prefill-endpoint patch missing"
import sglang, torch
print(f"sglang {sglang.__version__}, torch {torch.__version__}: patches active")
"""


class InstallError(RuntimeError):
    pass


def _run(cmd: list[str], *, cwd: Optional[Path] = None, env: Optional[dict] = None) -> None:
    proc = subprocess.run(cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise InstallError(f"command failed ({proc.returncode}): {' '.join(map(str, cmd))}")


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_pins(lines: list[str]) -> dict[str, str]:
    """`name==version` lines (comments and blanks ignored) -> {canonical name: version}."""
    pins = {}
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        if not sep:
            raise InstallError(f"not an exact pin: {line!r}")
        pins[_canonical(name)] = version.strip()
    return pins


def unmet_pins(pins: dict[str, str], installed: dict[str, str]) -> list[str]:
    """Pins whose installed version differs; a pin without a local label accepts any local build of it."""
    unmet = []
    for name, want in pins.items():
        have = installed.get(name)
        if have is None or (have != want and ("+" in want or have.split("+", 1)[0] != want)):
            unmet.append(f"{name}=={want} (have {have or 'nothing'})")
    return unmet


class Installer:
    def __init__(self, paths: StackPaths, python: str, torch_spec: str, check: Optional[bool]):
        self.paths = paths
        self.python = python
        self.torch_spec = torch_spec
        self.check = check
        self.changed: list[str] = []
        self.timings: list[tuple[str, float, str]] = []

    # -- helpers -----------------------------------------------------------------------------------------------
    def _installed(self) -> dict[str, str]:
        out = subprocess.run(
            [str(self.paths.python), "-c",
             "import json, importlib.metadata as m; "
             "print(json.dumps({d.metadata['Name']: d.version for d in m.distributions()}))"],
            capture_output=True, text=True, check=True,
        ).stdout
        return {_canonical(k): v for k, v in json.loads(out).items() if k}

    def _pip(self, *args: str) -> None:
        _run([str(self.paths.python), "-m", "pip", "install", "--disable-pip-version-check", "-q", *args])

    def _step(self, name: str, action: Callable[[], Optional[str]]) -> None:
        t0 = time.monotonic()
        skipped = action()
        took = time.monotonic() - t0
        outcome = f"skipped ({skipped})" if skipped else "done"
        if not skipped:
            self.changed.append(name)
        self.timings.append((name, took, outcome))
        log(f"install {name:<11} {outcome:<40} {took:6.1f}s")

    def _pinned_step(self, spec: str, *pip_args: str) -> Callable[[], Optional[str]]:
        def action() -> Optional[str]:
            pins = parse_pins([spec])
            if not unmet_pins(pins, self._installed()):
                return f"{spec} present"
            self._pip(*pip_args, spec)
            missing = unmet_pins(pins, self._installed())
            if missing:
                raise InstallError(f"after installing {spec}: {missing}")
            return None
        return action

    # -- steps -------------------------------------------------------------------------------------------------
    def venv(self) -> Optional[str]:
        if self.paths.python.exists():
            return "exists"
        probe = subprocess.run([self.python, "-c", "import sys; print(sys.version_info[:2] == (3, 11))"],
                               capture_output=True, text=True)
        if probe.stdout.strip() != "True":
            raise InstallError(f"{self.python} is not Python {PYTHON_VERSION[0]}.{PYTHON_VERSION[1]}")
        self.paths.venv.parent.mkdir(parents=True, exist_ok=True)
        _run([self.python, "-m", "venv", str(self.paths.venv)])
        return None

    def closure(self) -> Optional[str]:
        pins = parse_pins(REQUIREMENTS.read_text().splitlines())
        if not unmet_pins(pins, self._installed()):
            return f"{len(pins)} pins present"
        self._pip("-r", str(REQUIREMENTS))
        missing = unmet_pins(pins, self._installed())
        if missing:
            raise InstallError(f"after installing the closure: {missing}")
        return None

    def debs(self) -> Optional[str]:
        if all(any((d / lib).exists() for d in self.paths.lib_dirs) for lib in RDMA_LIBS):
            return "libraries unpacked"
        if not shutil.which("apt-get") or not shutil.which("dpkg"):
            raise InstallError("apt-get and dpkg are needed to fetch libibverbs/libnl (Debian-based machine)")
        download_dir = self.paths.debs
        download_dir.mkdir(parents=True, exist_ok=True)
        for old in download_dir.glob("*.deb"):
            old.unlink()
        attempts = (
            ("pinned", [f"{n}={v}" for n, v in DEBS], False),
            ("unpinned", [n for n, _ in DEBS], False),
            ("unpinned after apt-get update", [n for n, _ in DEBS], True),
        )
        for label, names, update_first in attempts:
            if update_first:
                subprocess.run(["apt-get", "update", "-qq"], stdin=subprocess.DEVNULL)
            got = subprocess.run(["apt-get", "download", "-qq", *names], cwd=download_dir,
                                 stdin=subprocess.DEVNULL, capture_output=True, text=True)
            if got.returncode == 0:
                break
            log(f"apt-get download ({label}) failed: {got.stderr.strip().splitlines()[-1:]}")
        else:
            raise InstallError("could not download libibverbs1/libnl-3-200/libnl-route-3-200 with apt-get")
        root = self.paths.debs_root
        if root.exists():
            shutil.rmtree(root)
        root.mkdir(parents=True)
        for deb in sorted(download_dir.glob("*.deb")):
            _run(["dpkg", "-x", str(deb), str(root)])
        missing = [lib for lib in RDMA_LIBS if not any((d / lib).exists() for d in self.paths.lib_dirs)]
        if missing:
            raise InstallError(f"unpacked packages lack {missing}")
        return None

    def site_hook(self) -> Optional[str]:
        site = self.paths.site_packages()
        module = site / f"{SITE_HOOK_MODULE}.py"
        pth = site / SITE_HOOK_PTH
        source = SITE_HOOK_SOURCE.read_text()
        pth_line = f"import {SITE_HOOK_MODULE}\n"
        if module.exists() and module.read_text() == source and pth.exists() and pth.read_text() == pth_line:
            return "up to date"
        module.write_text(source)
        pth.write_text(pth_line)
        return None

    def run_check(self) -> Optional[str]:
        if self.check is False or (self.check is None and not self.changed):
            return "nothing changed" if self.check is None else "--no-check"
        env = dict(os.environ)
        env.update({
            ENV_PATCHES_ROOT: str(CHECKOUT_ROOT),
            ENV_PATCHES_CPU: "1",
            ENV_PATCHES_LIBDIRS: os.pathsep.join(map(str, self.paths.lib_dirs)),
            "SGLANG_USE_CPU_ENGINE": "1",
        })
        _run([str(self.paths.python), "-W", "ignore", "-c", CHECK_SCRIPT], env=env, cwd=self.paths.venv)
        return None

    def write_manifest(self) -> None:
        installed = self._installed()
        self.paths.manifest.write_text(json.dumps({
            "work": str(self.paths.work),
            "lib_dirs": [str(d) for d in self.paths.lib_dirs],
            "versions": {k: installed.get(k) for k in ("sglang", "torch", "torchvision")},
            "installed_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }, indent=2) + "\n")

    def run(self) -> None:
        t0 = time.monotonic()
        log(f"real-server stack: venv {self.paths.venv}, work {self.paths.work}")
        self.paths.work.mkdir(parents=True, exist_ok=True)
        if self.paths.manifest.exists():
            self.paths.manifest.unlink()  # "installed" again only once this run completes
        self._step("venv", self.venv)
        self._step("torch", self._pinned_step(self.torch_spec, "--no-deps"))
        # The closure before sglang: pip would otherwise list every CUDA-only requirement of sglang as "not
        # installed" (harmless, but it reads like a failure).
        self._step("closure", self.closure)
        self._step("sglang", self._pinned_step(SGLANG_SPEC, "--no-deps"))
        self._step("torchvision", self._pinned_step(TORCHVISION_SPEC, "--no-deps"))
        self._step("debs", self.debs)
        self._step("site-hook", self.site_hook)
        self._step("check", self.run_check)
        self.write_manifest()
        log(f"install finished in {time.monotonic() - t0:.1f}s "
            f"({', '.join(self.changed) or 'nothing to do'}); python: {self.paths.python}")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m server_patches.install", description=__doc__.split("\n")[0])
    parser.add_argument("--venv", help="virtual environment to create/complete (default .real-sglang/venv)")
    parser.add_argument("--work", help="work dir: unpacked .debs, tiny model, run files (default .real-sglang/work)")
    parser.add_argument("--python", default=sys.executable, help="Python 3.11 interpreter for the venv")
    parser.add_argument("--torch-spec", default=os.environ.get(ENV_TORCH_SPEC, DEFAULT_TORCH_SPEC),
                        help=f"pip spec of the CPU torch (default {DEFAULT_TORCH_SPEC}; env {ENV_TORCH_SPEC})")
    check = parser.add_mutually_exclusive_group()
    check.add_argument("--check", dest="check", action="store_true", default=None,
                       help="always import the patched HTTP server at the end (default: only after changes)")
    check.add_argument("--no-check", dest="check", action="store_false")
    args = parser.parse_args(argv)
    installer = Installer(resolve_paths(args.venv, args.work), args.python, args.torch_spec, args.check)
    try:
        installer.run()
    except InstallError as e:
        log(f"install failed: {e}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
