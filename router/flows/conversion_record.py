"""What an operator asks of a live P/D role conversion (`Plan`) and the record the flow keeps of it
(`Conversion`, with its steps), with how the worker is emptied (`DrainMode`) and how a conversion ended
(`ConversionOutcome`); `ConversionBook`: which run now, on which worker, with which task, and the last ones."""

from __future__ import annotations

import asyncio
import collections
import enum
import time
from dataclasses import dataclass, field

from router.core.registry import Role
from router.flows.steps import Step


class DrainMode(str, enum.Enum):
    DRAIN = "drain"  # stop routing; wait for in-flight requests to finish
    ABORT = "abort"  # stop routing; abort everything on the worker; wait until it is idle
    # stop routing; re-send elsewhere the requests that still wait on their prefill (their clients have seen
    # nothing), let the rest finish: a decode moved to a backlogged prefill pool need not wait on that backlog
    SHED = "shed"

    def __str__(self) -> str:
        return self.value


class ConversionOutcome(str, enum.Enum):
    CONVERTED = "converted"  # active in the new pool
    RESTORED = "restored"  # failed safely: active again in the old pool
    FAILED = "failed"  # left unsafe: worker state `failed`
    REFUSED = "refused"  # never started (busy, last routable worker of its pool, not active)
    CANCELLED = "cancelled"  # the router shut down mid-flow

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class Plan:
    """What an operator asked for (validated by the API layer)."""

    mode: DrainMode = DrainMode.DRAIN
    new_role: Role | None = None  # None: the opposite of the worker's role
    empty_timeout_s: float | None = None  # drain/abort deadline; None: the router's drain_timeout_secs
    switch_timeout_s: float | None = None  # None: the router's switch_timeout_secs
    verify_timeout_s: float | None = None
    server_options: dict = field(default_factory=dict)  # known options (SERVER_OPTIONS), routed by API
    raw_server_options: dict = field(default_factory=dict)  # sent verbatim to whichever API the server has
    # The server API to try first: the router's /convert_pd_role asks for the server's own /convert_pd_role
    # (which takes the design's options) where it exists; None: the API learnt from the server.
    api: str | None = None


@dataclass(eq=False, slots=True)
class Conversion:
    id: str
    worker_id: str
    worker_url: str
    old_role: Role
    new_role: Role
    mode: DrainMode
    started_at: float = field(default_factory=time.time)
    t0: float = field(default_factory=time.monotonic)
    state: str = "starting"  # the step running now, or "done"
    outcome: ConversionOutcome | None = None
    message: str = ""
    status: int = 0  # the HTTP status that reports the outcome
    api: str | None = None
    bootstrap_port: int | None = None
    server_switch_s: float | None = None  # the answering switch call, timed by the router
    duration_s: float | None = None
    notes: list[str] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    # Set once the flow is over: its outcome is recorded and shared with the other router replicas.
    settled: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def running(self) -> bool:
        return self.outcome is None

    @property
    def success(self) -> bool:
        return self.outcome is ConversionOutcome.CONVERTED

    def step_time(self, *names: str) -> float:
        return sum(s.duration_s or 0.0 for s in self.steps if s.name in names)

    def finish(self, outcome: ConversionOutcome, message: str, status: int) -> None:
        self.outcome, self.message, self.status = outcome, message, status
        self.state = "done"
        self.duration_s = time.monotonic() - self.t0
        self.done.set()

    async def wait(self) -> "Conversion":
        await self.settled.wait()
        return self

    def to_dict(self) -> dict:
        empty_s = self.step_time("drain", "abort")
        overhead = None
        if self.duration_s is not None:
            overhead = max(self.duration_s - empty_s - (self.server_switch_s or 0.0), 0.0)
        return {
            "id": self.id, "worker_id": self.worker_id, "worker_url": self.worker_url,
            "old_role": self.old_role.value, "new_role": self.new_role.value, "mode": self.mode.value,
            "state": self.state, "outcome": None if self.outcome is None else self.outcome.value,
            "success": self.success, "message": self.message, "status": self.status, "api": self.api,
            "bootstrap_port": self.bootstrap_port, "started_at": self.started_at,
            "duration_s": None if self.duration_s is None else round(self.duration_s, 6),
            # where the time went: emptying the worker, the server's own switch, and the rest (router-side)
            "empty_s": round(empty_s, 6),
            "server_switch_s": None if self.server_switch_s is None else round(self.server_switch_s, 6),
            "overhead_s": None if overhead is None else round(overhead, 6),
            "notes": list(self.notes),
            "steps": [{"step": s.name, **s.to_dict()} for s in self.steps],  # "step": the API's first key
        }


class ConversionBook:
    """The conversions running (one per worker, with the task that runs each) and the last `size` of them, newest
    last; a running one is never forgotten (the bound is soft)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._running: dict[str, Conversion] = {}  # by worker id
        self._tasks: dict[str, asyncio.Task] = {}  # by conversion id
        self._history: collections.OrderedDict[str, Conversion] = collections.OrderedDict()

    def running(self) -> list[Conversion]:
        return list(self._running.values())

    def history(self) -> list[Conversion]:
        """Newest first, running ones included."""
        return list(reversed(self._history.values()))

    def get(self, conversion_id: str) -> Conversion | None:
        return self._history.get(conversion_id)

    def of_worker(self, worker_id: str) -> Conversion | None:
        return self._running.get(worker_id)

    def task_of(self, conversion: Conversion) -> asyncio.Task | None:
        return self._tasks.get(conversion.id)

    def tasks(self) -> list[asyncio.Task]:
        return list(self._tasks.values())

    def started(self, conversion: Conversion) -> None:
        self._running[conversion.worker_id] = conversion
        self.remember(conversion)

    def runs_in(self, conversion: Conversion, task: asyncio.Task) -> None:
        self._tasks[conversion.id] = task
        task.add_done_callback(lambda _t, cid=conversion.id: self._tasks.pop(cid, None))

    def ended(self, conversion: Conversion) -> None:
        if self._running.get(conversion.worker_id) is conversion:
            del self._running[conversion.worker_id]

    def remember(self, conversion: Conversion) -> None:
        self._history[conversion.id] = conversion
        while len(self._history) > self.size:
            oldest_id = next(iter(self._history))
            if self._history[oldest_id].running:
                break
            self._history.pop(oldest_id)
