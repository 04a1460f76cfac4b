"""Pause and continue the whole fleet (SGLang's `pause_generation`, `continue_generation`), one operation each.

A pause holds new requests until continue (admission closed for `pause_generation`) and, in `abort` mode, marks
and empties the fleet first; a pause in place (`in_place`, `retract`) leaves requests on their servers, whose
answers go silent on purpose (the legs' idle timeout waits). Continue fans out to every server, held ones
included: those that take it rejoin routing (at the fleet's weight version), the others are held out as
`paused`. A server an update during the pause could not flush (its parked requests kept the old weights'
cache) rejoins once its requests are done and the router has flushed it; where its pool has no other server,
continue keeps admission closed until then (step `flush`). At shutdown a pause this router put on the fleet is ended (`release_pause`), unless other router
replicas share the fleet (its pause is theirs too).
"""

from __future__ import annotations

import time

from aiohttp import web

from router.control.upstream import fan_out
from router.core.coordination import StopAction
from router.core.routability import HoldKind
from router.flows.fleet import http_status, summary, wait_quiet
from router.flows.fleet_control import FleetControl
from router.flows.operations import Operation

PAUSE_GATE = "pause_generation"


class Pauses:
    def __init__(self, fleet: FleetControl) -> None:
        self.fleet = fleet

    async def pause(self, body: dict, *, retry: bool) -> tuple[int, dict]:
        mode = body.get("mode", "abort")
        return await self.fleet.operations.run("pause_generation", {"mode": mode, "retry_aborted": retry},
                                               lambda op: self._pause(op, body, mode, retry))

    async def _pause(self, op: Operation, body: dict, mode: str, retry: bool) -> tuple[int, dict]:
        fleet, timeout = self.fleet, self.fleet.config.abort_timeout_secs
        fleet.traffic.close_gate(PAUSE_GATE)  # kept until continue_generation
        op.step("hold").end("ok", "admission closed until continue_generation")
        fleet.paused = mode
        fleet.traffic.expect_silence(PAUSE_GATE)  # paused answers go silent: the legs' idle timeout waits
        workers = fleet.targets()
        # every replica, this one first, marks its requests (abort mode) and tells what it has on the servers
        action = StopAction.ROUTING if mode != "abort" else StopAction.RETRY if retry else StopAction.ANSWER
        stopped = await op.owned.stop_routing(workers, action)
        step = op.step("pause", timeout)
        results = await fleet.sent(fan_out(workers, lambda w: fleet.call(w, "/pause_generation", body, timeout)))
        step.end("ok" if all(o.success for o in results) else "failed", summary(results, "pause_generation"))
        if mode == "abort":  # the servers answered once their requests were gone; so must the router's
            step = op.step("quiesce", timeout)
            quiet = await wait_quiet(fleet.registry, fleet.upstream, workers, time.monotonic() + timeout, abort=True,
                                     elsewhere=op.owned.inflight_elsewhere)
            op.quiesce_s = time.monotonic() - op.started
            await stopped.wait_all_ended(op.started + timeout - time.monotonic())
            op.aborted_requests, op.finished_requests = stopped.ended()
            step.end("ok" if quiet.ok else "timeout", f"busy: {quiet.busy}" if quiet.busy else "")
            paused_requests = 0
        else:  # the router's requests now stalled in the servers (every replica's)
            paused_requests = fleet.traffic.count_on(workers) + stopped.inflight
        op.workers = [o.to_dict() for o in results]
        status = http_status(results)
        message = "Generation paused successfully." if status == 200 else summary(results, "pause_generation")
        return status, {"success": status == 200, "message": message, "status": "ok" if status == 200 else "error",
                        "num_paused_requests": paused_requests, "num_aborted_requests": op.aborted_requests,
                        "num_finished_requests": op.finished_requests,
                        "workers": op.workers}

    async def resume(self, body: dict) -> tuple[int, dict]:
        return await self.fleet.operations.run("continue_generation", {}, lambda op: self._resume(op, body))

    async def _resume(self, op: Operation, body: dict) -> tuple[int, dict]:
        fleet = self.fleet
        results = await fleet.restore(op, "continue", "continue_generation", body, fleet.config.abort_timeout_secs,
                                      HoldKind.PAUSED)
        await self._flush_where_needed(op, fleet.config.abort_timeout_secs)
        for result in results:
            result.extra["routable"] = result.worker.routable
        fleet.paused = None
        fleet.traffic.end_silence(PAUSE_GATE)
        fleet.traffic.open_gate(PAUSE_GATE)
        op.step("release").end("ok", "admission open")
        op.workers = [o.to_dict() for o in results]
        status = http_status(results)
        message = "Generation continued successfully." if status == 200 else summary(results, "continue_generation")
        return status, {"success": status == 200, "message": message, "status": "ok" if status == 200 else "error",
                        "workers": op.workers}

    async def _flush_where_needed(self, op: Operation, timeout: float) -> None:
        """Servers an update during the pause could not flush (requests were parked on them) finish those
        requests now; where a pool has no other routable server, admission stays closed until they are flushed
        and back (within `timeout`), so that new requests wait for them instead of finding the pool empty."""
        registry = self.fleet.registry
        stale = registry.held(HoldKind.CACHE)
        needed = [w for w in stale if not registry.routable(w.role)]
        if not needed:
            return
        step = op.step("flush", timeout)
        left = await self.fleet.held_out.flush_until(needed, time.monotonic() + timeout)
        done = [w.url for w in needed if w not in left]
        step.end("ok" if not left else "timeout",
                 f"flushed and back: {', '.join(done) or 'none'}"
                 + (f"; still not idle: {', '.join(w.url for w in left)} (the reconciler keeps trying)" if left else ""))

    async def release_pause(self) -> tuple[int, dict] | None:
        """Shutdown: a pause the router put on the fleet is ended with continue_generation, so that no server
        stays paused with no router to continue it (None when the fleet is not paused). A replica of a
        cluster leaves the fleet's pause to the replicas that stay (continue it at any of them)."""
        if self.fleet.paused is None or self.fleet.coordinator.clustered:
            return None
        return await self.fleet.operations.run("continue_generation", {"reason": "shutdown"},
                                               lambda op: self._resume(op, {}), shutting_down=True)

PAUSES = web.AppKey("pauses", Pauses)
