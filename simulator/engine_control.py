"""The engine's control operations (abort, pause and resume, idleness, the weight version and lock): what
SGLang's control endpoints do to the requests an `Engine` (engine.py) holds."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Awaitable, Callable

from .requests import ABORTED, RETRACTED, WAITING, Req


class EngineControl:
    """Mixed into `Engine`: every attribute used here is the engine's."""

    def abort(self, rid: str = "", abort_all: bool = False) -> int:
        """SGLang 0.5.23 semantics: an exact rid must be live, then every rid with that prefix goes."""
        self.counters.abort_requests += 1
        if abort_all:
            self.counters.abort_all_requests += 1
        elif not rid or rid not in self.requests:
            return 0
        matched = 0
        for req in list(self.requests.values()):
            if req.dispatched and (abort_all or req.rid.startswith(rid)):
                if not req.done:
                    req.abort(self._abort_reason(req))
                    matched += 1
        self.counters.aborts_matched += matched
        return matched

    def _abort_reason(self, req: Req) -> dict:
        if req.phase == WAITING and self.role == "null":
            return {"type": "abort", "message": "Abort in waiting queue"}
        return dict(ABORTED)

    def abort_on_disconnect(self, reqs: list[Req]) -> None:
        self.counters.client_disconnects += 1
        for req in reqs:
            if not req.done:
                req.abort(dict(ABORTED))

    async def pause(self, mode: str) -> None:
        self.is_pause = True
        self._unpaused.clear()
        if mode == "abort":
            while True:
                self.abort(abort_all=True)
                if not self.lock.locked:
                    return
                await self._wait_idle_or(1.0)
        else:
            self.pause_mode = mode
            self._scheduler_resumed.clear()
            for req in list(self.requests.values()):
                req.poke()

    async def _wait_idle_or(self, timeout: float) -> None:
        try:
            async with asyncio.timeout(timeout):
                await self._idle.wait()
        except TimeoutError:
            pass

    def resume(self) -> None:
        self.is_pause = False
        self.pause_mode = None
        self._unpaused.set()
        self._scheduler_resumed.set()
        for req in list(self.requests.values()):
            req.poke()
        for batch in self.batches:
            batch.wake()
        self._wake_waiting()

    def is_fully_idle(self, *, ignore_waiting: bool = False) -> bool:
        """SGLang's ``Scheduler.is_fully_idle``: nothing running, queued, or held for a deferred release."""
        if time.monotonic() < self.deferred_release_until:
            return False
        for req in self.requests.values():
            if not req.dispatched:
                continue
            if req.phase == RETRACTED and ignore_waiting:
                continue
            if req.phase == WAITING and ignore_waiting and not req.kv_tokens:
                continue
            return False
        return True

    def set_weight_version(self, version: str | None) -> None:
        """The scheduler records a new version: running items get a new span from here on."""
        if version is None or version == self.weight_version:
            return
        self.weight_version = version
        for req in self.requests.values():
            if not req.dispatched:
                continue  # not in the scheduler yet: it starts with the new version
            at = len(req.output_ids)
            if req.spans and req.spans[-1][1] == at:
                req.spans[-1][0] = version
            else:
                req.spans.append([version, at])

    async def write_locked(self, fn: Callable[[], Awaitable[Any]], *, paused: bool) -> Any:
        """Run ``fn`` holding the weight lock (SGLang waits for in-flight calls unless paused)."""
        if paused:
            return await fn()
        await self.lock.acquire_write()
        try:
            return await fn()
        finally:
            self.lock.release_write()
