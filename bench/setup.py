"""Install what the router benchmark needs: `python -m bench.setup`.

- `.bench-venv/`: a venv of its own with the peers (the `bench` extra of pyproject.toml: sglang-router 0.3.2,
  whose mini_lb and Rust router we compare against, and SMG 1.13), so the project's own venv stays small;
- Debian's nginx (the ceiling setup's instant backends) and wrk (its load), with apt-get, if missing.
Safe to run again: it only adds what is missing.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tomllib

from bench.contenders import PEERS_VENV, REPO_ROOT

APT_PACKAGES = {"nginx": "nginx", "wrk": "wrk"}  # command -> Debian package


def bench_requirements() -> list[str]:
    with open(REPO_ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["optional-dependencies"]["bench"]


def _run(argv: list[str], **kwargs) -> None:
    print("+", " ".join(argv), flush=True)
    subprocess.run(argv, check=True, **kwargs)


def ensure_venv(python: str) -> None:
    venv_python = PEERS_VENV / "bin" / "python"
    if not venv_python.exists():
        _run([python, "-m", "venv", str(PEERS_VENV)])
    _run([str(venv_python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
          *bench_requirements()])
    # The peers must start: import both entry points the benchmark uses.
    _run([str(venv_python), "-c", "import sglang_router.launch_router, sglang_router.mini_lb, "
                                  "sglang_router.router, smg.launch_router; print('sglang-router and smg ok')"])


def ensure_apt_packages() -> None:
    missing = [pkg for cmd, pkg in APT_PACKAGES.items()
               if shutil.which(cmd) is None and not os.path.exists(f"/usr/sbin/{cmd}")]
    if not missing:
        return
    if os.geteuid() != 0:
        raise SystemExit(f"missing {' '.join(missing)}: install them with apt-get (needs root)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    _run(["apt-get", "update", "-qq"], env=env)
    _run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing], env=env)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--python", default=sys.executable, help="interpreter for the venv (Python 3.11)")
    parser.add_argument("--skip-apt", action="store_true", help="do not install nginx and wrk")
    args = parser.parse_args(argv)
    ensure_venv(args.python)
    if not args.skip_apt:
        ensure_apt_packages()
    print(f"benchmark ready: {PEERS_VENV}, nginx {shutil.which('nginx') or '/usr/sbin/nginx'}, "
          f"wrk {shutil.which('wrk')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
