"""Room for a request's two legs: the router's own bound on the connections a burst takes.

A rollout burst sends thousands of requests at once; each on the servers holds two leg connections (two
descriptors). `LegRoom` lets a request reach its pair only while the legs in flight stay within the legs'
descriptor budget (`--max-connections`, capped by the open-files limit: `core/local_resources.py`) and while
both servers of its pair have fewer than `--max-connections-per-worker` of this router's legs (a server runs at
most its own running-request limit anyway; the rest would only wait in its queue, holding a descriptor here).
Beyond either bound the request waits in one FIFO queue, holding no worker and only its client's connection,
until legs end; it is refused (503, Retry-After) only when its own deadline passes (`Proxy.handle`).

Both legs take their room in the same step of the event loop as the pair is chosen (the legs count before the
first await), so a pair is never half-admitted: a prefill leg holding a connection while its decode leg waits
for one could otherwise wait for a KV transfer that its partner, queued behind it, never starts.
"""

from __future__ import annotations

from router.core.registry import Registry, Role, Worker
from router.dataplane.turns import Turns


class LegRoom:
    """At most `total` legs in flight, at most `per_worker` on one server; the rest wait in arrival order."""

    __slots__ = ("per_worker", "total", "registry", "open_legs", "_turns", "waited_total")

    def __init__(self, per_worker: int | None, total: int, registry: Registry) -> None:
        self.per_worker = per_worker or None
        self.total = max(total, 2)
        self.registry = registry
        # legs in flight, lingering prefill legs included: the dispatcher counts a leg up as it opens it, and
        # down (`leg_ended`) as it ends
        self.open_legs = 0
        self._turns = Turns()
        self.waited_total = 0  # requests that waited for room (not the ones that found it at once)

    @property
    def waiting(self) -> int:
        return len(self._turns)

    def with_room(self, workers: tuple[Worker, ...]) -> tuple[Worker, ...]:
        limit = self.per_worker
        if limit is None:
            return workers
        return tuple(w for w in workers if w.inflight < limit)

    def _has_room(self, workers: tuple[Worker, ...]) -> bool:
        limit = self.per_worker
        return not workers or limit is None or any(w.inflight < limit for w in workers)

    def ready(self) -> bool:
        """Room for one more pair now (or no routable worker of a pool: the selection answers that at once)."""
        registry = self.registry
        return (self.open_legs + 2 <= self.total and self._has_room(registry.routable(Role.PREFILL))
                and self._has_room(registry.routable(Role.DECODE)))

    def can_enter_now(self) -> bool:
        return not self._turns and self.ready()

    async def wait(self) -> None:
        """Wait, in arrival order, until there is room for this request's pair. The caller's deadline bounds
        it (cancellation leaves the queue and wakes the next head)."""
        self.waited_total += 1
        await self._turns.wait(self.ready)

    def leg_ended(self) -> None:
        self.open_legs -= 1
        self._turns.wake_head()

    def state(self) -> dict:
        return {"max_connections_per_worker": self.per_worker or 0, "max_legs": self.total,
                "legs_in_flight": self.open_legs, "waiting": self.waiting, "waited_total": self.waited_total}
