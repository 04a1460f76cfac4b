"""The chaos soak's clients (tests/cluster/chaos.py): requests sent back to back to the router replicas, each
answer kept with the weight versions its tokens came from; a client follows its replica's `target`, so a
replica about to be killed can be left first, as a balancer would."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

import aiohttp
import orjson

BODY = {"text": "the quick brown fox", "sampling_params": {"max_new_tokens": 24, "temperature": 0}}
# every LONG_EVERY-th request of a client decodes for seconds: drains and quiesces wait for it, so an etcd
# outage can outlast an operation's lease while it waits
LONG = {**BODY, "sampling_params": {"max_new_tokens": 600, "temperature": 0}}
LONG_EVERY = 8


@dataclass
class Answer:
    client: int
    replica: int
    stream: bool
    status: int
    finish: str
    versions: list[str]  # the weight versions its tokens came from
    sent: float
    ended: float


class Clients:
    """`per_replica` clients per replica sending requests back to back (every other one streaming); a client
    follows `target`, so a replica about to be killed can be left first."""

    def __init__(self, urls: list[str], per_replica: int) -> None:
        self.urls = urls
        self.target = [r for r in range(len(urls)) for _ in range(per_replica)]
        self.answers: list[Answer] = []
        self.inflight: dict[int, int] = {}  # client -> the replica its request went to
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120))

    def start(self) -> None:
        self._tasks = [asyncio.ensure_future(self._client(i)) for i in range(len(self.target))]

    async def _client(self, index: int) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            replica = self.target[index]
            self.inflight[index] = replica
            try:
                body = LONG if n % LONG_EVERY == index % LONG_EVERY else BODY
                self.answers.append(await self._one(index, replica, body, stream=(index + n) % 2 == 0))
            finally:
                del self.inflight[index]

    async def _one(self, index: int, replica: int, body: dict, stream: bool) -> Answer:
        sent = time.monotonic()
        try:
            async with self._session.post(self.urls[replica] + "/generate", json={**body, "stream": stream}) as r:
                raw, status = await r.read(), r.status
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            return Answer(index, replica, stream, 0, f"{type(exc).__name__}: {exc}", [], sent, time.monotonic())
        ended = time.monotonic()
        if status != 200:
            return Answer(index, replica, stream, status, raw[:300].decode(errors="replace"), [], sent, ended)
        if stream:
            events = [b[6:] for b in raw.split(b"\n\n") if b.startswith(b"data: ")]
            if len(events) < 2 or events[-1] != b"[DONE]" or b'"error"' in events[-2]:
                return Answer(index, replica, stream, status, f"broken stream {events[-2:]}", [], sent, ended)
            last = orjson.loads(events[-2])
        else:
            last = orjson.loads(raw)
        meta = last["meta_info"]
        versions = [s["version"] for s in meta.get("weight_versions") or []] or [meta.get("weight_version")]
        return Answer(index, replica, stream, status, meta["finish_reason"]["type"], versions, sent, ended)

    async def leave(self, replica: int, others: list[int], rng: random.Random, timeout: float = 30.0) -> bool:
        """Every client of `replica` moves to one of `others`; True once none has a request there."""
        for index, target in enumerate(self.target):
            if target == replica:
                self.target[index] = rng.choice(others)
        deadline = time.monotonic() + timeout
        while replica in self.inflight.values():
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.02)  # the poll interval of a wait with a deadline
        return True

    def spread(self, up: list[int]) -> None:
        """Clients over every replica that serves, evenly again."""
        for index in range(len(self.target)):
            self.target[index] = up[index % len(up)]

    async def finish(self) -> list[Answer]:
        self._stop.set()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._session.close()
        return self.answers
