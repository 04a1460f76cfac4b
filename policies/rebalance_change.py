"""Whether the mix of arriving requests changed within the window, and since when (pure; no I/O).

The window is read whole by default (`rebalance_estimate`: its typical slice, a burst shorter than half of it
left out). A shift is acted on sooner when it is read as one: a new level of arriving work (`Level`: requests,
prompt work and answer work per second, with the noise a Poisson stream of these very sizes has) that has lasted
two of the window's slices, each at it (`read_change`), read from when it happened (`change_point`: to the
arrival). Until the memory holds twice that shortest level, the start is read the same way (`unsettled_start`).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from .rebalance_signals import Observation

MIN_DONE = 3  # requests behind a figure: a level read here, a pool's per-request cost (rebalance_estimate)
SIZE_BINS = 8  # the window's arrivals are read in this many slices (the typical slice's work counts)
CHANGE_Z = 4.0  # standard errors between two levels of arriving work that say the mix changed, not the noise
# the fewest of the window's slices a new level must have lasted, each at it, to be read as the mix: one slice
# can be all one burst. Three (a third of the window) left a shift 2 s more on the wrong split, whose backlog
# outlasts the move by as long again (the live benchmark's later phases lost 15-23 points in replay, at two 10-16)
CHANGE_MIN_SLICES = 2


@dataclass(frozen=True, slots=True)
class Level:
    """What arrived over a stretch of time, per second: the requests, and the work on each side (the prompt and
    answer sizes summed), each with the variance a Poisson stream of these sizes has (a count's is itself; a sum
    of sizes', the sum of their squares): the noise known from the sizes, not guessed from a few slices."""

    secs: float
    values: tuple[float, float, float]  # requests, prompt work, answer work (per second)
    variances: tuple[float, float, float]

    @staticmethod
    def of(entries: list[tuple[float, float, float]], secs: float) -> "Level":
        values = (len(entries), sum(e[1] for e in entries), sum(e[2] for e in entries))
        squares = (len(entries), sum(e[1] ** 2 for e in entries), sum(e[2] ** 2 for e in entries))
        return Level(secs, tuple(v / secs for v in values), tuple(q / secs ** 2 for q in squares))

    def distance(self, other: "Level", side: int) -> float:
        """How many standard errors (of both levels' noise) apart the two are on `side` (0 when neither has any)."""
        variance = self.variances[side] + other.variances[side]
        return abs(self.values[side] - other.values[side]) / math.sqrt(variance) if variance > 0 else 0.0

    def beyond(self, other: "Level", side: int, z: float) -> bool:
        return self.distance(other, side) >= z

    def reading(self) -> "Reading":
        rate, prompt, answer = self.values
        return Reading(rate, (prompt / rate, answer / rate),
                       tuple(math.sqrt(self.variances[i]) / self.values[i] if self.values[i] > 0 else 0.0
                             for i in (1, 2)), self.secs)


@dataclass(frozen=True, slots=True)
class Reading:
    """What arrives since a change of the mix: the rate, the mean sizes of a request (prompt, answer), and the
    relative standard error of each side's work."""

    rate: float
    work: tuple[float, float]
    error: tuple[float, float]
    secs: float  # how long ago the change was


def _arrived_at(entry: tuple[float, float, float]) -> float:
    return entry[0]


def _split_at(entries: list, at: float) -> int:
    """Where `entries` (oldest first) split at time `at`: those before it arrived at or before `at`."""
    return bisect.bisect_right(entries, at, key=_arrived_at)


def _new_level(entries: list, now: float, start: float, since: float, parts: int, kept: bool = False) -> Level | None:
    """The level of the arrivals since `since` when it is a change from the level of those before it (from
    `start`): `CHANGE_Z` standard errors off it in the requests or either side's work, with each of `parts` equal
    slices since it at the new level on that side (`_slice_holds`: a burst shorter than the run leaves slices at
    the old level wherever it falls in it). Nothing before the run is a level too: a load that begins after an
    idle spell is a change from nothing."""
    if since <= start or now <= since:
        return None
    split = _split_at(entries, since)
    newer = entries[split:]
    if len(newer) < MIN_DONE:
        return None
    new = Level.of(newer, now - since)
    old = Level.of(entries[:split], since - start)
    width = (now - since) / parts
    parted: list[list] = [[] for _ in range(parts)]
    for entry in newer:
        parted[min(parts - 1, int((now - entry[0]) / width))].append(entry)
    slices = [Level.of(part, width) for part in parted]
    # a burst that has ended leaves the newest seconds at the old level while the slice holding its end still
    # reads high: a change read now is one still going on (its newest half slice nearer the new level)
    newest = Level.of(entries[_split_at(entries, now - width / 2):], width / 2)
    for side in range(3):
        if new.beyond(old, side, CHANGE_Z) and all(_slice_holds(one, new, old, side, kept) for one in slices) and (
                kept or _slice_holds(newest, new, old, side, True)):
            return new
    return None


def _slice_holds(one: Level, new: Level, old: Level, side: int, kept: bool) -> bool:
    """Whether a slice of a run is at the run's new level on `side`: beyond the old level by half `CHANGE_Z`
    (a change to be read), or, for a change already read (`kept`), nearer the new level than the old, each
    distance in the standard errors a slice of that level has (a slice of a level of heavy-tailed sizes is 2 of
    the standard errors of both from the old level, or not, by chance: a change read and held 10 s was dropped
    on one slice at 1.98, and the fleet moved back on the window's median, a flap; a burst that ended leaves its
    newest slices at the old level, within its own noise)."""
    if (one.values[side] > old.values[side]) != (new.values[side] > old.values[side]):
        return False  # on the old level's other side
    if not kept:
        return one.beyond(old, side, CHANGE_Z / 2)

    def errors_from(level: Level) -> float:
        noise = math.sqrt(level.variances[side] * level.secs / one.secs)  # a slice's, at that level
        gap = abs(one.values[side] - level.values[side])
        return gap / noise if noise > 0 else (0.0 if gap == 0 else math.inf)
    return errors_from(new) < errors_from(old)


def change_point(entries: list, now: float, start: float, lo: float, hi: float) -> float:
    """When, between `lo` and `hi`, the arrivals changed: the split of the window's arrivals (`entries`, oldest
    first, from `start`) under which they are likeliest as two levels, each a Poisson stream of its own rate
    whose requests' sizes (log prompt, log answer) are normal of their own mean and spread; halfway between the
    last arrival before it and the first after (the first when none came before it in the window). A run of
    whole slices read as a change holds, in its oldest slice, the old level's last seconds too: read on all of
    them, the first reading of a shift is a level between the two mixes, and the first move is one server short
    (live, the second followed 8 s later). The work per second alone located it worse: a long-prompt level's
    noise is the larger, and the arrival times' noise moved the split by seconds."""
    logs = [(math.log1p(max(0.0, e[1])), math.log1p(max(0.0, e[2]))) for e in entries]
    count = len(entries)
    sums = [[0.0, 0.0, 0.0, 0.0]]  # prefix sums of log prompt, its square, log answer, its square
    for p, a in logs:
        last = sums[-1]
        sums.append([last[0] + p, last[1] + p * p, last[2] + a, last[3] + a * a])

    def likelihood(n: int, secs: float, part: list[float]) -> float:
        """A segment's log-likelihood (constants left out): its rate's, and its sizes' on each side."""
        if n == 0:
            return 0.0
        total = n * math.log(n / secs) - n
        for side in (0, 2):
            mean = part[side] / n
            total -= n / 2 * math.log(max(part[side + 1] / n - mean * mean, 0.0) + SIZE_FLOOR)
        return total
    best, best_score = hi, -math.inf
    for index, entry in enumerate(entries):
        cut = (entries[index - 1][0] + entry[0]) / 2 if index else entry[0]
        if not (lo <= cut <= hi and start < cut < now):
            continue
        before, after = sums[index], [t - b for t, b in zip(sums[count], sums[index])]
        score = likelihood(index, cut - start, before) + likelihood(count - index, now - cut, after)
        if score > best_score:
            best, best_score = cut, score
    return best


SIZE_FLOOR = 1e-3  # the least variance of a segment's log sizes (sizes all alike would be a certainty)


def _earliest_change(entries: list, now: float, start: float, k: float, width: float) -> float:
    """The earliest a change read on the run of the newest `k` slices can have happened: within the slice before
    the run (a change in its middle leaves it between the two levels), unless that slice is beyond the old level
    on the far side from the new on a side where the new level is a change: then it is a third level of its own
    (a burst that ended as the run began; read from within it, the level after the burst read as a third of
    the burst)."""
    run_start = now - k * width
    split = _split_at(entries, run_start)
    old, new = Level.of(entries[:split], run_start - start), Level.of(entries[split:], now - run_start)
    before = Level.of(entries[_split_at(entries, run_start - width):split], width)
    for side in range(3):
        if new.beyond(old, side, CHANGE_Z) and (before.values[side] > old.values[side]) != (
                new.values[side] > old.values[side]):
            return run_start
    return run_start - width


def read_change(obs: Observation, secs: float, changed_at: float | None = None) -> Reading | None:
    """The level the arriving work changed to within the window, else None. A change is found on runs of the
    window's newest slices (`SIZE_BINS` of it), the longest first from half the window down to
    `CHANGE_MIN_SLICES` of it, that are a new level (`_new_level`; a level that has lasted half the window is what
    the window's median reads anyway); it is read from when it happened (`change_point`). A change read at an
    earlier look (`changed_at`) stays read, from then, while the arrivals since are still a new level against
    those before it: the reading does not go back to the median and forth again as runs qualify or not, and a
    burst that was read as a change is dropped once it ends. Where they are not, the change is read again from
    where the arrivals since say it happened (`change_point`, from a slice before the first reading on): a
    first reading placed it seconds early, and dropped there the window read whole blended the two mixes."""
    if secs <= 0 or len(obs.request_sizes) < 2 * MIN_DONE:
        return None
    now, start = obs.now, obs.now - secs
    entries = sorted((e for e in obs.request_sizes if start < e[0] <= now), key=_arrived_at)
    width = secs / SIZE_BINS
    least = CHANGE_MIN_SLICES
    shortest = least * width
    if changed_at is not None and shortest <= now - changed_at < secs:
        def kept_since(since: float) -> Level | None:
            return _new_level(entries, now, start, since, max(least, round((now - since) / width)), kept=True)
        kept = kept_since(changed_at)
        if kept is None:  # placed early at first, perhaps: read again from where the arrivals since place it
            kept = kept_since(change_point(entries, now, start, max(start, changed_at - width), now - shortest))
        if kept is not None:
            return kept.reading()
    for k in range(SIZE_BINS // 2, least - 1, -1):
        if _new_level(entries, now, start, now - k * width, k) is None:
            continue
        # the run's slices are each at the new level (the test that tells a shift from a burst); its oldest may
        # hold the old level's last seconds too, and the slice before it the new level's first: the level is
        # read from the change on
        since = change_point(entries, now, start, _earliest_change(entries, now, start, k, width),
                             now - (k - 1) * width)
        newer = entries[_split_at(entries, since):]
        if len(newer) < MIN_DONE:  # too few since it to read a level on (a load falling to nothing): the run's
            since = now - k * width
            newer = entries[_split_at(entries, since):]
        return Level.of(newer, now - since).reading()
    return None


def halves_apart(obs: Observation, secs: float) -> bool:
    """Whether the arrivals of the last `secs` are two levels, their older half and their newer: apart by half
    `CHANGE_Z` standard errors in the requests or either side's work. At a start, a change too recent to be read
    as one (a burst as the fleet starts, a second of the mix after it) passed as the start's level, and the fleet
    moved for the burst (nearburst4). Half the threshold, because it costs little to be wrong that way: a steady
    start read as two levels (1 in 10) waits until the memory holds twice the shortest level."""
    now, middle = obs.now, obs.now - secs / 2
    entries = sorted((e for e in obs.request_sizes if now - secs < e[0] <= now), key=_arrived_at)
    split = _split_at(entries, middle)
    older, newer = Level.of(entries[:split], secs / 2), Level.of(entries[split:], secs / 2)
    return any(newer.beyond(older, side, CHANGE_Z / 2) for side in range(3))


def unsettled_start(secs: float, window_secs: float, change: Reading | None, apart: bool = False) -> str:
    """Why the arrivals since the start are not a level yet ("" once they are). The window whole is read past a
    burst because a burst shorter than half of it is left out (`_typical`); until the memory holds twice the
    shortest level that counts (`CHANGE_MIN_SLICES` of the window's slices), a burst at the start could be most
    of it. A level is read sooner when it is one: it has lasted that shortest level, no change is read within it
    (a burst followed by the steady mix is one), and its halves are not apart (`halves_apart`, from the caller).
    This is the model's own warm-up; the `warmup` guard waits out the servers' start-up (first compilations,
    empty caches), which replay and the simulator do not have."""
    shortest = CHANGE_MIN_SLICES * window_secs / SIZE_BINS
    if secs >= 2 * shortest:
        return ""
    if secs < shortest:
        return f"the arrivals since the start span {secs:.1f} s of the {shortest:.1f} s a level must last"
    if change is not None:
        return f"the arrivals changed {change.secs:.1f} s ago, {secs:.1f} s after the start: no level yet"
    if apart:
        return f"the arrivals of the {secs:.1f} s since the start differ between their halves: no level yet"
    return ""
