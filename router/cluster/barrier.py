"""This replica's side of an operation's barrier: stop, mark, count, and say so.

An operation that took servers out of routing (their state, or the fleet's hold) writes a barrier into its
record: `{"seq", "action", "workers"}`. Every other replica, having applied everything before it (the watch
is in revision order), does the action on its own requests (`StopAction`: bump the servers' abort epochs,
mark its requests to be retried or answered with their abort, or mark every request for an abort_all, which
it then aborts by rid itself, again while they run: `abort_until_ended`), and writes its ack,
`acks/<op-id>/<replica-id>` on its lease, with how many requests it marked and still has on those servers;
once it has none left it writes the ack again with 0. A replica that joins while a barrier stands answers it
from its first read of the keys.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Awaitable, Callable

from router.cluster.etcd import EtcdClient
from router.cluster.etcd_types import EtcdError
from router.cluster.etcd_keys import ClusterKeys, decode, encode
from router.cluster.mirror import Change
from router.cluster.replica import Membership
from router.core.coordination import StopAction, stop_here
from router.core.reabort import abort_until_ended, wake_when_router_idle
from router.core.registry import Registry, Worker
from router.core.traffic import LiveRequest, RequestPathControl

logger = logging.getLogger(__name__)

RETRY_S = 0.2


class BarrierResponder:
    def __init__(self, client: EtcdClient, keys: ClusterKeys, registry: Registry, traffic: RequestPathControl,
                 membership: Membership, spawn: Callable[[Awaitable], asyncio.Task]) -> None:
        self.client = client
        self.keys = keys
        self.registry = registry
        self.traffic = traffic
        self.membership = membership
        self.spawn = spawn
        self._answered: dict[str, int] = {}  # op id -> the barrier seq answered
        self._acks: dict[str, bytes] = {}  # op id -> the last ack written (on a lease that may be gone)
        self._tasks: dict[str, asyncio.Task] = {}
        self.answers = 0

    def on_changes(self, changes: list[Change]) -> None:
        me = self.membership.identity.id
        for change in changes:
            kind, op_id = self.keys.kind_of(change.key)
            if kind != "op":
                continue
            record = decode(change.new.value) if change.new is not None else None
            if record is None or record.get("state") != "running" or record.get("owner") == me:
                self._forget(op_id)
                continue
            barrier = record.get("barrier")
            if not isinstance(barrier, dict) or not isinstance(barrier.get("seq"), int):
                continue
            if barrier["seq"] <= self._answered.get(op_id, 0):
                continue
            self._answered[op_id] = barrier["seq"]
            self._answer(op_id, barrier)

    def _forget(self, op_id: str) -> None:
        self._answered.pop(op_id, None)
        self._acks.pop(op_id, None)
        task = self._tasks.pop(op_id, None)
        if task is not None:
            task.cancel()

    def _answer(self, op_id: str, barrier: dict) -> None:
        """Do the action now (synchronously: nothing of this replica runs in between), then report."""
        try:
            action = StopAction(barrier.get("action"))
        except ValueError:
            action = StopAction.ROUTING
        urls = barrier.get("workers")
        workers = self.registry.workers() if urls is None else \
            [w for w in (self.registry.find(url) for url in urls) if w is not None]
        count, marked = stop_here(self.registry, self.traffic, workers, action)  # as the owner did its own
        self.answers += 1
        logger.debug("cluster: barrier %s of %s (%s on %d server(s)): %d request(s) marked", barrier["seq"], op_id,
                     action, len(workers), count)
        previous = self._tasks.pop(op_id, None)
        if previous is not None:
            previous.cancel()
        self._tasks[op_id] = self.spawn(self._report(op_id, barrier["seq"], workers, count, marked))

    async def _report(self, op_id: str, seq: int, workers: list[Worker], count: int,
                      marked: list[LiveRequest]) -> None:
        try:
            if marked:
                self.traffic.abort(marked)
            await self._ack(op_id, seq, count, self._counts(workers, marked))

            def abort_marked_again(_: object) -> None:  # the counts are waited on; only the marked aborted
                self.traffic.abort(self.traffic.still_live(marked))

            # until this replica has nothing left on them; the operation's end cancels it (`_forget`)
            await abort_until_ended(lambda: list(self._counts(workers, marked).items()),
                                    abort_marked_again if marked else None, math.inf,
                                    aborted_at=time.monotonic(),
                                    wait=lambda _, seconds: wake_when_router_idle(self.registry, workers, seconds))
            await self._ack(op_id, seq, count, {})
        finally:
            if self._tasks.get(op_id) is asyncio.current_task():
                del self._tasks[op_id]

    def _counts(self, workers: list[Worker], marked: list[LiveRequest]) -> dict[str, int]:
        """What this replica still has: its requests on the servers, by URL (and marked requests not ended)."""
        counts = {w.url: w.inflight for w in workers if w.inflight}
        if marked:
            left = len(self.traffic.still_live(marked))
            if left:
                counts["*"] = left
        return counts

    async def _ack(self, op_id: str, seq: int, marked: int, counts: dict[str, int]) -> None:
        key = self.keys.ack(op_id, self.membership.identity.id)
        value = encode({"seq": seq, "marked": marked, "inflight": sum(counts.values()), "counts": counts,
                        "at": round(time.time(), 3)})
        self._acks[op_id] = value
        while True:
            lease = self.membership.lease_id
            if lease:
                try:
                    await self.client.put(key, value, lease=lease)
                    return
                except EtcdError as exc:
                    logger.debug("cluster: ack of %s failed (%s); retrying", op_id, exc)
            # a retry cadence, not a wait for a condition: etcd (or this replica's lease) is not back yet
            await asyncio.sleep(RETRY_S)

    async def rejoined(self) -> None:
        """This replica joined again with a new lease: its acks went with the old one; the owners of the
        barriers still standing would wait for them, so they are written again."""
        lease = self.membership.lease_id
        for op_id, value in list(self._acks.items()):
            try:
                await self.client.put(self.keys.ack(op_id, self.membership.identity.id), value, lease=lease)
            except EtcdError as exc:
                logger.debug("cluster: ack of %s not written again (%s)", op_id, exc)

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
