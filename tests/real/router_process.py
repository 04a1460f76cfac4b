"""pd-router as a real process (`python -m router ...`) on a free port, in its own process group."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from harness import processes
from harness.processes import REPO as CHECKOUT_ROOT, ChildExited, free_ports, http_status

from .real_client import get_json

START_TIMEOUT_S = 60.0
STOP_GRACE_S = 15.0


@dataclass
class RouterProcess:
    url: str
    process: subprocess.Popen
    log_path: Path
    args: list[str] = field(default_factory=list)
    expected_workers: int = 0
    child: Optional[processes.Child] = field(default=None, repr=False)

    @classmethod
    def start(cls, *, prefill: Sequence[tuple[str, Optional[int]]], decode: Sequence[str], log_path: Path,
              extra_args: Sequence[str] = (), python: str = sys.executable) -> "RouterProcess":
        """Start the router and wait until it serves with every worker active (or fail with its log). Its port is
        below the kernel's ephemeral range where it can be: `restarted` binds it again after a kill, and there no
        client connection can have taken it meanwhile."""
        port = (processes.ports_below_ephemeral(1) or free_ports(1))[0]
        args = ["--host", "127.0.0.1", "--port", str(port), "--log-level", "info"]
        for url, bootstrap_port in prefill:
            args += ["--prefill", url, "none" if bootstrap_port is None else str(bootstrap_port)]
        if decode:
            args += ["--decode", *decode]
        args += list(extra_args)
        return cls.launch(args, port, log_path, workers=len(prefill) + len(decode), python=python)

    @classmethod
    def launch(cls, args: Sequence[str], port: int, log_path: Path, *, workers: int,
               python: str = sys.executable) -> "RouterProcess":
        args = list(args)
        child = processes.start("the router", [python, "-m", "router", *args], log_path, cwd=CHECKOUT_ROOT,
                                env=processes.child_env(repo_on_path=False), append=True, die_with_parent=True,
                                record_group=True)
        router = cls(f"http://127.0.0.1:{port}", child.popen, log_path, args, workers, child)
        try:
            router._wait_ready(workers)
        except BaseException:
            router.stop()
            raise
        return router

    def _wait_ready(self, workers: int) -> None:
        def serving() -> bool:
            if http_status(f"{self.url}/health") is None:
                return False
            listed = get_json(f"{self.url}/workers")["workers"]
            return len(listed) == workers and all(w["state"] == "active" for w in listed)

        try:
            self.child.wait_until(serving, timeout=START_TIMEOUT_S, what="the router serving with every worker "
                                                                         "active", interval=0.2)
        except (ChildExited, TimeoutError) as exc:
            raise RuntimeError(str(exc)) from None  # with the log's tail

    def restarted(self, log_path: Path) -> "RouterProcess":
        """The same command line (flags and port) started again, as an operator restarts a router that died;
        waits until it serves with every worker active."""
        port = int(self.args[self.args.index("--port") + 1])
        return RouterProcess.launch(self.args, port, log_path, workers=self.expected_workers)

    def kill(self) -> None:
        """SIGKILL, as a crash or an OOM kill: nothing of the router runs its shutdown."""
        self.child.kill(STOP_GRACE_S)

    def log(self) -> str:
        return self.child.log()

    def alive(self) -> bool:
        return self.child.alive()

    def log_tail(self, lines: int = 30) -> str:
        return self.child.log_lines(lines)

    def workers(self) -> list[dict]:
        return get_json(f"{self.url}/workers")["workers"]

    def stop(self) -> None:
        self.child.stop(STOP_GRACE_S)
