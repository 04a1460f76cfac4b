"""A consistent hash ring over worker URLs, and the routing key a request names (consistent_hashing, manual,
prefix_hash).

Positions come from a stable hash (blake2b), not Python's per-process `hash()`: every router replica, and the
same router after a restart, sends one key to the same worker. Each worker sits at `VIRTUAL_NODES` points
(SMG's 150), so keys spread evenly and a worker joining or leaving moves about 1/N of them. The ring holds
every worker it was shown; a lookup walks clockwise to the first one among the request's candidates, so a
worker out of routing for a while (unhealthy, draining) keeps its keys for when it comes back, and the ring
is rebuilt only when a worker is seen for the first time or forgotten.
"""

from __future__ import annotations

import bisect
import hashlib
from typing import Mapping, Sequence

from .base import Candidate

VIRTUAL_NODES = 150

# SMG's headers (lightseekorg/smg routers/common/header_utils.rs): a key for affinity, a pool index to pin.
ROUTING_KEY_HEADER = "x-smg-routing-key"
TARGET_WORKER_HEADER = "x-smg-target-worker"
# consistent_hashing without a routing key: a stable header of the client stands in for one (SMG's order).
IMPLICIT_KEY_HEADERS = ("authorization", "x-forwarded-for", "cookie")


def stable_hash(text: str) -> int:
    """64-bit position of `text`, the same in every process."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")


def routing_key(headers: Mapping[str, str] | None, names: Sequence[str]) -> str | None:
    """The value of the first of `names` present with a non-empty value (header names are case-insensitive:
    aiohttp's headers are a case-insensitive mapping)."""
    if not headers:
        return None
    for name in names:
        value = headers.get(name)
        if value:
            return value
    return None


class HashRing:
    __slots__ = ("_points", "_urls", "_members")

    def __init__(self) -> None:
        self._points: list[int] = []
        self._urls: list[str] = []
        self._members: set[str] = set()

    def __contains__(self, url: str) -> bool:
        return url in self._members

    def __len__(self) -> int:
        return len(self._members)

    def _rebuild(self) -> None:
        entries = sorted((stable_hash(f"{url}#{i}"), url) for url in self._members for i in range(VIRTUAL_NODES))
        self._points = [p for p, _ in entries]
        self._urls = [u for _, u in entries]

    def include(self, urls) -> None:
        """Add the workers not on the ring yet (one rebuild for all of them)."""
        new = {u for u in urls if u not in self._members}
        if new:
            self._members |= new
            self._rebuild()

    def discard(self, url: str) -> None:
        if url in self._members:
            self._members.discard(url)
            self._rebuild()

    def owner(self, key: str, candidates: Sequence[Candidate]) -> Candidate:
        """The first candidate clockwise from the key's position. Every candidate must be on the ring."""
        by_url = {w.url: w for w in candidates}
        urls, count = self._urls, len(self._urls)
        start = bisect.bisect_left(self._points, stable_hash(key))
        for step in range(count):
            worker = by_url.get(urls[(start + step) % count])
            if worker is not None:
                return worker
        raise ValueError("no candidate is on the ring")
