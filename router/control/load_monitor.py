"""Polls every worker's own load report (`/v1/loads`, `/get_load` on older servers) at an interval and keeps
the latest on the worker (`worker.server_load`), where policies and the rebalancer read it without I/O.

What a 0.5.23 report counts in each queue is in policies/load_report.py (and docs/SGLANG_LOADS.md). Besides
the report itself, two polls in a row give rates the report only holds as running totals:
- `prefill_busy`: the share of the time between the polls that the server spent in prefill forwards
  (`total_prefill_busy_us`): how close its prefill compute is to saturation;
- `decode_step_s` and `decode_batch`: the mean decode step (what each running request waited per token) and
  the mean batch size over the steps made between the polls (`decode_moments`).
A rate is kept only when both polls described the same server in the same role (counters that went back
mean a restart or a role switch: no rate this time).

A poll that fails or times out clears the snapshot (a stale figure is worse than none: policies then fall
back to the router's own counts). A result that comes back after the worker changed (its revision moved:
converted, removed, re-registered) is dropped.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from aiohttp import web

from policies import ServerLoad
from policies.load_report import LoadReport
from router.control.upstream import Upstream
from router.core.config import LoadMonitorConfig
from router.core.registry import Registry, Worker, WorkerState

logger = logging.getLogger(__name__)

# Workers worth asking: everything registered and reachable in principle.
_SKIPPED_STATES = frozenset({WorkerState.PENDING, WorkerState.FAILED})


def rates(previous: ServerLoad | None, report: LoadReport | None, now: float) -> dict[str, float]:
    """`prefill_busy`, `decode_step_s`, `decode_batch` from two consecutive reports of one server."""
    if previous is None or previous.report is None or report is None or previous.report.mode != report.mode:
        return {}
    elapsed = now - previous.taken_at
    out: dict[str, float] = {}
    before, after = previous.report.prefill_busy_us, report.prefill_busy_us
    if before is not None and after is not None and after >= before and elapsed > 0:
        out["prefill_busy"] = min(1.0, (after - before) / 1e6 / elapsed)
    m0, m1 = previous.report.decode_moments, report.decode_moments
    if m1 is not None:
        m0 = m0 or (0.0,) * 6
        steps = m1[0] - m0[0]
        if steps > 0 and all(b >= a for a, b in zip(m0, m1)):
            out["decode_step_s"] = (m1[2] - m0[2]) / steps / 1e6
            out["decode_batch"] = (m1[1] - m0[1]) / steps
    return out


class LoadMonitor:
    def __init__(self, registry: Registry, upstream: Upstream, config: LoadMonitorConfig, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.registry = registry
        self.upstream = upstream
        self.config = config
        self.clock = clock
        self.rounds = 0
        self.polls = 0
        self.failures = 0
        self.last_round_at: float | None = None

    async def poll_once(self) -> None:
        """One round: every worker at once, each bounded by the poll timeout."""
        workers = [w for w in self.registry.workers() if w.state not in _SKIPPED_STATES]
        if workers:
            await asyncio.gather(*(self._poll(w) for w in workers))
        self.rounds += 1
        self.last_round_at = self.clock()

    async def _poll(self, worker: Worker) -> None:
        revision, inflight_at, rank_inflight_at = worker.revision, worker.inflight, tuple(worker.rank_inflight)
        self.polls += 1
        try:
            load = await asyncio.wait_for(self.upstream.load(worker.url, timeout=self.config.timeout_secs),
                                          self.config.timeout_secs)
        except (asyncio.TimeoutError, ValueError, TypeError, AttributeError) as exc:
            logger.debug("load poll of %s failed: %s", worker.url, exc)
            load = None
        if worker.revision != revision or self.registry.find(worker.id) is not worker:
            return  # the worker changed while we asked: this answer describes something else
        if load is None:
            self.failures += 1
            worker.server_load = None
            return
        now = self.clock()
        previous = worker.server_load
        worker.server_load = ServerLoad(running=load.running, waiting=load.waiting, token_usage=load.token_usage,
                                        inflight_at=inflight_at, rank_inflight_at=rank_inflight_at, taken_at=now,
                                        report=load.report,
                                        **rates(previous, load.report, now))

    async def run(self) -> None:
        """Poll forever at the interval (a slow round delays the next one rather than overlapping it)."""
        while True:
            started = self.clock()
            try:
                await self.poll_once()
            except Exception:  # never let one bad round end the monitor
                logger.exception("load poll round failed")
            await asyncio.sleep(max(0.0, self.config.interval_secs - (self.clock() - started)))

    def state(self) -> dict:
        return {
            "enabled": self.config.enabled,
            "interval_secs": self.config.interval_secs,
            "timeout_secs": self.config.timeout_secs,
            "rounds": self.rounds,
            "polls": self.polls,
            "failures": self.failures,
            "last_round_age_secs": None if self.last_round_at is None
            else round(self.clock() - self.last_round_at, 3),
        }


LOAD_MONITOR = web.AppKey("load_monitor", LoadMonitor)
