"""Where a Python router spends its CPU under load: py-spy samples, summarised by function and by file."""

from __future__ import annotations

import re
import subprocess
from collections import Counter
from pathlib import Path

from bench.contenders import PEERS_VENV

_LINE_NUMBER = re.compile(r":\d+\)$")


def py_spy() -> str:
    return str(PEERS_VENV / "bin" / "py-spy")


def start(pid: int, seconds: float, out: Path, rate: int = 200) -> subprocess.Popen:
    """Sample pid (and its child processes) for `seconds` in the background, collapsed stacks into out."""
    argv = [py_spy(), "record", "--pid", str(pid), "--duration", str(max(1, round(seconds))), "--rate", str(rate),
            "--subprocesses", "--nonblocking", "--format", "raw", "--output", str(out)]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def finish(sampler: subprocess.Popen, timeout: float = 60.0) -> None:
    try:
        _, err = sampler.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        sampler.kill()
        sampler.communicate()
        raise RuntimeError("py-spy did not finish in time")
    if sampler.returncode != 0:
        raise RuntimeError(f"py-spy failed ({sampler.returncode}): {err[-1000:]}")


def _frame_name(frame: str) -> str:
    return _LINE_NUMBER.sub(")", frame.strip())


def _file_of(frame: str) -> str:
    inside = frame[frame.rfind("(") + 1:].rstrip(")")
    return inside.split(":", 1)[0] or frame


def summarize(collapsed: str, top: int = 40) -> dict:
    """Self and inclusive sample shares per function (line numbers dropped) and self share per file."""
    self_by_func: Counter = Counter()
    incl_by_func: Counter = Counter()
    self_by_file: Counter = Counter()
    total = 0
    for line in collapsed.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = [_frame_name(f) for f in stack.split(";") if f.strip()]
        # py-spy --subprocesses starts each stack with "process PID:..." : not a function.
        frames = [f for f in frames if not f.startswith("process ")]
        if not frames:
            continue
        total += n
        self_by_func[frames[-1]] += n
        self_by_file[_file_of(frames[-1])] += n
        for frame in set(frames):
            incl_by_func[frame] += n

    def share(counter: Counter) -> list[tuple[str, float]]:
        return [(name, round(100 * n / total, 1)) for name, n in counter.most_common(top)] if total else []

    return {"samples": total, "self_by_function": share(self_by_func), "inclusive_by_function": share(incl_by_func),
            "self_by_file": share(self_by_file)}


def render(summary: dict, top: int = 15) -> str:
    lines = [f"py-spy: {summary['samples']} samples (CPU only, idle excluded)", "  self % by file:"]
    lines += [f"    {pct:5.1f}  {name}" for name, pct in summary["self_by_file"][:top]]
    lines.append("  self % by function:")
    lines += [f"    {pct:5.1f}  {name}" for name, pct in summary["self_by_function"][:top]]
    lines.append("  inclusive % by function (entry points above 90% left out):")
    inclusive = [(name, pct) for name, pct in summary["inclusive_by_function"] if pct < 90]
    lines += [f"    {pct:5.1f}  {name}" for name, pct in inclusive[:top]]
    return "\n".join(lines)
