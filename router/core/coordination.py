"""Where the control flows meet the other router replicas of their fleet, and nothing more.

A lone router (no `--etcd-endpoints`) gets `LocalCoordinator`: every call is free and changes nothing, so the
flows behave exactly as they do alone. Replicas sharing a fleet get the etcd implementation
(`router/cluster/coordinator.py`, docs/CLUSTER.md). Both implement `Coordinator`, every role below at once;
only the composition root holds it whole, and each consumer is given the narrowest role that covers
what it asks:

  OperationOwnership   asked by `flows/ownership.py`'s `Owned` only (no flow calls it itself)
    acquire        before an operation changes anything: the right to run it, exclusive across the replicas
                   (one per worker for a conversion or a reinstate, one fleet-wide operation at a time)
    progress       before an irreversible step (a role switch, a weight update): recorded for a replica that
                   takes the operation over, and refused when this replica no longer owns it
    release        the operation's outcome is published and its right to run given back
    wait_lost      until this replica no longer owns a running operation (its lease ended: another replica may
                   take it over); `while_owned` runs an operation's waits under it, so none outlives the lease
  RoutingAgreement     asked by `Owned` only
    stop_routing   after the operation took its servers out of routing (their state, or the fleet's hold):
                   every live replica, this one included, has applied that and, per `action`, marked its own
                   requests on them (`stop_here`: one way of marking, the same at every replica)
    elsewhere      the other replicas' requests still on the servers (`inflight_elsewhere`, read by the one
                   idle wait, `flows/fleet.wait_quiet`, so a drain or a quiesce counts every replica; abort_all
                   waits until there are none: `wait_idle_elsewhere`)
  OperationCoordinator the two above: what a flow that owns operations through `Owned` holds (conversions,
                   abort_all)
  SingletonTurn        `leading` and `fleet_operation_elsewhere`: the singleton loops (the rebalancer, the
                   weight reconciler) run on one replica, the reconciler never under another's fleet operation
  FleetOperations      what fleet control holds: OperationCoordinator, SingletonTurn, and
                   `wait_worker_operations_elsewhere` (no fleet-wide operation under another's conversion)
  FleetMembership      what the worker lifecycle holds: `check_available` (a control call answers 503 while the
                   replicas cannot agree), `publish` (what this replica changed in the registry is shared
                   before a call answers), `remove_worker` (and its record: `removal`, `readmit`)
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Awaitable, Callable, Protocol, Sequence, TypeVar

from router.core.errors import RouterError
from router.core.traffic import AbortAction, LiveRequest, MarkTally, RequestPathControl

if TYPE_CHECKING:
    from router.core.registry import Registry, Worker

T = TypeVar("T")

FLEET = "fleet"  # weight updates, pause/continue, memory release/resume: one at a time, fleet-wide
ABORT = "abort"  # abort_all


def worker_scope(url: str) -> str:
    """The scope of an operation on one server (a conversion, a reinstate)."""
    return f"worker/{url}"


class StopAction(str, enum.Enum):
    """What every replica does, beyond applying the new state, before it confirms a `stop_routing`."""

    ROUTING = "routing"  # nothing more: the servers are out of its routing (their state, or the fleet's hold)
    EPOCH = "epoch"  # bump the servers' abort epochs: their requests aborted next are router-made (retried
    # as the request path's retry_aborted says)
    RETRY = "retry"  # mark its requests on the servers to be re-sent once the fleet is open (and the epochs)
    ANSWER = "answer"  # mark them to be answered with SGLang's abort answer (and the epochs)
    ALL = "all"  # mark every live request of the replica to be answered with its abort (abort_all)
    SHED = "shed"  # mark to be re-sent its requests on the servers that still wait on their prefill, and abort
    # those by rid on both their servers (the rest finish where they are: no epoch is bumped)

    def __str__(self) -> str:
        return self.value


@dataclass(eq=False, slots=True)
class Ticket:
    """One operation's right to run, as the coordinator gave it."""

    op_id: str
    kind: str
    scope: str
    started_at: float = field(default_factory=time.time)
    details: dict = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class StopReport:
    replicas: int = 0  # other replicas that confirmed
    marked: int = 0  # requests marked (to be retried or answered with their abort): this replica's and theirs
    inflight: int = 0  # the other replicas' requests still on the servers when they confirmed
    here: tuple[LiveRequest, ...] = ()  # this replica's requests marked by StopAction.ALL or SHED (to wait for them)
    tally: MarkTally | None = None  # how this replica's requests marked by RETRY or ANSWER end, as they end

    async def wait_all_ended(self, timeout: float) -> None:
        if self.tally is not None:
            await self.tally.wait_all_ended(timeout)

    def ended(self) -> tuple[int, int]:
        """(aborted, finished first) of the requests marked, once they ended: this replica's as counted; the
        other replicas' are not seen from here, so counted as aborted."""
        if self.tally is None:
            return self.marked, 0
        return self.tally.aborted + (self.marked - self.tally.marked), self.tally.finished


def stop_here(registry: Registry, traffic: RequestPathControl, workers: Sequence[Worker] | None,
              action: StopAction, tally: MarkTally | None = None) -> tuple[int, list[LiveRequest]]:
    """What one replica does for a `stop_routing`, the operation's own replica and every other alike, at once
    (nothing of it runs in between): per `action`, mark its requests on `workers` (None: every worker) and
    bump the workers' abort epochs, before any server is asked to abort. Returns how many requests it marked
    (EPOCH: how many it has on them) and, for ALL and SHED, the requests marked (the caller aborts them).
    `tally` counts how the requests RETRY or ANSWER marks end."""
    workers = registry.workers() if workers is None else list(workers)
    if action is StopAction.ALL:
        marked = traffic.mark_all(AbortAction.ANSWER)
        return len(marked), marked
    if action is StopAction.SHED:
        marked = traffic.mark_waiting_on_prefill(workers, AbortAction.RETRY)
        return len(marked), marked
    if action in (StopAction.RETRY, StopAction.ANSWER):
        count = traffic.mark_on(workers, AbortAction(action.value), tally)
        registry.mark_aborted(workers)
        return count, []
    if action is StopAction.EPOCH:
        count = sum(w.inflight for w in workers)
        registry.mark_aborted(workers)
        return count, []
    return 0, []


class OperationOwnership(Protocol):
    """An operation's right to run across the replicas: taken, recorded, given back, watched for its loss.
    Asked by `flows/ownership.py`'s `Owned` (and `while_owned`) only, never by a flow itself."""

    @property
    def clustered(self) -> bool:
        """True when other replicas may share the fleet."""

    async def acquire(self, kind: str, scope: str, details: dict, *, wait_s: float = 0.0) -> Ticket:
        """The right to run an operation of `kind` on `scope` (FLEET, ABORT, worker_scope(url)); waits up to
        wait_s for another replica's operation on it to end. Raises Conflict (another replica runs one) or
        ServiceUnavailable (the replicas cannot agree now: etcd unreachable)."""

    async def progress(self, ticket: Ticket, step: str) -> None:
        """Record that the operation enters `step`; raises ServiceUnavailable when this replica no longer
        owns it (its lease ended: another replica may have taken it over)."""

    async def release(self, ticket: Ticket, outcome: str, message: str = "") -> None:
        """Publish what the operation changed and its outcome; give its scope back. Never raises. An operation
        this replica lost is left as it stands (the replica taking it over ends it)."""

    async def wait_lost(self, ticket: Ticket) -> RouterError:
        """Return (not raise) the error its caller answers with, once this replica stops owning the operation:
        its lease ended or its lock went to another replica. Never returns for a lone router."""


class RoutingAgreement(Protocol):
    """Every replica takes an owned operation's servers out of routing; what the others still have on them.
    Asked by `Owned` only."""

    async def stop_routing(self, ticket: Ticket | None, workers: Sequence[Worker] | None,
                           action: StopAction) -> StopReport:
        """This replica does `action` on `workers` (None: every worker: `stop_here`); then, once every other
        live replica has applied what this one published (a worker's state, the fleet's hold) and done the
        same, the report. Raises ServiceUnavailable when one does not confirm in time. `ticket` None: an
        operation only this replica knows of (nobody else to stop)."""

    def inflight_elsewhere(self, ticket: Ticket, worker: Worker) -> int:
        """The other replicas' requests on `worker`, as they last told (after a stop_routing)."""

    async def wait_idle_elsewhere(self, ticket: Ticket) -> None:
        """Until the other replicas have no request left on the servers of the last stop_routing."""


class OperationCoordinator(OperationOwnership, RoutingAgreement, Protocol):
    """What `Owned` asks: what a flow that owns operations (a conversion, abort_all) holds to give it."""


class SingletonTurn(Protocol):
    """Whether the singleton loops (the rebalancer, the weight reconciler) run here now."""

    @property
    def leading(self) -> bool:
        """Whether this replica runs the singleton loops (the rebalancer, the weight reconciler)."""

    def fleet_operation_elsewhere(self) -> str | None:
        """A fleet-wide operation another replica runs now, described; None when there is none."""


class FleetOperations(OperationCoordinator, SingletonTurn, Protocol):
    """What the fleet-wide operations ask (`flows/fleet_control.py`): their own operations through `Owned`,
    the reconciler's turn, and, before one changes a server, the single-server operations run elsewhere."""

    async def wait_worker_operations_elsewhere(self, timeout: float) -> list[str]:
        """Wait up to timeout for operations on single servers that other replicas run (conversions);
        those still running."""


class FleetMembership(Protocol):
    """Which workers the fleet has: what the worker lifecycle (and the command line's registration) asks."""

    async def check_available(self, what: str) -> None:
        """Raise ServiceUnavailable when a control call cannot be agreed with the other replicas now (asked
        of etcd: a call that changes the fleet answers 503 before it changes anything)."""

    async def publish(self) -> None:
        """Until what this replica changed in the registry is shared (raises ServiceUnavailable)."""

    async def remove_worker(self, worker: Worker, by: str = "") -> None:
        """Remove the worker from the fleet (raises Conflict while an operation runs on it), recording the
        removal (`by`: how, e.g. the API call): a replica's command line does not bring it back."""

    def removal(self, url: str) -> str | None:
        """Why there is no such worker: the cluster removed it (when, by whom, how); None when it did not."""

    async def readmit(self, url: str) -> None:
        """A registration on purpose: the removal's record goes, the worker may be added again."""


class Coordinator(FleetOperations, FleetMembership, Protocol):
    """Every role at once, as `LocalCoordinator` and `EtcdCoordinator` implement them. Only the composition
    root holds it whole; each consumer is given the narrowest role it asks of (`tests/test_layout.py`)."""


class LocalCoordinator:
    """A lone router's: nothing to agree with; `stop_routing` stops this replica only."""

    clustered = False
    leading = True

    def __init__(self, registry: Registry, traffic: RequestPathControl) -> None:
        self.registry = registry
        self.traffic = traffic
        self._ids = itertools.count(1)

    async def acquire(self, kind: str, scope: str, details: dict, *, wait_s: float = 0.0) -> Ticket:
        return Ticket(f"local-{next(self._ids)}", kind, scope, details=details)

    async def progress(self, ticket: Ticket, step: str) -> None:
        return None

    async def release(self, ticket: Ticket, outcome: str, message: str = "") -> None:
        return None

    async def wait_lost(self, ticket: Ticket) -> RouterError:
        await asyncio.Event().wait()  # a lone router owns what it runs until it ends
        raise AssertionError("unreachable")

    async def stop_routing(self, ticket: Ticket | None, workers: Sequence[Worker] | None,
                           action: StopAction) -> StopReport:
        tally = MarkTally()
        marked, here = stop_here(self.registry, self.traffic, workers, action, tally)
        return StopReport(marked=marked, here=tuple(here), tally=tally)

    def inflight_elsewhere(self, ticket: Ticket, worker: Worker) -> int:
        return 0

    async def wait_idle_elsewhere(self, ticket: Ticket) -> None:
        return None

    async def wait_worker_operations_elsewhere(self, timeout: float) -> list[str]:
        return []

    def fleet_operation_elsewhere(self) -> str | None:
        return None

    async def check_available(self, what: str) -> None:
        return None

    async def publish(self) -> None:
        return None

    async def remove_worker(self, worker: Worker, by: str = "") -> None:
        return None

    def removal(self, url: str) -> str | None:
        return None  # a lone router's command line is its whole fleet

    async def readmit(self, url: str) -> None:
        return None


async def while_owned(coordinator: OperationOwnership, ticket: Ticket | None, work: Awaitable[T],
                      on_lost: Callable[[RouterError], None] = lambda error: None) -> T:
    """`work` (an operation's steps), cancelled the moment this replica stops owning `ticket`'s operation; then
    the coordinator's error (503, naming why) is raised, after `on_lost(error)` (told before the cancellation:
    the steps' clean-up can tell a loss from a shutdown). No wait of an operation outlives its owner's lease.
    Calls already sent to servers are the work's to shield (a weight update's): a replica taking the operation
    over reads where they ended."""
    if ticket is None or not coordinator.clustered:
        return await work
    task = asyncio.ensure_future(work)
    lost = asyncio.ensure_future(coordinator.wait_lost(ticket))
    try:
        await asyncio.wait((task, lost), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        lost.cancel()
        await asyncio.gather(task, lost, return_exceptions=True)
        raise
    if task.done():
        lost.cancel()
        return task.result()
    error = lost.result()
    on_lost(error)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise error
