"""Child processes for the benchmark: start with logs, wait until they serve, stop, count their CPU time."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    """A port the OS reports free on loopback (the child binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Child:
    """A started process, its log file and the command that made it."""

    name: str
    popen: subprocess.Popen
    log_path: Path
    argv: list[str] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, chars: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


def start(name: str, argv: list[str], log_dir: Path, *, cwd: str | None = None,
          env: dict[str, str] | None = None) -> Child:
    """Start argv in its own process group (so stop() reaches its children), output to a log file."""
    log_path = log_dir / f"{name}.log"
    log_file = open(log_path, "wb")
    try:
        popen = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 cwd=cwd, env=env, start_new_session=True)
    finally:
        log_file.close()
    return Child(name, popen, log_path, argv)


def stop(child: Child, grace: float = 10.0) -> None:
    """SIGTERM the child's process group, then SIGKILL what is left after `grace` seconds."""
    if child.popen.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGTERM)
        try:
            child.popen.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    # The leader may be gone while children of its group live on (uvicorn, nginx workers).
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        child.popen.wait(timeout=grace)


def http_status(url: str, timeout: float = 5.0) -> int | None:
    """Status of a GET, or None if nothing answered (SGLang 0.5.23's /health itself takes ~1 s)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code
    except (OSError, ValueError):
        return None


def wait_until(predicate, *, timeout: float, what: str, child: Child | None = None,
               interval: float = 0.1) -> None:
    """Poll predicate until true; fail with the child's log if it dies or the deadline passes."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return
        if child is not None and not child.alive():
            raise RuntimeError(f"{child.name} exited with {child.popen.returncode} while waiting for "
                               f"{what}; log tail:\n{child.log_tail()}")
        if time.monotonic() > deadline:
            tail = f"; log tail:\n{child.log_tail()}" if child is not None else ""
            raise TimeoutError(f"{what} not reached within {timeout:.0f} s{tail}")
        time.sleep(interval)


def _stat_fields(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Field 2 (comm) may hold spaces: split after its closing parenthesis.
    return raw[raw.rindex(")") + 2:].split()


def process_tree(root: int) -> list[int]:
    """root and all its descendants, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fields = _stat_fields(int(entry))
        if fields is not None:
            children.setdefault(int(fields[1]), []).append(int(entry))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def cpu_seconds(root: int) -> float:
    """User+system CPU seconds used so far by root and its live descendants."""
    ticks = 0
    for pid in process_tree(root):
        fields = _stat_fields(pid)
        if fields is not None:
            ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / CLOCK_TICKS


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
