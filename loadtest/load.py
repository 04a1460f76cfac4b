"""Locust, headless, in its own process: started against a URL, followed through its record file, awaited.

The locustfile writes one JSON line per finished request (`--record-file`); scenarios read it while the
load runs (to act once answers flow) and at the end (to judge). Locust's own CSV files (`locust_stats.csv`
with the TTFT/ITL rows and percentiles, `locust_failures.csv`, ...) and its log stay in the run directory.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from .stack import Process, REPO_ROOT, spawn, stop_process, wait_until

LOCUSTFILE = REPO_ROOT / "loadtest" / "locustfile.py"


@dataclass
class LoadOptions:
    duration_s: float = 30.0
    users: int = 16
    rate: float = 0.0  # requests/s over all users (0: closed loop)
    prompt_tokens: str = "128:32"
    output_tokens: str = "32:8"
    routes: str = "generate,completions,chat"
    stream_fraction: float = 0.5
    request_timeout_s: float = 60.0
    seed: int | None = None

    def locust_args(self) -> list[str]:
        args = ["--users", str(self.users), "--spawn-rate", str(self.users), "--run-time", f"{self.duration_s:g}s",
                "--routes", self.routes, "--stream-fraction", str(self.stream_fraction),
                "--prompt-tokens", self.prompt_tokens, "--output-tokens", self.output_tokens,
                "--request-timeout", str(self.request_timeout_s)]
        if self.rate:
            args += ["--rate", str(self.rate)]
        if self.seed is not None:
            args += ["--seed", str(self.seed)]
        return args


@dataclass
class LoadRun:
    """One headless locust run against `host`."""

    host: str
    options: LoadOptions
    workdir: Path
    python: str = sys.executable
    process: Process | None = None
    started_at: float = 0.0  # wall clock
    _read_offset: int = 0
    _records: list[dict] = field(default_factory=list)

    @property
    def record_path(self) -> Path:
        return self.workdir / "records.jsonl"

    def start(self) -> None:
        self.record_path.unlink(missing_ok=True)
        # In-flight requests get this long to finish after the run time, so that every request is judged.
        stop_timeout = max(10.0, self.options.request_timeout_s)
        argv = [self.python, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--host", self.host,
                "--csv", str(self.workdir / "locust"), "--only-summary", "--loglevel", "WARNING",
                "--stop-timeout", f"{stop_timeout:g}", "--exit-code-on-error", "0",
                "--record-file", str(self.record_path), *self.options.locust_args()]
        self.started_at = time.time()
        self.process = spawn("locust", argv, self.workdir)

    def records(self) -> list[dict]:
        """Every record written so far (read incrementally)."""
        try:
            with open(self.record_path, "rb") as f:
                f.seek(self._read_offset)
                data = f.read()
        except FileNotFoundError:
            return self._records
        end = data.rfind(b"\n") + 1  # a line being written is read next time
        for line in data[:end].splitlines():
            if line.strip():
                self._records.append(orjson.loads(line))
        self._read_offset += end
        return self._records

    async def wait_answers(self, count: int, *, since: float = 0.0, timeout: float = 30.0, what: str = "") -> None:
        """Until `count` requests that started after `since` (wall clock) have finished."""
        def enough() -> bool:
            return sum(1 for r in self.records() if r["start"] >= since) >= count

        await wait_until(enough, timeout=timeout, interval=0.1, process=self.process,
                         what=what or f"{count} answers since {since:.3f}")

    async def wait(self, timeout: float) -> int:
        """Until locust exits (its run time plus the in-flight requests' stop timeout); its exit code."""
        assert self.process is not None
        popen = self.process.popen
        await wait_until(lambda: popen.poll() is not None, timeout=timeout, interval=0.2, what="locust to finish")
        self.records()
        return popen.returncode

    def stop(self) -> None:
        if self.process is not None:
            stop_process(self.process)

    def time_left(self) -> float:
        return self.started_at + self.options.duration_s - time.time()
