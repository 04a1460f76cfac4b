"""Fleet-wide operations (weight update, pause, continue, memory release/resume): the record of each, with
its steps, and the runner that runs them one at a time, as owned tasks, keeping the last ones."""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from router.core.coordination import FLEET, OperationCoordinator
from router.core.errors import Conflict, RouterError, ServiceUnavailable
from router.flows.ownership import Owned
from router.flows.steps import Step

logger = logging.getLogger(__name__)

HISTORY_SIZE = 50


@dataclass(slots=True)
class Operation:
    """One fleet-wide operation (update, pause, continue, memory release/resume): its visible state."""

    id: str
    kind: str
    options: dict
    started_at: float = field(default_factory=time.time)
    started: float = field(default_factory=time.monotonic)
    state: str = "running"  # running | succeeded | failed
    steps: list[Step] = field(default_factory=list)
    status: int = 0
    message: str = ""
    hold_s: float | None = None  # how long new requests were held
    quiesce_s: float | None = None  # from the call to a quiet fleet
    # of the router's requests on the servers when it began (marked before their servers were aborted): those
    # the abort ended, and those that finished first, as counted once the fleet was quiet
    aborted_requests: int = 0
    finished_requests: int = 0
    held_requests: int = 0
    weight_version: str | None = None
    workers: list[dict] = field(default_factory=list)
    duration_s: float | None = None
    owned: Owned | None = None  # its right to run, given by the coordinator (fleet-wide across replicas)
    lost: str | None = None  # why this replica stopped owning it mid-way (its lease ended), if it did
    # The step from which servers may have changed (a weight update's `update`): before it, the operation can be
    # rolled back at shutdown; from it on, a replica that loses it leaves the fleet's hold for its taker-over.
    changes_at: str | None = None

    def reached(self, name: str) -> bool:
        """Whether the operation got to its step `name` (e.g. `update`: servers may have changed)."""
        return any(step.name == name for step in self.steps)

    @property
    def changed_servers(self) -> bool:
        """It reached the step from which servers may have changed."""
        return self.changes_at is not None and self.reached(self.changes_at)

    def step(self, name: str, deadline_s: float | None = None) -> Step:
        step = Step(name, deadline_s)
        self.steps.append(step)
        return step

    @property
    def current_step(self) -> str | None:
        running = [s.name for s in self.steps if s.running]
        return running[-1] if running else None

    def finish(self, status: int, message: str) -> None:
        self.status = status
        self.message = message
        self.state = "succeeded" if status == 200 else "failed"
        self.duration_s = time.monotonic() - self.started
        for step in self.steps:
            if step.running:
                step.end("failed", "interrupted")

    def to_dict(self) -> dict:
        return {"id": self.id, "kind": self.kind, "state": self.state, "step": self.current_step,
                "options": self.options, "started_at": self.started_at, "duration_s": _round(self.duration_s),
                "status": self.status, "message": self.message, "hold_s": _round(self.hold_s),
                "quiesce_s": _round(self.quiesce_s), "aborted_requests": self.aborted_requests,
                "finished_requests": self.finished_requests,
                "held_requests": self.held_requests, "weight_version": self.weight_version,
                "steps": [s.to_dict() for s in self.steps], "workers": self.workers,
                "cluster_op": self.owned.op_id if self.owned is not None else None}


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


Body = Callable[[Operation], Awaitable[tuple[int, dict]]]  # runs the operation: (HTTP status, answer)


async def _answered(run: Awaitable[tuple[int, dict]]) -> tuple[int, dict] | RouterError:
    """An operation's outcome as its owned task's result: a refusal (409, 503) is the caller's answer (logged
    once, where it is answered), not a background task that failed."""
    try:
        return await run
    except RouterError as error:
        return error


class OperationRunner:
    """One operation at a time (on every router replica of the fleet: the coordinator's); a caller waits for
    its turn up to `timeout_s`, then gets 409."""

    def __init__(self, timeout_s: float, spawn: Callable[[Awaitable], asyncio.Task],
                 coordinator: OperationCoordinator, *, refusing: Callable[[], str | None] = lambda: None,
                 observers: list[Callable[["Operation"], None]] | None = None) -> None:
        """`refusing`: why no new operation may start now (the router shuts down), or None; `observers`: told
        of every finished operation (metrics)."""
        self.timeout_s = timeout_s
        self.spawn = spawn
        self.coordinator = coordinator
        self.current: Operation | None = None
        self.history: collections.deque[Operation] = collections.deque(maxlen=HISTORY_SIZE)
        self.observers = observers if observers is not None else []
        # Held while an operation runs; whatever must not change the fleet under one (the reconciler) takes it.
        self.lock = asyncio.Lock()
        self._ids = itertools.count(1)
        self.refusing = refusing
        self._task: asyncio.Task | None = None  # the running operation's task
        self._rolling_back = False

    def find(self, op_id: str) -> Operation | None:
        if self.current is not None and self.current.id == op_id:
            return self.current
        return next((op for op in self.history if op.id == op_id), None)

    async def run(self, kind: str, options: dict, body: Body, *, shutting_down: bool = False,
                  changes_at: str | None = None) -> tuple[int, dict]:
        """Run an operation as an owned task: a client that disconnects does not cancel a fleet update
        half-way. `shutting_down`: the shutdown's own operation, which runs while others are refused.
        `changes_at`: its step from which servers may have changed (`Operation.changes_at`)."""
        outcome = await asyncio.shield(self.spawn(_answered(self._run(kind, options, body, shutting_down,
                                                                      changes_at))))
        if isinstance(outcome, RouterError):
            raise outcome
        return outcome

    # ---- shutdown ------------------------------------------------------------------------------------
    async def wait_current(self) -> None:
        """Until no operation runs (one waiting for its turn is refused once shutdown began)."""
        while (task := self._task) is not None and not task.done():
            await asyncio.wait((task,))

    def roll_back(self) -> Operation | None:
        """Cancel the running operation (the caller knows nothing changed on the servers yet); its caller
        gets 503 saying it was rolled back. Returns it, or None when none runs."""
        op, task = self.current, self._task
        if op is None or task is None or task.done():
            return None
        self._rolling_back = True
        task.cancel()
        return op

    def _refuse_while_shutting_down(self, shutting_down: bool) -> None:
        if not shutting_down and (refusal := self.refusing()) is not None:
            raise ServiceUnavailable(f"{refusal}: no fleet operation starts now")

    async def _run(self, kind: str, options: dict, body: Body, shutting_down: bool,
                   changes_at: str | None) -> tuple[int, dict]:
        self._refuse_while_shutting_down(shutting_down)
        op = Operation(f"op{next(self._ids)}", kind, options, changes_at=changes_at)
        try:
            async with asyncio.timeout(self.timeout_s):
                await self.lock.acquire()
        except TimeoutError:
            busy = self.current.to_dict() if self.current else None
            raise Conflict(f"another fleet operation is still running after {self.timeout_s:g} s",
                           current=busy) from None
        try:
            self._refuse_while_shutting_down(shutting_down)  # it waited for its turn: check again
            op.owned = await Owned.acquire(self.coordinator, kind, FLEET, {"options": options, "local_id": op.id},
                                           wait_s=max(op.started + self.timeout_s - time.monotonic(), 0))
        except BaseException:
            self.lock.release()
            raise
        self.current = op
        self._task = asyncio.current_task()
        status, answer = 500, {}

        def lost(error: RouterError) -> None:
            op.lost = error.message

        try:
            # every wait of the operation ends when this replica stops owning it (503 naming why)
            status, answer = await op.owned.run(body(op), lost)
            return status, answer
        except asyncio.CancelledError:
            if not self._rolling_back:
                raise
            # Cancelled by the shutdown before any server changed: the caller gets an answer that says so.
            message = f"{self.refusing() or 'the router is shutting down'}: {kind} rolled back, nothing was changed"
            status, answer = 503, {"success": False, "message": message}
            raise ServiceUnavailable(message) from None
        except RouterError as error:
            status, answer = error.status, {"success": False, "message": error.message}
            raise
        except Exception as exc:  # recorded, then the error middleware answers 500
            status, answer = 500, {"success": False, "message": f"{type(exc).__name__}: {exc}"}
            logger.exception("fleet operation %s (%s) failed", op.id, kind)
            raise
        finally:
            op.finish(status, str(answer.get("message", "")))
            # what it changed is shared before its caller hears the answer (shielded: a shutdown waits for it)
            await op.owned.release(op.state, op.message)
            self.current = None
            self._task = None
            self._rolling_back = False
            self.history.append(op)
            for observe in self.observers:
                observe(op)
            self.lock.release()
            logger.info("fleet operation %s %s: %s in %.3f s (%s)", op.id, kind, op.state, op.duration_s,
                        op.message[:300])
