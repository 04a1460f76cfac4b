"""Release and resume the fleet's memory (SGLang's `release_memory_occupation`, `resume_memory_occupation`).

A release holds new requests (until every released tag is resumed), empties the fleet (drain, or abort with
`abort_all_requests`) and fans the release out; nothing released, the fleet serves on. A resume fans out to
every server, held ones included: those that take it rejoin routing, the others are held out as `memory`.
"""

from __future__ import annotations

from aiohttp import web

from router.control.upstream import fan_out
from router.core.routability import HoldKind
from router.flows.fleet import summary
from router.flows.fleet_control import FleetControl
from router.flows.operations import Operation

ALL_MEMORY_TAGS = frozenset({"kv_cache", "weights", "cuda_graph"})  # SGLang's GPU_MEMORY_ALL_TYPES
MEMORY_GATE = "release_memory_occupation"


class MemoryOccupation:
    def __init__(self, fleet: FleetControl) -> None:
        self.fleet = fleet

    async def release_memory(self, body: dict, *, abort: bool, retry: bool) -> tuple[int, dict]:
        options = {"tags": body.get("tags"), "abort_all_requests": abort}
        return await self.fleet.operations.run("release_memory_occupation", options,
                                               lambda op: self._release_memory(op, body, abort, retry))

    async def _release_memory(self, op: Operation, body: dict, abort: bool, retry: bool) -> tuple[int, dict]:
        fleet, timeout = self.fleet, self.fleet.config.weight_update_timeout_secs
        held_already = bool(fleet.released_tags)
        async with fleet.gate_closed(op, MEMORY_GATE, keep=True):
            workers = fleet.targets()
            if not await fleet.quiesce(op, workers, abort=abort, retry=retry):
                if not held_already:
                    fleet.traffic.open_gate(MEMORY_GATE)
                return fleet.quiesce_timeout_answer(op, "release_memory_occupation")
            step = op.step("release", timeout)
            results = await fleet.sent(fan_out(workers, lambda w: fleet.call(w, "/release_memory_occupation", body,
                                                                             timeout)))
            step.end("ok" if all(o.success for o in results) else "failed",
                     summary(results, "release_memory_occupation"))
            if any(o.success for o in results):
                fleet.released_tags |= set(body.get("tags") or ALL_MEMORY_TAGS)
            elif not held_already:
                fleet.traffic.open_gate(MEMORY_GATE)  # nothing was released: serve on
        return fleet.aggregate(op, results, "release_memory_occupation", memory_released=sorted(fleet.released_tags))

    async def resume_memory(self, body: dict) -> tuple[int, dict]:
        return await self.fleet.operations.run("resume_memory_occupation", {"tags": body.get("tags")},
                                               lambda op: self._resume_memory(op, body))

    async def _resume_memory(self, op: Operation, body: dict) -> tuple[int, dict]:
        fleet = self.fleet
        results = await fleet.restore(op, "resume", "resume_memory_occupation", body,
                                      fleet.config.weight_update_timeout_secs, HoldKind.MEMORY)
        tags = body.get("tags")
        fleet.released_tags -= set(tags) if tags else set(fleet.released_tags)
        if not fleet.released_tags:
            fleet.traffic.open_gate(MEMORY_GATE)
            op.step("release").end("ok", "admission open")
        return fleet.aggregate(op, results, "resume_memory_occupation", memory_released=sorted(fleet.released_tags))

MEMORY = web.AppKey("memory", MemoryOccupation)
