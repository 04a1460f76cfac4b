"""A watch of a key or prefix through etcd's JSON gateway, as an async iterator that survives disconnects.

The gateway streams one JSON object per line (`{"result": {...}}`). The watch remembers the revision after
the last event it delivered and, when the stream breaks (etcd restarted, endpoint gone, member lost its
leader), opens a new one from there on the next endpoint: no event is lost or delivered twice. When that
revision was compacted away, iteration raises EtcdCompacted and the watch ends: the owner reloads the prefix
(`get_prefix`, which returns its revision) and watches again from the revision after it.

An idle stream is checked every probe_interval seconds with the endpoint's /health, so a member that went
silent (no FIN: a partition, a stopped host) is left after one probe instead of never.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections import deque
from typing import Protocol

import aiohttp
import orjson

from router.cluster.etcd_types import EtcdCompacted, WatchEvent, b64, header_revision

logger = logging.getLogger(__name__)

# gRPC metadata through the gateway: etcd cancels this watch when its member loses the leader, so a watch on
# a member cut off from the cluster moves to another one instead of waiting there for events that never come
REQUIRE_LEADER = {"Grpc-Metadata-hasleader": "true", "Content-Type": "application/json"}


class WatchCalls(Protocol):
    """What a watch asks of its client (`EtcdClient`, which builds watches: a protocol, not an import)."""

    session: aiohttp.ClientSession
    timeout: float
    connect_timeout: float

    def endpoint_order(self) -> list[str]: ...
    def prefer(self, endpoint: str) -> None: ...
    async def healthy(self, endpoint: str, *, timeout: float) -> bool: ...
    def forget(self, owned: object) -> None: ...


class _StreamEnded(Exception):
    """The current stream is unusable: reconnect."""


class Watch:
    def __init__(self, client: WatchCalls, key: bytes, range_end: bytes | None, *, start_revision: int = 0,
                 probe_interval: float = 5.0, backoff: tuple[float, float] = (0.05, 1.0)):
        self.client = client
        self.key = key
        self.range_end = range_end
        self.next_revision = start_revision  # 0 until known: the stream starts at etcd's current revision
        self.probe_interval = probe_interval
        self.backoff = backoff
        self.connected = False
        self.reconnects = 0  # streams opened after the first
        self.endpoint: str | None = None
        self._response: aiohttp.ClientResponse | None = None
        self._buffer = bytearray()
        self._pending: deque[WatchEvent] = deque()
        self._opened = 0
        self._closed = False

    def __aiter__(self) -> Watch:
        return self

    async def __anext__(self) -> WatchEvent:
        while not self._pending:
            if self._closed:
                raise StopAsyncIteration
            if self._response is None:
                await self._open()
                continue
            try:
                self._take(await self._next_message())
            except EtcdCompacted:
                await self.close()
                raise
            except _StreamEnded as exc:
                logger.info("etcd watch of %r from revision %s on %s ended (%s): reconnecting", self.key,
                            self.next_revision, self.endpoint, exc)
                self._drop_stream()
        return self._pending.popleft()

    def ready(self) -> list[WatchEvent]:
        """The events already received and not yet returned, taken now (no wait). etcd sends a revision's
        events in one answer, so after an event this completes its transaction: a caller can apply a
        transaction's keys together."""
        events = list(self._pending)
        self._pending.clear()
        return events

    async def __aenter__(self) -> Watch:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        self._closed = True
        self._drop_stream()
        self._pending.clear()
        self.client.forget(self)

    async def aclose(self) -> None:
        await self.close()

    def _drop_stream(self) -> None:
        if self._response is not None:
            self._response.close()
        self._response = None
        self._buffer.clear()
        self.connected = False

    async def _open(self) -> None:
        """Open a stream on the first endpoint that takes it, backing off between rounds; then wait for
        etcd's "created" answer (or its report that the revision was compacted)."""
        delay = self.backoff[0]
        while not self._closed:
            for endpoint in self.client.endpoint_order():
                try:
                    await self._open_on(endpoint)
                    return
                except EtcdCompacted:
                    await self.close()
                    raise
                except _StreamEnded as exc:
                    logger.debug("etcd watch: %s refused the stream (%s)", endpoint, exc)
                    self._drop_stream()
            # a retry cadence, not a wait for a condition: every endpoint failed, try them again soon
            await asyncio.sleep(delay * random.uniform(0.8, 1.2))
            delay = min(delay * 2, self.backoff[1])

    async def _open_on(self, endpoint: str) -> None:
        create = {"key": b64(self.key)}
        if self.range_end is not None:
            create["range_end"] = b64(self.range_end)
        if self.next_revision:
            create["start_revision"] = str(self.next_revision)
        body = orjson.dumps({"create_request": create})
        limits = aiohttp.ClientTimeout(total=None, sock_connect=self.client.connect_timeout, sock_read=None)
        try:
            async with asyncio.timeout(self.client.timeout):
                self._response = await self.client.session.post(endpoint + "/v3/watch", data=body,
                                                                headers=REQUIRE_LEADER, timeout=limits)
                self.endpoint = endpoint
                if self._response.status != 200:
                    raise _StreamEnded(f"HTTP {self._response.status}")
                created = await self._next_message()
            if not created.get("created"):
                self._take(created)  # a compaction or a cancel says so; anything else is not a watch
                raise _StreamEnded(f"no 'created' answer: {created}")
        except (aiohttp.ClientError, TimeoutError) as exc:
            self._drop_stream()
            raise _StreamEnded(repr(exc)) from exc
        except BaseException:  # cancelled half-way: the next try starts from a clean slate
            self._drop_stream()
            raise
        if not self.next_revision:
            self.next_revision = header_revision(created) + 1
        self.client.prefer(endpoint)
        self.connected = True
        if self._opened:
            self.reconnects += 1
        self._opened += 1

    async def _next_message(self) -> dict:
        """The next result object of the stream; an idle stream is probed every probe_interval."""
        response = self._response
        while True:
            line_end = self._buffer.find(b"\n")
            if line_end >= 0:
                line = bytes(self._buffer[:line_end])
                del self._buffer[:line_end + 1]
                if not line.strip():
                    continue
                message = orjson.loads(line)
                if "error" in message:
                    error = message["error"]
                    raise _StreamEnded(str(error.get("message") if isinstance(error, dict) else error))
                return message.get("result", message)
            try:
                # readany() gives up nothing when cancelled, so a timeout here loses no byte of the stream. Not
                # asyncio.wait_for: on 3.11 it returns the result when a cancellation comes as the bytes do,
                # swallowing the cancellation (the replica's shutdown then waited for ever on this task).
                async with asyncio.timeout(self.probe_interval):
                    chunk = await response.content.readany()
            except TimeoutError:
                if not await self.client.healthy(self.endpoint, timeout=min(2.0, self.probe_interval)):
                    raise _StreamEnded("the endpoint failed its health probe") from None
                continue
            except aiohttp.ClientError as exc:
                raise _StreamEnded(repr(exc)) from exc
            if not chunk:
                raise _StreamEnded("the stream closed")
            self._buffer += chunk

    def _take(self, result: dict) -> None:
        """Queue the events of one answer that are new; act on a cancel."""
        if result.get("canceled"):
            compact_revision = int(result.get("compact_revision", 0))
            if compact_revision:
                raise EtcdCompacted(f"watch of {self.key!r} from revision {self.next_revision}: history before "
                                    f"{compact_revision} was compacted", compact_revision)
            raise _StreamEnded(f"etcd cancelled the watch: {result.get('cancel_reason', 'no reason given')}")
        last = 0
        for raw in result.get("events", ()):
            event = WatchEvent.from_json(raw)
            if event.mod_revision >= self.next_revision:
                self._pending.append(event)
                last = max(last, event.mod_revision)
        if last:
            self.next_revision = last + 1
