"""bucket: prefill servers each take one range of prompt lengths, the ranges moved to even out the work
(sgl-router's and SMG's `bucket`, for the prefill pool only).

Short and long prompts then meet different servers: a long prompt does not hold up a batch of short ones, and
each server's batches are of like sizes. As lightseekorg/smg policies/bucket.rs does (measured in characters,
as the peers do for text):
- to start, the prefill servers split the lengths 0..4095 evenly, the last one taking everything longer;
- every `--bucket-adjust-interval-secs` the ranges are recomputed from the prompts of the last such interval,
  so that each server's range holds the same share of their characters; the ranges stay as they are while
  the per-server share is within a factor 2 of the one they were made for;
- a request goes to the server whose range holds its prompt's length, unless the servers' characters of the
  last interval are imbalanced (max - min > `--balance-abs-threshold` and max > `--balance-rel-threshold` x
  min), then to the one with the fewest.
Servers keep their place in the order they were first seen; a server out of routing loses nothing: its range's
requests go to the least loaded routable server meanwhile. A server removed from the pool is dropped and the
ranges start again evenly.
"""

from __future__ import annotations

import bisect
import time
from collections import Counter, deque
from typing import Callable, Sequence

from .base import Candidate, Policy, RequestInfo
from .params import PolicyParams

INITIAL_SPAN = 4096  # characters the first even split covers (the peers' l_max)


class BucketPolicy(Policy):
    name = "bucket"
    needs_text = True

    def __init__(self, params: PolicyParams | None = None, *, clock: Callable[[], float] = time.monotonic) -> None:
        params = params or PolicyParams()
        if problems := params.problems():
            raise ValueError("; ".join(problems))
        self.params = params
        self.period = params.bucket_adjust_interval_secs
        self.maintenance_interval = self.period
        self._clock = clock
        self._urls: list[str] = []  # the servers, in the order first seen
        self._uppers: list[int] = []  # server i takes lengths <= _uppers[i]; the last takes the rest
        self._share = 0  # characters per server the ranges were made for (0: the initial split)
        self._window: deque[tuple[float, int, str]] = deque()  # (time, characters, url) of recent requests
        self._chars: Counter[str] = Counter()  # url -> characters in the window
        self.adjustments = 0
        self.decisions: Counter[str] = Counter()  # bucket, balance, elsewhere

    @classmethod
    def build(cls, params: PolicyParams, rng=None) -> "BucketPolicy":
        return cls(params)

    # ---- ranges --------------------------------------------------------------------------------------
    def _split_evenly(self) -> None:
        n = len(self._urls)
        gap = INITIAL_SPAN // n if n else 0
        self._uppers = [(i + 1) * gap - 1 for i in range(n - 1)]
        self._share = 0

    def ranges(self) -> list[tuple[str, int, int | None]]:
        """(url, lowest length, highest length or None for no bound) per server."""
        out, low = [], 0
        for i, url in enumerate(self._urls):
            high = self._uppers[i] if i < len(self._uppers) else None
            out.append((url, low, high))
            low = (high + 1) if high is not None else low
        return out

    def _expire(self, now: float) -> None:
        window, chars = self._window, self._chars
        while window and now - window[0][0] > self.period:
            _, count, url = window.popleft()
            chars[url] -= count

    def maintain(self) -> None:
        """Recompute the ranges from the last interval's prompts (when their per-server share moved 2x)."""
        self._expire(self._clock())
        n = len(self._urls)
        if not self._window or n < 2:
            return
        lengths = sorted(count for _, count, _ in self._window)
        share = sum(lengths) // n
        if self._share and self._share // 2 <= share <= 2 * self._share:
            return
        uppers: list[int] = []
        accumulated, low = 0, 0
        for length in lengths:
            accumulated += length
            if len(uppers) < n - 1 and accumulated >= share * (len(uppers) + 1):
                uppers.append(max(length, low))
                low = uppers[-1] + 1
        while len(uppers) < n - 1:  # fewer distinct crossings than servers: the rest take one length each
            uppers.append(low)
            low += 1
        self._uppers, self._share = uppers, max(share, 1)
        self.adjustments += 1

    # ---- choice --------------------------------------------------------------------------------------
    def _know(self, candidates: Sequence[Candidate]) -> None:
        new = [w.url for w in candidates if w.url not in self._urls]
        if new:
            self._urls.extend(new)
            self._split_evenly()

    def imbalanced(self, candidates: Sequence[Candidate]) -> bool:
        loads = [self._chars[w.url] for w in candidates]
        low, high = min(loads), max(loads)
        return high - low > self.params.balance_abs_threshold and high > self.params.balance_rel_threshold * low

    def select(self, candidates: Sequence[Candidate], request: RequestInfo) -> Candidate:
        now = self._clock()
        self._expire(now)
        self._know(candidates)
        length = len(request.text) if request.text else 0
        least = min(candidates, key=lambda w: self._chars[w.url])
        if self.imbalanced(candidates):
            chosen, reason = least, "balance"
        else:
            url = self._urls[bisect.bisect_left(self._uppers, length)]
            chosen = next((w for w in candidates if w.url == url), None)
            chosen, reason = (chosen, "bucket") if chosen is not None else (least, "elsewhere")
        self.decisions[reason] += 1
        self._window.append((now, length, chosen.url))
        self._chars[chosen.url] += length
        return chosen

    def on_worker_removed(self, worker: Candidate) -> None:
        if worker.url in self._urls:
            self._urls.remove(worker.url)
            self._chars.pop(worker.url, None)
            self._window = deque(entry for entry in self._window if entry[2] != worker.url)
            self._split_evenly()

    def state(self) -> dict:
        return {"name": self.name, "adjust_interval_secs": self.period, "adjustments": self.adjustments,
                "ranges": [{"url": u, "min_chars": lo, "max_chars": hi} for u, lo, hi in self.ranges()],
                "window_chars": {u: self._chars[u] for u in self._urls}, "decisions": dict(self.decisions)}
