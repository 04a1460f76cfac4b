"""Polls every worker's own load report (`/v1/loads`, `/get_load` on older servers) at an interval and keeps
the latest on the worker (`worker.server_load`), where policies and the rebalancer read it without I/O.

What a 0.5.23 report counts in each queue is in policies/load_report.py (and docs/SGLANG_LOADS.md). Besides
the report itself, two polls in a row give rates the report only holds as running totals:
- `prefill_busy`: the share of the time between the polls that the server spent in prefill forwards
  (`total_prefill_busy_us`): how close its prefill compute is to saturation;
- `decode_step_s` and `decode_batch`: the mean decode step (what each running request waited per token) and
  the mean batch size over the steps made between the polls (`decode_moments`);
- `decode_step_fixed_s` and `decode_step_per_request_s`: the step as a line of the batch size, fitted on every
  step since the server started (`step_fit`), so that the step a batch of any size takes can be predicted.
A rate is kept only when both polls described the same server in the same role (counters that went back
mean a restart or a role switch: no rate this time). A decode running batches republishes its row only every
`load_snapshot_publish_interval` steps (15): polls in between see the same moments, and the rate of the last
steps published stands while that row still shows a running batch (without it, the decode latency vanished from
two polls in three under load, and the rebalancer read a saturated decode pool as idle). It stands as a floor:
a row `age_s` old that still shows a running batch has seen fewer steps than the interval since, so the
steps now take at least `age_s / interval` (a decode whose batch grew to 60 republished every 15 s on the
benchmark's fleet; its last published step was half of what it had become). The interval is the largest count
of steps seen between two published rows (decaying, never under 0.5.23's default of 15: a smaller estimate
would overstate the step).

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


PUBLISH_INTERVAL_STEPS = 15  # 0.5.23's default --load-snapshot-publish-interval
_INTERVAL_DECAY = 0.9  # per published row: one late poll (two intervals seen as one) is forgotten in a few rows


def rates(previous: ServerLoad | None, report: LoadReport | None, now: float) -> dict[str, float]:
    """`prefill_busy`, `decode_step_s`, `decode_batch` (and `decode_publish_steps`, the publish interval seen)
    from two consecutive reports of one server."""
    if previous is None or previous.report is None or report is None or previous.report.mode != report.mode:
        return {}
    elapsed = now - previous.taken_at
    out: dict[str, float] = {}
    before, after = previous.report.prefill_busy_us, report.prefill_busy_us
    if before is not None and after is not None and after >= before and elapsed > 0:
        out["prefill_busy"] = min(1.0, (after - before) / 1e6 / elapsed)
    m0, m1 = previous.report.decode_moments, report.decode_moments
    out.update(step_fit(m1))
    if m1 is not None:
        seen = previous.decode_publish_steps or PUBLISH_INTERVAL_STEPS
        steps = m1[0] - (m0 or (0.0,) * 6)[0]
        if steps > 0 and all(b >= a for a, b in zip(m0 or (0.0,) * 6, m1)):
            m0 = m0 or (0.0,) * 6
            out["decode_step_s"] = (m1[2] - m0[2]) / steps / 1e6
            out["decode_batch"] = (m1[1] - m0[1]) / steps
            # steps since the row before (not since the server started: the first row says nothing of it)
            counted = steps if previous.report.decode_moments is not None else 0
            out["decode_publish_steps"] = max(PUBLISH_INTERVAL_STEPS, counted, seen * _INTERVAL_DECAY)
        elif m1 == m0 and report.running > 0 and previous.decode_step_s is not None:
            step = previous.decode_step_s
            if report.age_s is not None:
                step = max(step, report.age_s / seen)
            out["decode_step_s"], out["decode_batch"] = step, previous.decode_batch
            out["decode_publish_steps"] = seen
    return out


FIT_MIN_STEPS = 50
FIT_MIN_BATCH_STD = 1.0  # requests: a batch that hardly varied says nothing of what one more request costs


def step_fit(moments: tuple[float, ...] | None) -> dict[str, float]:
    """A decode step's fixed part and its part per running request (`decode_step_fixed_s`,
    `decode_step_per_request_s`): the least-squares line through every step since the server started, from
    0.5.23's `decode_moments` (steps, sum of batch sizes, of step times, of squared batch sizes, of batch x
    time: what they are published for). Empty while too few steps, or too little spread of batch sizes, say."""
    if moments is None or len(moments) < 5 or moments[0] < FIT_MIN_STEPS:
        return {}
    n, sx, sy, sxx, sxy = moments[0], moments[1], moments[2] / 1e6, moments[3], moments[4] / 1e6
    spread = n * sxx - sx * sx
    if spread <= (FIT_MIN_BATCH_STD * n) ** 2:
        return {}
    per_request = (n * sxy - sx * sy) / spread
    if per_request <= 0:
        return {}
    return {"decode_step_fixed_s": max(0.0, (sy - per_request * sx) / n), "decode_step_per_request_s": per_request}


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
