"""The routers under comparison and how each is launched, all with mini_lb's own flags."""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from bench.fleet import Fleet
from bench.procs import free_port

REPO_ROOT = Path(__file__).resolve().parent.parent
PEERS_VENV = REPO_ROOT / ".bench-venv"

ROUTER_NAMES = ("pd-router", "mini_lb", "sgl-router", "smg")
# pd-router from another checkout (`--baseline-checkout`): a change's before and after, measured in one run.
PD_ROUTER_BASE = "pd-router-base"
# In a variant's arguments: the client URL of the etcd the benchmark starts for the run.
ETCD_PLACEHOLDER = "{etcd}"


@dataclass(frozen=True)
class Contender:
    name: str
    python: str
    module_args: tuple[str, ...]  # what follows `python`: the module and its fixed flags
    cwd: Path = REPO_ROOT  # `python -m router` runs the code of the checkout it starts in
    extra_args: tuple[str, ...] = ()  # a variant's own flags (`--variant NAME=ARGS`), after the common ones

    def argv(self, fleet: Fleet, port: int, policy: str | None) -> list[str]:
        argv = [self.python, *self.module_args, *fleet.mini_lb_args(), "--host", "127.0.0.1", "--port", str(port)]
        if policy:
            argv += ["--policy", policy]
        if self.name in ("sgl-router", "smg"):
            # Its metrics exporter binds 29000 by default: two sgl-routers on one machine would collide.
            argv += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
        return argv + list(self.extra_args)

    @property
    def replicas(self) -> int:
        """How many processes serve its port (`--replicas N` among its flags): all must serve before a load."""
        args = list(self.extra_args)
        for i, arg in enumerate(args):
            if arg == "--replicas" and i + 1 < len(args):
                return int(args[i + 1])
            if arg.startswith("--replicas="):
                return int(arg.split("=", 1)[1])
        return 1


def parse_variant(text: str) -> tuple[str, tuple[str, ...]]:
    """`NAME=ARGS` (`--variant 'x2=--replicas 2'`): pd-router from the same checkout with ARGS added, measured
    as its own router (ratios against plain pd-router in the same run)."""
    name, sep, args = text.partition("=")
    name = name.strip()
    if not sep or not name or name in ROUTER_NAMES or name in (PD_ROUTER_BASE, "direct"):
        raise ValueError(f"--variant {text!r}: expected NAME=ARGS with a NAME of its own")
    return name, tuple(shlex.split(args))


def with_etcd(args: tuple[str, ...], endpoints: str) -> tuple[str, ...]:
    return tuple(arg.replace(ETCD_PLACEHOLDER, endpoints) for arg in args)


def peers_python() -> str:
    return str(PEERS_VENV / "bin" / "python")


def contender(name: str, *, pd_router_checkout: Path = REPO_ROOT, pd_router_python: str | None = None,
              baseline_checkout: Path | None = None, variants: dict[str, tuple[str, ...]] | None = None) -> Contender:
    if variants and name in variants:
        return Contender(name, pd_router_python or sys.executable, ("-m", "router"), pd_router_checkout,
                         variants[name])
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
    if name == "smg":  # SMG 1.13 (lightseekorg/smg), sgl-router's successor, from the same venv
        return Contender(name, peers_python(), ("-m", "smg.launch_router", "--pd-disaggregation"))
    raise ValueError(f"unknown router {name!r}; choose from {', '.join(ROUTER_NAMES)}")
