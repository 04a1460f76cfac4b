"""Child processes for the benchmark (harness/processes.py: start with logs, wait until they serve, stop, count their
CPU time) and the machine's own load (busy cores, waiting for a quiet machine)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from harness import processes
from harness.processes import CLOCK_TICKS, Child, free_port, http_status, wait_until  # noqa: F401: bench's API


def start(name: str, argv: list[str], log_dir: Path, *, cwd: str | None = None,
          env: dict[str, str] | None = None) -> Child:
    """Start argv in its own process group (so stop() reaches its children), output to NAME.log in log_dir.
    The environment is this one's unless given: a router of another checkout (a baseline build) is run from
    that checkout (cwd), with nothing of this one put first on its path."""
    return processes.start(name, argv, log_dir / f"{name}.log", cwd=cwd, env=dict(os.environ) if env is None else env)


def stop(child: Child, grace: float = 10.0) -> None:
    """SIGTERM the child's process group, then SIGKILL what is left after `grace` seconds."""
    child.stop(grace)


def cpu_seconds(root: int) -> float:
    """User+system CPU seconds used so far by root and its live descendants."""
    return processes.cpu_seconds(root, tree=True) or 0.0


def machine_cpu() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, from /proc/stat."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    total = sum(values[:8])  # guest time is already counted in user
    return (total - idle) / CLOCK_TICKS, total / CLOCK_TICKS


def load_average() -> tuple[float, float, float]:
    return os.getloadavg()


def busy_cores(sample_s: float = 2.0) -> float:
    """Cores the whole machine kept busy over the next sample_s seconds."""
    busy0, total0 = machine_cpu()
    time.sleep(sample_s)  # a measurement window, not a wait for a condition
    busy1, total1 = machine_cpu()
    cores = os.cpu_count() or 1
    return cores * (busy1 - busy0) / (total1 - total0) if total1 > total0 else 0.0


def wait_for_quiet(below_cores: float, max_wait_s: float, sample_s: float = 2.0) -> tuple[float, float]:
    """Wait until the machine's other users leave less than below_cores busy, for at most max_wait_s.

    Returns (busy cores at the last sample, seconds waited); the caller goes on either way and reports both.
    """
    started = time.monotonic()
    while True:
        busy = busy_cores(sample_s)
        waited = time.monotonic() - started
        if busy < below_cores or waited >= max_wait_s:
            return busy, waited
