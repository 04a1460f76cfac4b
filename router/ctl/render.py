"""Plain-text output: aligned tables, values as an operator reads them, and the JSON form for scripts."""

from __future__ import annotations

import json
import sys
import time
from typing import Any, Iterable, Sequence, TextIO


def cell(value: Any) -> str:
    if value is None or value == "":
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.3f}".rstrip("0").rstrip(".") if value != int(value) else str(int(value))
    if isinstance(value, (list, tuple)):
        return ",".join(cell(v) for v in value) or "-"
    return str(value)


def seconds(value: Any) -> str:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return "-"
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"


def age(wall_time: Any, now: float | None = None) -> str:
    """How long ago a wall-clock timestamp was, briefly."""
    if not isinstance(wall_time, (int, float)):
        return "-"
    delta = max((time.time() if now is None else now) - wall_time, 0.0)
    if delta < 60:
        return f"{delta:.0f}s ago"
    if delta < 3600:
        return f"{delta / 60:.0f}m ago"
    return f"{delta / 3600:.1f}h ago"


def _is_number(text: str) -> bool:
    try:
        float(text.split()[0])
    except (ValueError, IndexError):
        return False
    return True


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]], *, max_width: int = 60) -> str:
    """Columns padded to their widest cell (numbers right-aligned), cells cut at `max_width`."""
    texts = [[cell(v) for v in row] for row in rows]
    texts = [[clip(t, max_width) for t in row] for row in texts]
    widths = [max([len(h)] + [len(row[i]) for row in texts]) for i, h in enumerate(headers)]
    numeric = [any(_is_number(row[i]) for row in texts) and all(_is_number(row[i]) or row[i] == "-" for row in texts)
               for i in range(len(headers))]
    lines = ["  ".join(h.upper().ljust(w) for h, w in zip(headers, widths)).rstrip()]
    for row in texts:
        parts = [t.rjust(w) if num else t.ljust(w) for t, w, num in zip(row, widths, numeric)]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


def clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def fields(pairs: Iterable[tuple[str, Any]]) -> str:
    """`name: value` lines, names aligned."""
    pairs = list(pairs)
    width = max((len(name) for name, _ in pairs), default=0)
    return "\n".join(f"{(name + ':').ljust(width + 1)} {cell(value)}" for name, value in pairs)


class Console:
    """Where a command writes: human text, or (with --json) one JSON document on stdout and nothing else."""

    def __init__(self, as_json: bool, out: TextIO | None = None, err: TextIO | None = None):
        self.as_json = as_json
        self.out = out or sys.stdout
        self.err = err or sys.stderr

    def say(self, text: str = "") -> None:
        """Human output (skipped with --json)."""
        if not self.as_json:
            print(text, file=self.out, flush=True)

    def document(self, body: Any) -> None:
        """The machine-readable result (printed with --json only)."""
        if self.as_json:
            print(json.dumps(body, indent=2, sort_keys=False), file=self.out, flush=True)

    def warn(self, text: str) -> None:
        print(f"pd-router ctl: {text}", file=self.err, flush=True)
