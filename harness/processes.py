"""Child processes of every harness (the tests, the benchmarks, the load tests, the real-server pair): a router,
a simulated fleet or a SGLang server started in its own process group with its output in a log file, waited for
until it serves (failing with its log's tail the moment it exits, or at the deadline), stopped group-wide
(SIGTERM, then SIGKILL after a grace period: the leader may be gone while its children live on), its memory and
CPU time read from /proc.

Stdlib only, and nothing of the router: server_patches imports it on a machine that runs real SGLang servers.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import inspect
import os
import random
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

REPO = Path(__file__).resolve().parents[1]  # the checkout: children run from it with it first on sys.path
HOST = "127.0.0.1"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
# When set, every child started with `record_group` appends its process group id to this file, so that CI can
# kill whatever a killed test run left behind (.ci/real does).
ENV_PGID_FILE = "PDR_REAL_PGID_FILE"
PR_SET_PDEATHSIG = 1
try:
    _PRCTL = ctypes.CDLL(None, use_errno=True).prctl  # Linux; elsewhere children simply do not get the signal
except (OSError, AttributeError):
    _PRCTL = None


class ChildExited(RuntimeError):
    """The child ended while it was waited for."""


# ---- ports and HTTP ---------------------------------------------------------------------------------------
def free_ports(count: int, host: str = HOST) -> list[int]:
    """Distinct ports the OS says are free now (all sockets held until every port is picked; the child binds
    them a moment later)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((host, 0))
            sockets.append(sock)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for sock in sockets:
            sock.close()


def free_port(host: str = HOST) -> int:
    return free_ports(1, host)[0]


def below_ephemeral() -> range | None:
    """Ports under the kernel's ephemeral range (up to 12,000 of them), where no client connection takes its own
    end: a server restarted on its port after a kill finds it free there. None where the range is unknown."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return range(max(1024, ephemeral_low - 12000), ephemeral_low)


def ports_below_ephemeral(count: int, host: str = HOST) -> list[int]:
    """`count` distinct ports free now, `below_ephemeral` (a child binds them a moment later); [] where none
    can be had (the caller then lets the OS choose)."""
    ports = below_ephemeral()
    if ports is None or len(ports) < 4 * count:
        return []
    rng = random.Random()
    found: list[int] = []
    for _ in range(100 * count):  # a bound: most probes of this range find a port free
        port = rng.choice(ports)
        if port in found:
            continue
        with socket.socket() as probe:
            try:
                probe.bind((host, port))
            except OSError:
                continue
        found.append(port)
        if len(found) == count:
            return found
    return []


def port_open(port: int, host: str = HOST) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


def http_status(url: str, timeout: float = 5.0) -> int | None:
    """Status of a GET, or None if nothing answered (SGLang 0.5.23's /health itself takes ~1 s)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            resp.read()
            return resp.status
    except urllib.error.HTTPError as err:
        err.close()
        return err.code
    except (OSError, ValueError):
        return None


# ---- starting -----------------------------------------------------------------------------------------------
def child_env(base: dict[str, str] | None = None, *, repo_on_path: bool = True) -> dict[str, str]:
    """The environment of a child of the checkout: the checkout first on PYTHONPATH, output unbuffered, and
    faulthandler on (a child that does not serve in time dumps its threads' stacks into its log on SIGABRT)."""
    env = dict(os.environ if base is None else base)
    if repo_on_path:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("PYTHONFAULTHANDLER", "1")
    return env


def kill_when_parent_dies() -> None:
    """preexec_fn: SIGKILL this child when its parent ends (kept across exec). Nothing is loaded after the fork
    (libc's prctl was looked up at import): a forked child of a threaded parent must not take locks."""
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, signal.SIGKILL)


def record_process_group(pgid: int) -> None:
    """Append pgid to $PDR_REAL_PGID_FILE, if set (one line each)."""
    path = os.environ.get(ENV_PGID_FILE)
    if path:
        with open(path, "a") as f:
            f.write(f"{pgid}\n")


def spawn_options(log_file: Any, *, cwd: Path | str | None, env: dict[str, str] | None, die_with_parent: bool,
                  stdout: Any = None) -> dict[str, Any]:
    """How every child is started, for `subprocess.Popen` and `asyncio.create_subprocess_exec` alike: in a
    session (process group) of its own, no stdin, stderr (and stdout unless given) into its log."""
    return {"cwd": cwd, "env": env, "stdin": subprocess.DEVNULL, "stdout": log_file if stdout is None else stdout,
            "stderr": subprocess.STDOUT if stdout is None else log_file, "start_new_session": True,
            "preexec_fn": kill_when_parent_dies if die_with_parent else None}


@dataclass
class Child:
    """A started process (the leader of its own process group), its log file and the command that made it."""

    name: str
    popen: subprocess.Popen
    log_path: Path
    argv: list[str] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, chars: int = 3000) -> str:
        return self.log()[-chars:]

    def log_lines(self, lines: int = 30) -> str:
        return "\n".join(self.log().splitlines()[-lines:]) if self.log_path.exists() else "(no log)"

    def cpu_seconds(self, tree: bool = False) -> float | None:
        return cpu_seconds(self.pid, tree=tree)

    def stop(self, grace: float = 10.0) -> None:
        stop_all([self], grace)

    def kill(self, timeout: float = 15.0) -> None:
        """SIGKILL the whole group, as a crash or an OOM kill: nothing of it runs its shutdown."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=timeout)

    def wait_until(self, predicate: Callable[[], Any], *, timeout: float, what: str, interval: float = 0.1) -> Any:
        return wait_until(predicate, timeout=timeout, what=what, child=self, interval=interval)

    async def await_until(self, condition: Callable[[], Any], *, timeout: float, what: str,
                          interval: float = 0.1) -> Any:
        return await await_until(condition, timeout=timeout, what=what, child=self, interval=interval)


def start(name: str, argv: Sequence[str], log_path: Path, *, cwd: Path | str | None = REPO,
          env: dict[str, str] | None = None, append: bool = False, stdout_path: Path | None = None,
          die_with_parent: bool = False, record_group: bool = False) -> Child:
    """Start argv in its own process group (so stopping it reaches its children), output to log_path (stdout to
    stdout_path when given: a child that announces itself there). `env` None: `child_env()`.
    die_with_parent: the kernel kills it when the calling thread's process ends, even by SIGKILL (call it from
    the main thread then). record_group: its group id goes to $PDR_REAL_PGID_FILE."""
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab" if append else "wb") as log_file, \
            open(stdout_path, "ab") if stdout_path is not None else contextlib.nullcontext() as out:
        popen = subprocess.Popen(list(argv), **spawn_options(log_file, cwd=cwd, env=child_env() if env is None else env,
                                                            die_with_parent=die_with_parent, stdout=out))
    if record_group:
        record_process_group(popen.pid)
    return Child(name, popen, log_path, list(argv))


# ---- stopping -----------------------------------------------------------------------------------------------
def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def pid_alive(pid: int) -> bool:
    """Whether pid runs (a zombie does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def stop_group(pgid: int, grace: float, poll_s: float = 0.1) -> None:
    """SIGTERM a process group (of a process that may not be this one's child); SIGKILL what is left of it after
    `grace` seconds (or once its leader is gone)."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and pid_alive(pgid):
        time.sleep(poll_s)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def stop_all(children: Sequence[Child], grace: float = 10.0) -> None:
    """SIGTERM every child's group at once, SIGKILL what is left after `grace` seconds."""
    for child in children:
        if child.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(child.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for child in children:
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.popen.wait(timeout=max(deadline - time.monotonic(), 0.01))
    for child in children:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.pid, signal.SIGKILL)  # the leader may be gone while its children live on
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.popen.wait(timeout=grace)


# ---- waiting ------------------------------------------------------------------------------------------------
def _described(what: str | Callable[[], str]) -> str:
    """`what` a wait names: a string, or a callable giving the late detail (what was seen at the deadline)."""
    return what() if callable(what) else what


def _exited(child: Child, what: str | Callable[[], str]) -> ChildExited:
    return ChildExited(f"{child.name} exited with {child.popen.returncode} while waiting for {_described(what)}; "
                       f"log tail:\n{child.log_tail()}")


def _timed_out(child: Child | None, what: str | Callable[[], str], timeout: float) -> TimeoutError:
    tail = f"; log tail:\n{child.log_tail()}" if child is not None else ""
    return TimeoutError(f"{_described(what)}: not reached within {timeout:g} s{tail}")


def wait_until(predicate: Callable[[], Any], *, timeout: float, what: str | Callable[[], str],
               child: Child | None = None, interval: float = 0.1) -> Any:
    """Poll predicate until it is truthy (and return it); ChildExited the moment `child` ends, TimeoutError at
    the deadline (both naming `what`, with the child's log tail)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if child is not None and not child.alive():
            raise _exited(child, what)
        if time.monotonic() > deadline:
            raise _timed_out(child, what, timeout)
        time.sleep(interval)


async def await_until(condition: Callable[[], Any], *, timeout: float, what: str | Callable[[], str],
                      child: Child | None = None, interval: float = 0.1) -> Any:
    """`wait_until` for an event loop: condition() may be sync or async."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if child is not None and not child.alive():
            raise _exited(child, what)
        if time.monotonic() > deadline:
            raise _timed_out(child, what, timeout)
        await asyncio.sleep(interval)


# ---- /proc ------------------------------------------------------------------------------------------------
def _stat_fields(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw[raw.rindex(")") + 2:].split()  # field 2 (comm) may hold spaces: split after its parenthesis


def process_tree(root: int) -> list[int]:
    """root and all its descendants, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := _stat_fields(int(entry))) is not None:
            children.setdefault(int(fields[1]), []).append(int(entry))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def cpu_seconds(pid: int, *, tree: bool = False) -> float | None:
    """User+system CPU seconds used so far by pid (with `tree`, and its live descendants); None if it is gone."""
    ticks, found = 0, False
    for one in process_tree(pid) if tree else [pid]:
        if (fields := _stat_fields(one)) is not None:
            ticks += int(fields[11]) + int(fields[12])  # utime, stime
            found = True
    return round(ticks / CLOCK_TICKS, 2) if found else None


def rss_kib(pid: int, field: str = "VmRSS") -> int | None:
    """The process's resident memory (KiB; `field` "VmHWM": its peak so far); None if it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None
