"""The latencies the router measured on the requests that ended recently: the rebalancer's TTFT and ITL.

Every request that reached a prefill/decode pair counts, whatever its end: answered, failed, cut by its
deadline, or abandoned by its client. A request that ended without a first token counts with the time it
waited (a lower bound of its TTFT): those are the worst first tokens of an overload, and sampling only the
answered ones would report the fleet as fine exactly when clients give up. Requests refused before reaching
a pair (bad input, nothing routable) say nothing about capacity and are left out, as are client errors (4xx).

After a conversion ends, only requests that started after it count: those that began under the old split
(or waited out the conversion's drain) describe the old split, not the new one.

A figure needs `min_samples` requests. When the window holds fewer (an overload finishes few), the newest ones
up to `min_samples` count, from as far back as `LOOKBACK_WINDOWS` windows, rather than leaving the term empty
at the height of the overload; with fewer still, the figure is None.
"""

from __future__ import annotations

from collections import deque
from typing import Callable

from router.core.records import RequestRecord

LOOKBACK_WINDOWS = 4
_CLIENT_ERRORS_THAT_COUNT = frozenset({408, 429, 499})  # timeouts, overload, the client gave up


def p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[max(0, -(-len(ordered) * 9 // 10) - 1)]


class LatencyWindow:
    """A request observer (O(1) per request); `summary` is called once per rebalancer interval."""

    def __init__(self, window_secs: float, clock: Callable[[], float], max_samples: int = 8192) -> None:
        self.window_secs = window_secs
        self.clock = clock
        # (ended at, ttft or None, itl or None, ended without a first token, started at)
        self._samples: deque[tuple[float, float | None, float | None, bool, float]] = deque(maxlen=max_samples)
        # (ended at, prompt size, answer size) of requests whose sizes the router read, and (arrived at, ...) of
        # those that arrived: what finished and what arrives (the rebalancer's mix)
        self._sizes: deque[tuple[float, int, int]] = deque(maxlen=max_samples)
        self._arrivals: deque[tuple[float, int, int]] = deque(maxlen=max_samples)

    def arrived(self, record: RequestRecord) -> None:
        """A request arrived (its shape read): its sizes count for the mix now, not once it ends (an overload
        ends few, and those it ends are the old mix's)."""
        if record.prompt_size > 0 and record.answer_size > 0:
            self._arrivals.append((self.clock(), record.prompt_size, record.answer_size))

    def observe(self, record: RequestRecord) -> None:
        if record.decode is None:
            return  # never reached a pair
        if record.prompt_size > 0 and record.answer_size > 0:
            self._sizes.append((self.clock(), record.prompt_size, record.answer_size))
        if 400 <= record.status < 500 and record.status not in _CLIENT_ERRORS_THAT_COUNT:
            return
        ttft, censored = record.ttft_s, False
        if ttft is None and record.outcome != "success":
            ttft, censored = record.e2e_s, True
        if ttft is None and record.itl_s is None:
            return
        self._samples.append((self.clock(), ttft, record.itl_s, censored, record.started))

    def sizes(self, now: float) -> tuple[tuple[tuple[float, float, float], ...], tuple[tuple[float, float], ...]]:
        """The sizes of the requests that arrived in the window (arrived at, prompt, answer), and of those that
        ended in it (prompt, answer)."""
        horizon = now - self.window_secs
        for kept in (self._sizes, self._arrivals):
            while kept and kept[0][0] < horizon:
                kept.popleft()
        return tuple(self._arrivals), tuple((s[1], s[2]) for s in self._sizes)

    def summary(self, now: float, min_samples: int, since: float | None = None) -> dict:
        """p90 TTFT and ITL (None: too few samples), how many requests the window holds and how many of them
        ended without a first token; only requests started at or after `since` (the last conversion's end)."""
        samples = self._samples
        while samples and samples[0][0] < now - LOOKBACK_WINDOWS * self.window_secs:
            samples.popleft()
        horizon = now - self.window_secs
        kept = [s for s in samples if since is None or s[4] >= since]
        recent = [s for s in kept if s[0] >= horizon]

        def figure(index: int) -> float | None:
            values = [s[index] for s in recent if s[index] is not None]
            if len(values) < min_samples:
                values = [s[index] for s in kept if s[index] is not None][-min_samples:]
            return p90(values) if len(values) >= min_samples else None

        return {"ttft_s": figure(1), "itl_s": figure(2), "samples": len(recent),
                "without_first_token": sum(1 for s in recent if s[3])}
