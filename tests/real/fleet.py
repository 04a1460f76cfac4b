"""The real servers of the tier, all started at once: a 1P+1D pair, a spare decode server and a regular
(non-disaggregated) server as the reference answers come from.

- The pair (launched prefill P, launched decode D) is what the server-level tests drive directly.
- The spare decode server (S) is there for the router: converting a worker empties its pool for a moment, and
  the router never converts the last routable worker of a pool (nor could requests be served meanwhile), so a
  P<->D swap through the router under load needs a second worker in the pool being converted from.
- The reference server (R) runs the same tiny model in SGLang's regular mode: what a single server answers.

Starting them takes most of the tier's time (70-130 s here, all in parallel). While developing, start them once
and let the tests attach:

    python -m tests.real.fleet start --run-dir /tmp/fleet      # prints fleet.json; PDR_REAL_VENV etc. apply
    PDR_REAL_FLEET=/tmp/fleet python -m pytest tests/real --real
    python -m tests.real.fleet stop --run-dir /tmp/fleet
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from harness.processes import stop_group
from server_patches.pair import (
    DEFAULT_START_TIMEOUT_S, PairError, RealPair, RealServer, ServerInfo, ensure_tiny_model, wait_healthy,
)
from server_patches.stack import StackPaths, is_installed, resolve_paths

NAMES = ("prefill", "decode", "spare", "reference")
LAUNCH_ROLES = {"prefill": "prefill", "decode": "decode", "spare": "decode", "reference": "regular"}
FLEET_FILE = "fleet.json"


@dataclass
class RealFleet:
    prefill: RealServer
    decode: RealServer
    spare: RealServer
    reference: RealServer
    run_dir: Path
    started_in_s: float = 0.0
    attached: bool = False  # started elsewhere: stop() leaves it running

    @property
    def servers(self) -> dict[str, RealServer]:
        return {name: getattr(self, name) for name in NAMES}

    @property
    def pd_servers(self) -> list[RealServer]:
        return [self.prefill, self.decode, self.spare]

    def pair(self) -> RealPair:
        """The pair as the server-level tests know it (stopped with the fleet, not on its own)."""
        return RealPair(self.prefill, self.decode, self.run_dir, self.started_in_s, attached=True)

    @classmethod
    def launch(cls, *, paths: Optional[StackPaths] = None, run_dir: Path, radix_cache: bool = True,
               timeout: float = DEFAULT_START_TIMEOUT_S, die_with_parent: bool = True) -> "RealFleet":
        paths = paths or resolve_paths()
        if not is_installed(paths):
            raise PairError(f"no real-server stack at {paths.venv}: run `python -m server_patches.install`")
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        model = ensure_tiny_model(paths)
        t0 = time.monotonic()
        started: dict[str, RealServer] = {}
        try:
            for name in NAMES:
                started[name] = RealServer.launch(
                    LAUNCH_ROLES[name], paths=paths, model=model, log_path=run_dir / f"{name}.log",
                    radix_cache=radix_cache, die_with_parent=die_with_parent)
            fleet = cls(**started, run_dir=run_dir)
            fleet._write()
            wait_healthy(list(started.values()), timeout)
        except BaseException:
            _stop_all(started.values())
            raise
        fleet.started_in_s = time.monotonic() - t0
        fleet._write()
        return fleet

    @classmethod
    def attach(cls, run_dir: Path) -> "RealFleet":
        try:
            recorded = json.loads((Path(run_dir) / FLEET_FILE).read_text())
        except FileNotFoundError:
            raise PairError(f"no fleet recorded in {run_dir}") from None
        servers = {name: RealServer(ServerInfo(**recorded[name])) for name in NAMES}
        dead = [s.url for s in servers.values() if not s.alive() or not s.healthy()]
        if dead:
            raise PairError(f"the fleet recorded in {run_dir} is not healthy: {dead}")
        return cls(**servers, run_dir=Path(run_dir), started_in_s=recorded.get("started_in_s", 0.0), attached=True)

    def describe(self) -> dict:
        return {**{name: asdict(s.info) for name, s in self.servers.items()},
                "run_dir": str(self.run_dir), "started_in_s": round(self.started_in_s, 1)}

    def _write(self) -> None:
        (self.run_dir / FLEET_FILE).write_text(json.dumps(self.describe(), indent=2) + "\n")

    def stop(self) -> None:
        if not self.attached:
            _stop_all(self.servers.values())


def _stop_all(servers) -> None:
    servers = list(servers)
    for server in servers:  # all at once: each may take its grace period
        try:
            os.killpg(server.info.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    for server in servers:
        server.stop()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.real.fleet", description=__doc__.split("\n")[0])
    parser.add_argument("action", choices=("start", "stop"))
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--timeout", type=float, default=DEFAULT_START_TIMEOUT_S)
    args = parser.parse_args(argv)
    run_dir = Path(args.run_dir)
    if args.action == "start":
        fleet = RealFleet.launch(run_dir=run_dir, timeout=args.timeout, die_with_parent=False)
        print(json.dumps(fleet.describe(), indent=2))
        return 0
    recorded = json.loads((run_dir / FLEET_FILE).read_text())
    for name in NAMES:
        stop_group(recorded[name]["pid"], 30.0)
    print(f"stopped the fleet of {run_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
