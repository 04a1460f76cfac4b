"""`/abort_request` for the fleet: abort one request on the two servers that hold it, or every request on
every server, and answer once the router's aborted requests have ended."""

from __future__ import annotations

import asyncio
import time
from typing import Callable, Sequence

from aiohttp import web

from router.control.upstream import INFO_TIMEOUT, Upstream, fan_out
from router.core.coordination import ABORT, OperationCoordinator, StopAction
from router.core.reabort import abort_until_ended
from router.core.registry import Worker
from router.core.traffic import AbortAction, LiveRequest, RequestPathControl
from router.flows.fleet import WorkerResult, summary
from router.flows.ownership import Owned


class RequestAborts:
    def __init__(self, traffic: RequestPathControl, upstream: Upstream, targets: Callable[[], list[Worker]],
                 timeout_s: float, coordinator: OperationCoordinator) -> None:
        self.traffic = traffic
        # Router replicas of one fleet: an abort of everything is everyone's (each marks and aborts its own).
        self.coordinator = coordinator
        self.upstream = upstream
        self.targets = targets  # the servers an abort of everything (or of an unknown rid) goes to
        self.timeout_s = timeout_s

    async def abort(self, *, rid: str | None, abort_all: bool) -> tuple[int, dict | None]:
        """Abort one request (on the two servers that hold it) or all; return once the router's aborted
        requests have ended (SGLang's own abort returns at once and aborts later). The request path answers
        each with SGLang's abort answer."""
        deadline = time.monotonic() + self.timeout_s
        if abort_all:
            return await self._abort_all(deadline)
        found = self.traffic.mark_rid(rid, AbortAction.ANSWER)
        if found is None:  # not routed by this router now: every server may know it (another replica's)
            results = await fan_out(self.targets(), lambda w: self._abort_call(w, {"rid": rid}))
            aborted = []
        else:
            request, rids = found
            aborted = [request]
            results = await fan_out((request.prefill, request.decode), lambda w: self._abort_rids(w, rids))
        return self._answer(results, await self._wait_ended(aborted, deadline))

    async def _abort_all(self, deadline: float) -> tuple[int, dict | None]:
        """Every request of every router replica of the fleet: each marks its own (answered with their abort)
        before the servers abort everything; the answer comes once they have all ended."""
        async with await Owned.acquire(self.coordinator, "abort_all", ABORT, {}) as owned:
            # its waits end when this replica stops owning it (503 naming why)
            answer = await owned.run(self._abort_everything(owned, deadline))
            owned.ended("succeeded" if answer[0] == 200 else "failed")
            return answer

    async def _abort_everything(self, owned: Owned, deadline: float) -> tuple[int, dict | None]:
        # every replica, this one first, marks all its requests to be answered with their abort
        aborted = list((await owned.stop_routing(None, StopAction.ALL)).here)
        results = await fan_out(self.targets(), lambda w: self._abort_call(w, {"abort_all": True}))
        pending = await self._wait_ended(aborted, deadline)
        left_elsewhere = 0
        try:
            async with asyncio.timeout(max(deadline - time.monotonic(), 0.0)):
                await owned.wait_idle_elsewhere()
        except TimeoutError:
            left_elsewhere = 1
        return self._answer(results, pending, left_elsewhere)

    def _answer(self, results: list[WorkerResult], pending: list[LiveRequest],
                left_elsewhere: int = 0) -> tuple[int, dict | None]:
        if not all(o.success for o in results):
            return 502, {"success": False, "message": summary(results, "abort_request"),
                         "workers": [o.to_dict() for o in results]}
        if pending or left_elsewhere:
            where = f"{len(pending)} aborted request(s)" if pending else "aborted requests of other router replicas"
            return 504, {"success": False, "message": f"{where} still running after {self.timeout_s:g} s",
                         "workers": [o.to_dict() for o in results]}
        return 200, None  # SGLang's answer: 200, empty body

    async def _abort_call(self, worker: Worker, body: dict) -> WorkerResult:
        reply = await self.upstream.post(worker.url, "/abort_request", body, timeout=INFO_TIMEOUT)
        return WorkerResult.of(worker, reply)

    async def _abort_rids(self, worker: Worker, rids: list[str]) -> WorkerResult:
        results = [await self._abort_call(worker, {"rid": rid}) for rid in rids]
        return next((o for o in results if not o.success), results[0]) if results else \
            WorkerResult(worker, True, 200, "nothing to abort")

    async def _wait_ended(self, requests: list[LiveRequest], deadline: float) -> list[LiveRequest]:
        """Wait for aborted requests to end, aborting again by rid on both servers those still there (a leg can
        reach its server after the abort did); those left at the deadline."""
        async def abort_again(pending: Sequence[LiveRequest]) -> None:
            await asyncio.gather(*(self._abort_rids(w, a.rids) for a in pending if a.rids
                                   for w in (a.prefill, a.decode)))

        return await abort_until_ended(lambda: self.traffic.still_live(requests), abort_again, deadline,
                                       aborted_at=time.monotonic())


ABORTS = web.AppKey("request_aborts", RequestAborts)
