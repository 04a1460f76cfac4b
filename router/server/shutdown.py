"""Graceful shutdown: what the router does between SIGTERM (or SIGINT) and its exit, within one grace period.

    signal     the listening sockets close (serving.py); /health answers 503 "shutting down" on connections
               still open; new requests get 503 at once; no new conversion or fleet operation starts
    grace      requests in flight finish (retries included) and running flows end: a pause the router put
               on the fleet is ended with continue_generation (a paused server would otherwise wait for a
               router that is gone, and the requests stalled on it can finish); not when other router
               replicas share the fleet (its pause is theirs too)
    abort      when `--shutdown-grace-secs` minus the answer window (a fifth of it, at most 5 s) has passed, or
               at a second signal: conversions still emptying their worker and weight updates that have not
               reached their `update` step are rolled back (nothing changed on the servers); every request
               left is marked to be answered with its abort and aborted on both of its servers by rid (again
               while it runs: `abort_until_ended`), so a stream ends with SGLang's `finish_reason: abort` and
               `[DONE]` and a whole answer comes back with what was generated; requests still queued get 503
    cut        requests whose servers have not answered the abort when a quarter of the window is left are
               answered by the router: SGLang's abort answer when the client has seen nothing yet, else an
               error event and `[DONE]` (never a reset connection)
    close      what is answered is flushed, the connections close, then the app (background tasks, pools)

The process then exits 0. A weight update already in its `update` step, or a conversion already switching, is
waited for within its own deadlines rather than cut half-way (so the exit can come later than the grace); a
third signal exits at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from aiohttp import web

from router.core.keys import CONFIG, COORDINATOR, LIFECYCLE, REGISTRY, TRAFFIC
from router.core.lifecycle import ABORTING, CLOSING
from router.core.reabort import abort_until_ended
from router.core.traffic import AbortAction
from router.dataplane.admission import ADMISSION
from router.flows.conversion import CONVERSIONS
from router.flows.fleet_control import FLEET_CONTROL
from router.flows.pauses import PAUSES
from router.server.serving import StopSignals

logger = logging.getLogger(__name__)

ANSWER_WINDOW_MAX_S = 5.0  # the end of the grace kept for aborting what is left and answering it
ANSWER_WINDOW_SHARE = 0.2  # ... or this share of the grace, when that is shorter
# Shares of the answer window W, which ends with the grace: the servers answer the aborts until W/4 is left;
# then the router answers what is left itself until W/8 is left; the rest is for closing (handlers still
# running get W/32 before they are cancelled, twice at most) and for the process's exit.
CUT_SHARE = 0.25
CLOSE_SHARE = 0.125
POLL_S = 0.02


def answer_window(grace_s: float) -> float:
    return min(ANSWER_WINDOW_MAX_S, grace_s * ANSWER_WINDOW_SHARE)


def close_timeout(grace_s: float) -> float:
    """How long closing gives a handler still running before cancelling it (aiohttp may wait twice)."""
    return answer_window(grace_s) * CLOSE_SHARE / 4


class Shutdown:
    """Runs the grace period of one app (see the module's docstring)."""

    def __init__(self, app: web.Application) -> None:
        self.app = app
        self.grace_s = app[CONFIG].shutdown_grace_secs

    def busy(self) -> int:
        """Requests the router still has: admitted or queued, and legs still on a server (a prefill leg that
        finishes after its decode answered included)."""
        admission, registry = self.app[ADMISSION], self.app[REGISTRY]
        return admission.active + admission.waiting + sum(w.inflight for w in registry.workers())

    async def run(self, signals: StopSignals) -> None:
        app = self.app
        lifecycle, admission = app[LIFECYCLE], app[ADMISSION]
        lifecycle.begin_shutdown(signals.first or "shutdown", self.grace_s)
        started, deadline = lifecycle.started, lifecycle.deadline
        window = answer_window(self.grace_s)
        admission.close(lifecycle.refusal())
        logger.info("shutdown: stopped accepting connections, /health answers 503; %d request(s) in flight, "
                    "%d queued; waiting up to %.3g s for them and for running flows", admission.active,
                    admission.waiting, self.grace_s - window)
        flows = asyncio.ensure_future(self._settle_flows())
        try:
            quiet = await _wait_until(lambda: flows.done() and not self.busy(), deadline - window, signals.hurry)
            if quiet:
                logger.info("shutdown: nothing left in flight after %.3f s", time.monotonic() - started)
            else:
                lifecycle.enter(ABORTING)
                await self._abort_what_is_left(deadline - window * CUT_SHARE, deadline - window * CLOSE_SHARE,
                                               signals)
            if not flows.done():
                logger.warning("shutdown: waiting for the flows that must not be cut half-way: %s", self._flows_now())
            await flows
        finally:
            if not flows.done():
                flows.cancel()
            lifecycle.enter(CLOSING)
            logger.info("shutdown: closing connections after %.3f s (%d request(s) still open)",
                        time.monotonic() - started, admission.active)

    # ---- flows -------------------------------------------------------------------------------------
    async def _settle_flows(self) -> None:
        """The running fleet operation ends (a queued one is refused), then a pause the router holds is ended;
        running conversions end."""
        fleet = self.app.get(FLEET_CONTROL)
        conversions = self.app.get(CONVERSIONS)
        if fleet is not None:
            await fleet.wait_current()
            coordinator = self.app.get(COORDINATOR)
            if fleet.paused is not None and coordinator is not None and coordinator.clustered:
                logger.info("shutdown: the fleet stays paused (%s): other router replicas share it",
                            fleet.paused)
            elif fleet.paused is not None:
                logger.info("shutdown: the fleet is paused (%s): ending the pause with continue_generation",
                            fleet.paused)
                try:
                    status, answer = await self.app[PAUSES].release_pause()
                    logger.info("shutdown: continue_generation: %s (%s)", status, answer.get("message", ""))
                except Exception:  # logged; the shutdown goes on
                    logger.exception("shutdown: continue_generation failed")
            if fleet.released_tags:
                logger.warning("shutdown: the servers' memory stays released (%s): resume it through the next "
                               "router (resume_memory_occupation)", ", ".join(sorted(fleet.released_tags)))
        if conversions is not None:
            await conversions.wait_all()

    def _flows_now(self) -> str:
        fleet, conversions = self.app.get(FLEET_CONTROL), self.app.get(CONVERSIONS)
        parts = []
        if fleet is not None and fleet.current is not None:
            parts.append(f"fleet operation {fleet.current.id} {fleet.current.kind} "
                         f"(step {fleet.current.current_step})")
        if conversions is not None:
            parts += [f"conversion {c.id} of {c.worker_url} (step {c.state})" for c in conversions.running()]
        return ", ".join(parts) or "none"

    # ---- the end of the grace ----------------------------------------------------------------------
    async def _abort_what_is_left(self, answered_by: float, cut_by: float, signals: StopSignals) -> None:
        app = self.app
        why = "a second signal" if signals.hurry.is_set() else "the grace period is over"
        # Roll back first, synchronously: a drain or a quiesce that saw its requests aborted would go on.
        conversions, fleet = app.get(CONVERSIONS), app.get(FLEET_CONTROL)
        rolled_back = [f"conversion {c.id} of {c.worker_url}" for c in
                       (conversions.roll_back_unswitched() if conversions is not None else [])]
        op = fleet.roll_back_current() if fleet is not None else None
        if op is not None:
            rolled_back.append(f"fleet operation {op.id} {op.kind}")
        if rolled_back:
            logger.warning("shutdown: %s: rolling back %s (nothing was changed on the servers)", why,
                           ", ".join(rolled_back))
        admission, traffic = app[ADMISSION], app[TRAFFIC]
        queued = admission.waiting
        requests = traffic.mark_all(AbortAction.ANSWER)
        admission.turn_away(app[LIFECYCLE].refusal())
        without_rid = sum(not r.rids for r in requests)
        logger.warning("shutdown: %s: aborting %d request(s) on their servers, turning away %d queued one(s)%s",
                       why, len(requests), queued,
                       f"; {without_rid} without a rid cannot be aborted by id and are cut at close"
                       if without_rid else "")
        if not requests:
            return
        began = time.monotonic()
        pending = await abort_until_ended(lambda: traffic.still_live(requests), traffic.abort, answered_by)
        logger.info("shutdown: %d aborted request(s) answered in %.3f s%s", len(requests) - len(pending),
                    time.monotonic() - began, f", {len(pending)} not answered in time" if pending else "")
        if pending:
            # Their servers did not answer the abort: answer them here rather than reset their connections.
            cut = pending
            traffic.cut(cut, "the router is shutting down and the server did not answer its abort in time")
            pending = await abort_until_ended(lambda: traffic.still_live(cut), None, cut_by)
            logger.warning("shutdown: %d request(s) answered by the router itself (abort answer, or an error "
                           "event mid-stream)%s", len(cut) - len(pending),
                           f", {len(pending)} more as the connections close" if pending else "")


async def _wait_until(condition: Callable[[], bool], deadline: float, hurry: asyncio.Event) -> bool:
    """Poll `condition` until it holds (True), or until `deadline` (monotonic) or `hurry` (False)."""
    while not condition():
        if hurry.is_set() or time.monotonic() >= deadline:
            return condition()
        try:
            async with asyncio.timeout(min(POLL_S, max(deadline - time.monotonic(), 0.0))):
                await hurry.wait()
        except TimeoutError:
            pass
    return True


def wind_down(app: web.Application) -> Callable[[StopSignals], object]:
    """For `serving.run(..., wind_down=...)`."""
    return Shutdown(app).run
