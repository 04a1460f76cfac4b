"""pd-router as a real process (`python -m router ...`) on a free port, in its own process group."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from server_patches.pair import kill_when_parent_dies, free_ports, http_status, record_process_group

from .real_client import get_json

CHECKOUT_ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 60.0
STOP_GRACE_S = 15.0


@dataclass
class RouterProcess:
    url: str
    process: subprocess.Popen
    log_path: Path
    args: list[str] = field(default_factory=list)
    expected_workers: int = 0

    @classmethod
    def start(cls, *, prefill: Sequence[tuple[str, Optional[int]]], decode: Sequence[str], log_path: Path,
              extra_args: Sequence[str] = (), python: str = sys.executable) -> "RouterProcess":
        """Start the router and wait until it serves with every worker active (or fail with its log)."""
        port = free_ports(1)[0]
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
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log_file:
            process = subprocess.Popen(
                [python, "-m", "router", *args], cwd=CHECKOUT_ROOT, stdin=subprocess.DEVNULL, stdout=log_file,
                stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=kill_when_parent_dies,
            )
        record_process_group(process.pid)
        router = cls(f"http://127.0.0.1:{port}", process, log_path, args, workers)
        try:
            router._wait_ready(workers)
        except BaseException:
            router.stop()
            raise
        return router

    def _wait_ready(self, workers: int) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"the router exited ({self.process.returncode}); log:\n{self.log_tail()}")
            if http_status(f"{self.url}/health") is not None:
                listed = get_json(f"{self.url}/workers")["workers"]
                if len(listed) == workers and all(w["state"] == "active" for w in listed):
                    return
            if time.monotonic() >= deadline:
                raise RuntimeError(f"the router did not serve within {START_TIMEOUT_S}s; log:\n{self.log_tail()}")
            time.sleep(0.2)

    def restarted(self, log_path: Path) -> "RouterProcess":
        """The same command line (flags and port) started again, as an operator restarts a router that died;
        waits until it serves with every worker active."""
        port = int(self.args[self.args.index("--port") + 1])
        return RouterProcess.launch(self.args, port, log_path, workers=self.expected_workers)

    def kill(self) -> None:
        """SIGKILL, as a crash or an OOM kill: nothing of the router runs its shutdown."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait(timeout=STOP_GRACE_S)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"

    def workers(self) -> list[dict]:
        return get_json(f"{self.url}/workers")["workers"]

    def stop(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            self.process.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait(timeout=STOP_GRACE_S)
