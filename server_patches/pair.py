"""A real 1 prefill + 1 decode SGLang pair on this machine, for development and the real-server test tier.

    python -m server_patches.pair start [--prefill-port N --decode-port N --prefill-bootstrap-port N
                                          --decode-bootstrap-port N] [--radix-cache] [--run-dir DIR]
                                          [--timeout S]
    python -m server_patches.pair status [--run-dir DIR]
    python -m server_patches.pair stop   [--run-dir DIR]

`start` makes the tiny random Llama if it is missing (WORK/tinymodel, no download), launches both servers through
server_patches.launch_server (ports the OS reports free unless given), waits until both answer /health (or fails
with the tail of the dead one's log at the deadline), writes pid files and pair.json into the run dir (default
WORK/run/pair), and prints that JSON. `stop` sends SIGTERM to each server's process group, then SIGKILL after a
grace period. Python API: `with RealPair.launch(...) as pair:` (or RealServer.launch for one server).
Stdlib only.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from harness import processes
from harness.processes import free_ports, http_status, pid_alive, stop_group

from . import launch_server
from .stack import CHECKOUT_ROOT, ENV_PATCHES_DISABLE, StackPaths, is_installed, log, resolve_paths

HOST = "127.0.0.1"
DEFAULT_START_TIMEOUT_S = 300.0
STOP_GRACE_S = 30.0
POLL_S = 0.5

# What the stack needs to run a server on CPU (see ../shared/real-sglang.md); per-server options are added later.
CPU_ARGS = (
    "--device", "cpu", "--attention-backend", "torch_native", "--sampling-backend", "pytorch",
    "--host", HOST, "--max-total-tokens", "4096", "--skip-server-warmup", "--disable-cuda-graph",
    "--grammar-backend", "none", "--dtype", "bfloat16", "--disable-overlap-schedule", "--sleep-on-idle",
)
# ... and a PD server on top of them.
CPU_PD_ARGS = (*CPU_ARGS, "--disaggregation-transfer-backend", "mooncake_tcp", launch_server.CONVERT_FLAG)
ROLES = ("prefill", "decode", "regular")  # regular: not disaggregated (SGLang's disaggregation mode "null")


class PairError(RuntimeError):
    pass


def ensure_tiny_model(paths: StackPaths, timeout: float = 300.0) -> Path:
    from .tinymodel import is_complete

    if not is_complete(str(paths.tiny_model)):
        t0 = time.monotonic()
        env = launch_server.server_environment(paths, ["--device", "cpu"])
        env["PDR_SERVER_PATCHES_VERBOSE"] = "0"
        subprocess.run(
            [str(paths.python), "-m", "server_patches.tinymodel", str(paths.tiny_model)],
            cwd=CHECKOUT_ROOT, env=env, check=True, timeout=timeout, stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
        )
        log(f"tiny model created in {paths.tiny_model} ({time.monotonic() - t0:.1f}s)")
    return paths.tiny_model


@dataclass
class ServerInfo:
    role: str  # launch role
    url: str
    port: int
    bootstrap_port: Optional[int]  # None for a regular server
    pid: int
    log: str


@dataclass
class RealServer:
    """One real SGLang server started through launch_server, in its own process group."""

    info: ServerInfo
    process: Optional[subprocess.Popen] = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return self.info.url

    @property
    def bootstrap_port(self) -> int:
        return self.info.bootstrap_port

    @classmethod
    def launch(
        cls, role: str, *, paths: StackPaths, model: Path, log_path: Path, port: Optional[int] = None,
        bootstrap_port: Optional[int] = None, radix_cache: bool = False,
        disabled_patches: Sequence[str] = (), extra_args: Sequence[str] = (), die_with_parent: bool = False,
    ) -> "RealServer":
        """Start the server (not waiting for it). die_with_parent: the kernel kills it (SIGKILL; SGLang's own
        processes follow their parent) when the calling thread's process ends, even by SIGKILL: for tests.
        Call it from the main thread then (the signal follows the thread that started the process)."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, not {role!r}")
        if role == "regular":
            port = port or free_ports(1)[0]
            bootstrap_port = None
            args = [*CPU_ARGS, "--model-path", str(model), "--port", str(port)]
        else:
            if port is None or bootstrap_port is None:
                picked = free_ports(2)
                port = port or picked[0]
                bootstrap_port = bootstrap_port or picked[1]
            args = [*CPU_PD_ARGS, "--model-path", str(model), "--port", str(port),
                    "--disaggregation-mode", role, "--disaggregation-bootstrap-port", str(bootstrap_port)]
        if not radix_cache:
            args.append("--disable-radix-cache")
        if role == "decode":
            args += ["--disaggregation-decode-retraction-backup", "none"]
        args += list(extra_args)
        env = dict(os.environ)
        if disabled_patches:
            env[ENV_PATCHES_DISABLE] = ",".join(disabled_patches)
        env["PDR_REAL_VENV"] = str(paths.venv)
        # Run from the log's folder, not the checkout: `python -m` puts the working directory first on sys.path,
        # and the checkout's top-level packages (router, tests, ...) have no business shadowing anything there.
        launcher = (f"import sys; sys.path.insert(0, {str(CHECKOUT_ROOT)!r}); "
                    "from server_patches.launch_server import main; sys.exit(main())")
        # its own process group: stop() reaches scheduler and detokenizer too
        child = processes.start(f"{role} server", [sys.executable, "-c", launcher, *args], log_path,
                                cwd=log_path.parent, env=env, append=True, die_with_parent=die_with_parent,
                                record_group=True)
        info = ServerInfo(role, f"http://{HOST}:{port}", port, bootstrap_port, child.pid, str(log_path))
        return cls(info, child.popen)

    def alive(self) -> bool:
        if self.process is not None:
            return self.process.poll() is None
        return pid_alive(self.info.pid)

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(Path(self.info.log).read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"

    def healthy(self) -> bool:
        return http_status(f"{self.url}/health") == 200

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        stop_group(self.info.pid, grace_s)
        if self.process is not None:
            self.process.wait(timeout=grace_s)


def wait_healthy(servers: Sequence[RealServer], timeout: float) -> float:
    """Until every server answers /health 200; fails at once if one dies. Returns seconds waited."""
    t0 = time.monotonic()
    deadline = t0 + timeout
    pending = list(servers)
    while pending:
        for server in list(pending):
            if not server.alive():
                raise PairError(f"{server.info.role} server on {server.url} exited while starting; log tail:\n"
                                f"{server.log_tail()}")
            if server.healthy():
                pending.remove(server)
        if not pending:
            break
        if time.monotonic() >= deadline:
            names = ", ".join(f"{s.info.role} {s.url}" for s in pending)
            raise PairError(f"not healthy after {timeout:.0f}s: {names}; last log lines:\n"
                            + "\n".join(s.log_tail(10) for s in pending))
        time.sleep(POLL_S)
    return time.monotonic() - t0


@dataclass
class RealPair:
    prefill: RealServer
    decode: RealServer
    run_dir: Path
    started_in_s: float = 0.0
    attached: bool = False  # started elsewhere: stop() leaves it running

    @classmethod
    def launch(
        cls, *, paths: Optional[StackPaths] = None, run_dir: Optional[Path] = None, radix_cache: bool = False,
        prefill_port: Optional[int] = None, decode_port: Optional[int] = None,
        prefill_bootstrap_port: Optional[int] = None, decode_bootstrap_port: Optional[int] = None,
        timeout: float = DEFAULT_START_TIMEOUT_S, disabled_patches: Sequence[str] = (), die_with_parent: bool = False,
    ) -> "RealPair":
        paths = paths or resolve_paths()
        if not is_installed(paths):
            raise PairError(f"no real-server stack at {paths.venv}: run `python -m server_patches.install`")
        run_dir = Path(run_dir or paths.work / "run" / "pair")
        run_dir.mkdir(parents=True, exist_ok=True)
        model = ensure_tiny_model(paths)
        wanted = [prefill_port, decode_port, prefill_bootstrap_port, decode_bootstrap_port]
        picked = iter(free_ports(4))
        p_port, d_port, p_boot, d_boot = [w or next(picked) for w in wanted]
        common = dict(paths=paths, model=model, radix_cache=radix_cache, disabled_patches=disabled_patches,
                      die_with_parent=die_with_parent)
        t0 = time.monotonic()
        prefill = RealServer.launch("prefill", port=p_port, bootstrap_port=p_boot,
                                    log_path=run_dir / "prefill.log", **common)
        try:
            decode = RealServer.launch("decode", port=d_port, bootstrap_port=d_boot,
                                       log_path=run_dir / "decode.log", **common)
        except BaseException:
            prefill.stop()
            raise
        pair = cls(prefill, decode, run_dir)
        pair._write_run_files()
        try:
            wait_healthy([prefill, decode], timeout)
        except BaseException:
            pair.stop()
            raise
        pair.started_in_s = time.monotonic() - t0
        pair._write_run_files()
        return pair

    @classmethod
    def attach(cls, run_dir: Path) -> "RealPair":
        """A pair started elsewhere (`pair start`), recorded in run_dir; stop() leaves it running."""
        recorded = _load(Path(run_dir))
        servers = [RealServer(ServerInfo(**recorded[role])) for role in ("prefill", "decode")]
        dead = [s.url for s in servers if not s.alive() or not s.healthy()]
        if dead:
            raise PairError(f"the pair recorded in {run_dir} is not healthy: {dead}")
        return cls(*servers, Path(run_dir), recorded.get("started_in_s", 0.0), attached=True)

    def describe(self) -> dict:
        return {
            "prefill": asdict(self.prefill.info),
            "decode": asdict(self.decode.info),
            "run_dir": str(self.run_dir),
            "started_in_s": round(self.started_in_s, 1),
        }

    def _write_run_files(self) -> None:
        for server in (self.prefill, self.decode):
            (self.run_dir / f"{server.info.role}.pid").write_text(f"{server.info.pid}\n")
        (self.run_dir / "pair.json").write_text(json.dumps(self.describe(), indent=2) + "\n")

    def stop(self) -> None:
        if self.attached:
            return
        # Both at once: each may take its grace period.
        for server in (self.prefill, self.decode):
            try:
                os.killpg(server.info.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for server in (self.prefill, self.decode):
            server.stop()
        for name in ("prefill.pid", "decode.pid"):
            (self.run_dir / name).unlink(missing_ok=True)

    def __enter__(self) -> "RealPair":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _load(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / "pair.json").read_text())
    except FileNotFoundError:
        raise PairError(f"no pair recorded in {run_dir}") from None


def status(run_dir: Path) -> dict:
    recorded = _load(run_dir)
    for role in ("prefill", "decode"):
        info = recorded[role]
        pid_file = run_dir / f"{role}.pid"
        info["running"] = pid_file.exists() and pid_alive(int(info["pid"]))
        info["health"] = http_status(f"{info['url']}/health") if info["running"] else None
    recorded["healthy"] = all(recorded[r]["health"] == 200 for r in ("prefill", "decode"))
    return recorded


def stop_recorded(run_dir: Path) -> dict:
    recorded = _load(run_dir)
    stopped = {}
    for role in ("prefill", "decode"):
        pid_file = run_dir / f"{role}.pid"
        if not pid_file.exists():
            stopped[role] = "not running"
            continue
        pid = int(pid_file.read_text())
        if pid_alive(pid):
            stop_group(pid, STOP_GRACE_S)
            stopped[role] = "stopped" if not pid_alive(pid) else "still running"
        else:
            stopped[role] = "was not running"
        pid_file.unlink(missing_ok=True)
    recorded["stopped"] = stopped
    return recorded


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m server_patches.pair", description=__doc__.split("\n")[0])
    parser.add_argument("action", choices=("start", "status", "stop"))
    parser.add_argument("--run-dir", help="where pid files, pair.json and logs go (default WORK/run/pair)")
    parser.add_argument("--venv")
    parser.add_argument("--work")
    parser.add_argument("--prefill-port", type=int)
    parser.add_argument("--decode-port", type=int)
    parser.add_argument("--prefill-bootstrap-port", type=int)
    parser.add_argument("--decode-bootstrap-port", type=int)
    parser.add_argument("--radix-cache", action="store_true", help="keep the prefix cache (default: disabled)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_START_TIMEOUT_S, help="start deadline, seconds")
    args = parser.parse_args(argv)
    paths = resolve_paths(args.venv, args.work)
    run_dir = Path(args.run_dir) if args.run_dir else paths.work / "run" / "pair"
    try:
        if args.action == "start":
            if (run_dir / "pair.json").exists() and status(run_dir)["healthy"]:
                raise PairError(f"a pair recorded in {run_dir} is already running; stop it first")
            pair = RealPair.launch(
                paths=paths, run_dir=run_dir, radix_cache=args.radix_cache, timeout=args.timeout,
                prefill_port=args.prefill_port, decode_port=args.decode_port,
                prefill_bootstrap_port=args.prefill_bootstrap_port,
                decode_bootstrap_port=args.decode_bootstrap_port,
            )
            out = pair.describe()
        elif args.action == "status":
            out = status(run_dir)
        else:
            out = stop_recorded(run_dir)
    except PairError as e:
        log(str(e))
        return 1
    print(json.dumps(out, indent=2))
    return 0 if args.action != "status" or out["healthy"] else 1


if __name__ == "__main__":
    sys.exit(main())
