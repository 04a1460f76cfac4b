"""A scenario's verdict: counts, latency percentiles and requests/s from the request records, plus checks.

Pure functions of the records (one dict per request, as the locustfile writes them) and of what the
scenario observed; `Summary.render()` is the text the command prints, `to_dict()` its JSON.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

from .workload import ABORTED, ERROR, OK


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass
class Check:
    name: str
    passed: bool
    detail: str = ""


@dataclass
class Event:
    """Something the scenario did while the load ran, with its wall-clock span and result."""

    name: str
    start: float
    end: float
    detail: str = ""

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass
class Stats:
    requests: int = 0
    ok: int = 0
    aborted: int = 0
    errors: int = 0
    window_s: float = 0.0  # first request sent .. last answer received
    requests_per_s: float = 0.0  # good answers per second over the window
    ttft_ms: dict[str, float | None] = field(default_factory=dict)
    e2e_ms: dict[str, float | None] = field(default_factory=dict)
    itl_ms: dict[str, float | None] = field(default_factory=dict)
    by_route: dict[str, dict[str, int]] = field(default_factory=dict)
    lag_p99_ms: float | None = None  # fixed-rate mode: how late requests left their slots


def stats_of(records: Iterable[dict]) -> Stats:
    records = list(records)
    stats = Stats(requests=len(records))
    if not records:
        return stats
    good = [r for r in records if r["outcome"] == OK]
    stats.ok = len(good)
    stats.aborted = sum(1 for r in records if r["outcome"] == ABORTED)
    stats.errors = sum(1 for r in records if r["outcome"] == ERROR)
    stats.window_s = max(r["end"] for r in records) - min(r["start"] for r in records)
    stats.requests_per_s = stats.ok / stats.window_s if stats.window_s > 0 else 0.0

    def pcts(key: str) -> dict[str, float | None]:
        values = [r[key] for r in good if r.get(key) is not None]
        return {"p50": percentile(values, 50), "p99": percentile(values, 99), "n": len(values)}

    stats.ttft_ms, stats.e2e_ms, stats.itl_ms = pcts("ttft_ms"), pcts("e2e_ms"), pcts("itl_ms")
    for r in records:
        key = r["route"] + (" stream" if r["stream"] else "")
        row = stats.by_route.setdefault(key, {OK: 0, ABORTED: 0, ERROR: 0})
        row[r["outcome"]] += 1
    lags = [r.get("lag_ms") or 0.0 for r in records]
    if any(lags):
        stats.lag_p99_ms = percentile(lags, 99)
    return stats


def phases(records: list[dict], events: list[Event], warmup_until: float = 0.0) -> dict[str, Any]:
    """Good answers before the first event (those sent after `warmup_until`: the first answers of a run
    include its ramp), overlapping an event, and after the last one: count, p50/p99 e2e and TTFT, and the
    ratio of the disturbed phase's p99 to the calm one's (same run, same load)."""
    if not events:
        return {}
    first = min(e.start for e in events)
    last = max(e.end for e in events)
    good = [r for r in records if r["outcome"] == OK]
    groups = {
        "before": [r for r in good if warmup_until <= r["start"] and r["end"] < first],
        "during": [r for r in good if any(r["start"] <= e.end and r["end"] >= e.start for e in events)],
        "after": [r for r in good if r["start"] > last],
    }
    out: dict[str, Any] = {}
    for name, group in groups.items():
        e2e = [r["e2e_ms"] for r in group]
        ttft = [r["ttft_ms"] for r in group if r.get("ttft_ms") is not None]
        out[name] = {"n": len(group), "e2e_p50_ms": percentile(e2e, 50), "e2e_p99_ms": percentile(e2e, 99),
                     "ttft_p99_ms": percentile(ttft, 99)}
    calm, busy = out["before"], out["during"]
    for key in ("e2e_p99_ms", "ttft_p99_ms"):
        if calm[key] and busy[key] is not None:
            out[f"during_vs_before_{key[:-3]}"] = round(busy[key] / calm[key], 2)
    return out


@dataclass
class Summary:
    scenario: str
    stats: Stats
    checks: list[Check] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    notes: dict[str, Any] = field(default_factory=dict)  # scenario figures (times to convert, rejoin, ...)
    workdir: str = ""

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c.passed for c in self.checks)

    def to_dict(self) -> dict[str, Any]:
        return {"scenario": self.scenario, "passed": self.passed, "stats": asdict(self.stats),
                "checks": [asdict(c) for c in self.checks],
                "events": [{**asdict(e), "seconds": round(e.seconds, 3)} for e in self.events],
                "notes": self.notes, "workdir": self.workdir}

    def render(self) -> str:
        s = self.stats

        def ms(value: float | None) -> str:
            return "-" if value is None else f"{value:.1f}"

        lines = [f"scenario {self.scenario}: {'PASS' if self.passed else 'FAIL'}",
                 f"  requests {s.requests}: ok {s.ok}, aborted {s.aborted}, errors {s.errors}"
                 f" over {s.window_s:.1f} s = {s.requests_per_s:.1f} ok requests/s",
                 f"  TTFT ms     p50 {ms(s.ttft_ms.get('p50'))}  p99 {ms(s.ttft_ms.get('p99'))}"
                 f"  ({s.ttft_ms.get('n', 0)} streamed answers)",
                 f"  e2e ms      p50 {ms(s.e2e_ms.get('p50'))}  p99 {ms(s.e2e_ms.get('p99'))}",
                 f"  ITL ms      p50 {ms(s.itl_ms.get('p50'))}  p99 {ms(s.itl_ms.get('p99'))}"]
        if s.lag_p99_ms is not None:
            lines.append(f"  fixed rate: p99 lag behind schedule {s.lag_p99_ms:.1f} ms")
        if s.by_route:
            lines.append("  by route:   " + ", ".join(
                f"{name} {row[OK]}" + (f"/{row[ABORTED]}a" if row[ABORTED] else "")
                + (f"/{row[ERROR]}e" if row[ERROR] else "") for name, row in sorted(s.by_route.items())))
        ph = self.notes.get("phases") or {}
        if ph:
            lines.append("  phases:     " + "; ".join(
                f"{name} {ph[name]['n']} answers, e2e p99 {ms(ph[name]['e2e_p99_ms'])} ms"
                for name in ("before", "during", "after")))
            ratios = [f"{key[len('during_vs_before_'):]} x{value:.2f}" for key, value in ph.items()
                      if key.startswith("during_vs_before_")]
            if ratios:
                lines.append("  during the events vs before (p99): " + ", ".join(ratios))
        for e in self.events:
            lines.append(f"  event  {e.name}: {e.seconds:.2f} s{': ' + e.detail if e.detail else ''}")
        for c in self.checks:
            lines.append(f"  [{'ok' if c.passed else 'FAIL'}] {c.name}{': ' + c.detail if c.detail else ''}")
        if "load_average_at_start" in self.notes:
            lines.append(f"  machine load average {self.notes['load_average_at_start']} at start,"
                         f" {self.notes.get('load_average_at_end')} at end ({os.cpu_count()} cores)")
        if self.workdir:
            lines.append(f"  logs, records and locust CSVs: {self.workdir}")
        return "\n".join(lines)


# ---- checks every scenario can use -------------------------------------------------------------------
def check_answers(stats: Stats, minimum: int = 1) -> Check:
    return Check("load flowed", stats.ok >= minimum, f"{stats.ok} good answers (need {minimum})")


def check_no_errors(records: list[dict]) -> Check:
    errors = [r for r in records if r["outcome"] == ERROR]
    return Check("no failed requests", not errors, _examples(errors) if errors else "0 errors")


def check_no_aborts(records: list[dict]) -> Check:
    aborted = [r for r in records if r["outcome"] == ABORTED]
    return Check("no aborted answers", not aborted, _examples(aborted) if aborted else "0 aborted")


def _examples(records: list[dict], n: int = 3) -> str:
    shown = "; ".join(f"{r['id']} {r['route']}{' stream' if r['stream'] else ''}: {r['error']}" for r in records[:n])
    return f"{len(records)}: {shown}" + (" ..." if len(records) > n else "")
