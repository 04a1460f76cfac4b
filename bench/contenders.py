"""The routers under comparison and how each is launched, all with mini_lb's own flags."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from bench.fleet import Fleet
from bench.procs import free_port

REPO_ROOT = Path(__file__).resolve().parent.parent
PEERS_VENV = REPO_ROOT / ".bench-venv"

ROUTER_NAMES = ("pd-router", "mini_lb", "sgl-router")
# pd-router from another checkout (`--baseline-checkout`): a change's before and after, measured in one run.
PD_ROUTER_BASE = "pd-router-base"


@dataclass(frozen=True)
class Contender:
    name: str
    python: str
    module_args: tuple[str, ...]  # what follows `python`: the module and its fixed flags
    cwd: Path = REPO_ROOT  # `python -m router` runs the code of the checkout it starts in

    def argv(self, fleet: Fleet, port: int, policy: str | None) -> list[str]:
        argv = [self.python, *self.module_args, *fleet.mini_lb_args(), "--host", "127.0.0.1", "--port", str(port)]
        if policy:
            argv += ["--policy", policy]
        if self.name == "sgl-router":
            # Its metrics exporter binds 29000 by default: two sgl-routers on one machine would collide.
            argv += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
        return argv


def peers_python() -> str:
    return str(PEERS_VENV / "bin" / "python")


def contender(name: str, *, pd_router_checkout: Path = REPO_ROOT, pd_router_python: str | None = None,
              baseline_checkout: Path | None = None) -> Contender:
    if name == "pd-router":
        # A checkout's own code, run by the interpreter running the bench (the dev venv).
        return Contender(name, pd_router_python or sys.executable, ("-m", "router"), pd_router_checkout)
    if name == PD_ROUTER_BASE and baseline_checkout is not None:
        return Contender(name, pd_router_python or sys.executable, ("-m", "router"), baseline_checkout)
    if name == "mini_lb":
        return Contender(name, peers_python(),
                         ("-m", "sglang_router.launch_router", "--pd-disaggregation", "--mini-lb"))
    if name == "sgl-router":
        return Contender(name, peers_python(), ("-m", "sglang_router.launch_router", "--pd-disaggregation"))
    raise ValueError(f"unknown router {name!r}; choose from {', '.join(ROUTER_NAMES)}")
