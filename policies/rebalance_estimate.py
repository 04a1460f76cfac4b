"""The fleet model's inputs, fitted online from what the servers and the router report (pure; no I/O).

Each look reads every routable server's cumulative counters (`Counters`): the requests the router sent it and
has open on it (its own counts), a prefill's forward time (`total_prefill_busy_us`) and a decode's tokens
(`decode_moments`). Between two looks at the same server in the same role, their differences say what arrived
and what it cost (`Interval`): requests that arrived, prefill forwards' seconds per request that left its
prefill, decode tokens per request through its decode. These are properties of the workload, not of the
split: moving a server does not change what a request costs, so a conversion does not disturb the fit.
`fit` sums the intervals of the last `window_secs` into a `fleet_model.Mix`, with the decodes' fitted step
line, the backlogs the signals read (`rebalance_signals`: which queue waits on which pool), and the spread
of request sizes the router saw (`Observation.request_sizes`: relative shapes; the servers' figures set the
scale).

What arrives is read two ways. By default as the window's typical slices (`_kept`: a burst or a lull of
requests left out; the sizes are those slices' work over their count): a burst shorter than half the window is
a backlog, not the mix. When the mix changed within the window (`rebalance_change.read_change`), it is read
since the change, so a shift is acted on in about a quarter of the window rather than half, on the new mix alone.
A prefill request's cost for what arrives comes from a line, fixed + per size, fitted across the memory's
intervals (`prefill_line`), where the sizes varied enough to fit one; scaling a cost by size alone overstates
long prompts from short ones' costs, and a shift's first move then overshoots. Elsewhere it is the window's
forward seconds per unit of prompt size (`prefill_per_size`). Both read only intervals whose requests leaving
the prefills are the ones that arrived in them (`_balanced`), the window whole while it held no queue.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

from .fleet_model import Mix
from .rebalance_change import MIN_DONE, SIZE_BINS, halves_apart, read_change, unsettled_start
from .rebalance_signals import DECODE, PREFILL, Observation, decoding_now, step_line, waits_on_decode, waits_on_prefill

MAX_INTERVALS = 512  # intervals kept (a bound: the window decides what counts)


@dataclass(frozen=True, slots=True)
class Counters:
    """One routable server's cumulative counters at a look."""

    id: str
    role: str
    started: int  # requests the router sent it (since it joined its pool)
    inflight: int  # requests the router has open on it
    busy_s: float | None  # prefill: seconds in forwards, since the server started
    tokens: float | None  # decode: tokens decoded, since the server started


@dataclass(frozen=True, slots=True)
class Interval:
    """What happened between two looks, over the servers seen at both in the same role."""

    secs: float
    arrivals: int  # requests sent to the prefill pool
    prefill_done: int  # requests that left a prefill whose forward time is known (their forward done)
    prefill_busy_s: float  # the forward seconds those prefills spent
    decode_done: int  # requests that left a decode whose token count is known
    decode_started: int  # requests sent to those decodes
    decode_tokens: float  # the tokens those decodes decoded
    sized: int = 0  # requests that arrived in it whose prompt size the router read
    prompt_size: float = 0.0  # their prompt sizes summed
    prompt_squares: float = 0.0  # and their squares (how far the interval's mean size is from its mix's)
    prefill_held: int = 0  # requests the prefills held at its start (older arrivals: the first to leave)


def counters(obs: Observation) -> tuple[Counters, ...]:
    return tuple(Counters(w.id, role, w.started, w.inflight, w.busy_total_s, w.tokens_total)
                 for role in (PREFILL, DECODE) for w in obs.pool(role))


def interval(before: tuple[Counters, ...], after: tuple[Counters, ...], secs: float,
             prompts: tuple[float, ...] = ()) -> Interval:
    """The differences between two looks' counters (a server whose counters went back restarted: skipped), with
    the prompt sizes of the requests that arrived between them (`prompts`)."""
    then = {(c.id, c.role): c for c in before}
    arrivals = prefill_done = decode_done = decode_started = held = 0
    busy = tokens = 0.0
    for c in after:
        old = then.get((c.id, c.role))
        if old is None or c.started < old.started:
            continue
        started = c.started - old.started
        done = max(0, started - (c.inflight - old.inflight))
        # a server that does not say (or restarted: its counter went back) tells nothing of what a request costs
        if c.role == PREFILL:
            arrivals += started
            if c.busy_s is not None and old.busy_s is not None and c.busy_s >= old.busy_s:
                prefill_done += done
                busy += c.busy_s - old.busy_s
                held += old.inflight
        elif c.tokens is not None and old.tokens is not None and c.tokens >= old.tokens:
            decode_done += done
            decode_started += started
            tokens += c.tokens - old.tokens
    return Interval(secs, arrivals, prefill_done, busy, decode_done, decode_started, tokens, len(prompts),
                    float(sum(prompts)), float(sum(p * p for p in prompts)), held)


@dataclass(frozen=True, slots=True)
class Fit:
    """The mix fitted at a look, or why it could not be (`missing`)."""

    mix: Mix | None
    missing: str = ""
    window_secs: float = 0.0
    # the relative standard error of the work arriving at each pool (prefill, decode): how far the mix could be
    # from what the window's slices say (their spread over the square root of their number)
    spread: tuple[float, float] = (0.0, 0.0)
    changed_at: float | None = None  # when the mix changed, while the window still holds the old one
    # when it changed: the window read whole (its typical slices, a burst left out), as `mix` would be without
    whole: Mix | None = None


def _shapes(sizes: tuple[tuple[float, float, float], ...]) -> tuple[tuple[float, float], ...]:
    """Request sizes relative to their means (each side 1 on average); ((1, 1),) when none are known."""
    known = [(p, d) for _, p, d in sizes if p > 0 and d > 0]
    if not known:
        return ((1.0, 1.0),)
    mean_p = sum(p for p, _ in known) / len(known)
    mean_d = sum(d for _, d in known) / len(known)
    return tuple((p / mean_p, d / mean_d) for p, d in known)


def _median(values: list[float]) -> float:
    """The median of the window's slices (rates or work): a burst shorter than half the window is not a new
    level (its backlog is read as a backlog)."""
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _relative_error(values: list[float]) -> float:
    """The standard error of the mean of `values`, relative to it (0 with fewer than two, or a mean of 0)."""
    if len(values) < 2:
        return 0.0
    mean = sum(values) / len(values)
    if mean <= 0:
        return 0.0
    variance = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return (variance / len(values)) ** 0.5 / mean


PER_SLICE = 4  # requests a slice holds at least on average: fewer, and its median is a count's noise, not a rate


def _slice_count(arrivals: int, most: int) -> int:
    """How many slices the window is read in: `most`, fewer where that many would hold under `PER_SLICE`
    requests each (the median of counts near 1 is 0: sparse arrivals, slow answers on a busy machine, would read
    as none at all)."""
    return max(1, min(most, arrivals // PER_SLICE))


def _grouped_rates(intervals: list, count: int) -> tuple[list[float], list[float]]:
    """The arrival rate of each of `count` groups of consecutive intervals (about as many intervals each), and
    each rate's Poisson variance."""
    size = len(intervals) / count
    groups = [intervals[round(i * size):round((i + 1) * size)] for i in range(count)]
    rates, variances = [], []
    for g in groups:
        secs = sum(iv.secs for iv in g)
        if secs > 0:
            arrived = sum(iv.arrivals for iv in g)
            rates.append(arrived / secs)
            variances.append(arrived / secs ** 2)
    return rates, variances


TRIM_Z = 3.0  # a slice this many of its noise's standard errors off the window's median is a burst or a lull


def _kept(values: list[float], variances: list[float]) -> list[int]:
    """The slices within `TRIM_Z` standard errors (of their Poisson noise, the slices' variances pooled) of the
    median: a burst or a lull shorter than half the window is left out."""
    if not values:
        return []
    center = _median(values)
    band = TRIM_Z * math.sqrt(sum(variances) / len(variances)) if variances else 0.0
    return [i for i, v in enumerate(values) if abs(v - center) <= band]


def _typical(values: list[float], variances: list[float]) -> float:
    """The window's level, not moved by a burst or a lull shorter than half of it: the mean of the slices kept
    (`_kept`). The median alone is that robust but biased: of a few requests a slice its median is under the
    mean (a Poisson count's is)."""
    kept = _kept(values, variances)
    return sum(values[i] for i in kept) / len(kept) if kept else (_median(values) if values else 0.0)


def _slices(obs: Observation, secs: float, side: int) -> tuple[list[float], list[float]]:
    """The work (sizes summed; side 0: requests) arriving in each of the window's slices (`SIZE_BINS`, fewer
    when few requests arrived: `_slice_count`), per second, and each one's Poisson variance (its sizes'
    squares summed)."""
    bins = _slice_count(len(obs.request_sizes), SIZE_BINS)
    width = secs / bins
    work, squares = [0.0] * bins, [0.0] * bins
    for entry in obs.request_sizes:
        index = int((obs.now - entry[0]) / width)
        if 0 <= index < bins:
            size = entry[side] if side else 1.0
            work[index] += size
            squares[index] += size * size
    return [w / width for w in work], [q / width ** 2 for q in squares]


def _rescaled(cost: float | None, obs: Observation, per_request: float | None, side: int) -> float | None:
    """A per-request cost measured on the requests that finished, for those that arrive (`per_request`: their
    mean size): in proportion to the sizes the router saw of each (the servers give the scale, the router the
    mix)."""
    finished = obs.finished_sizes
    if cost is None or per_request is None or len(finished) < MIN_DONE:
        return cost
    mean_finished = sum(s[side - 1] for s in finished) / len(finished)
    return cost * per_request / mean_finished if mean_finished > 0 and per_request > 0 else cost


def _arriving_sizes(sliced: list[tuple[list[float], list[float]]]) -> tuple[float, float] | None:
    """The mean sizes (prompt, answer) of the requests arriving, from the window's slices of each side (`_slices`
    of sides 0, 1, 2): the work of the slices whose count of requests is typical (`_kept`) over their count;
    None: none read. A burst or a lull is of requests; a slice's work is trimmed by its count, not by itself:
    the Poisson band of a sum of heavy-tailed sizes is narrow for the rare long one that rules it, and a slice
    holding one long prompt was left out as a burst (the mean prompt read 0.6 of itself at a start)."""
    counts, variances = sliced[0]
    kept = _kept(counts, variances) or list(range(len(counts)))
    count = sum(counts[i] for i in kept)
    if count <= 0:
        return None
    return sum(sliced[1][0][i] for i in kept) / count, sum(sliced[2][0][i] for i in kept) / count


STEADY_SHARE = 0.1  # a decode pool whose requests in flight changed by under this share of those through it
BALANCED = 0.2  # an interval whose prefills held and finished within this share of what arrived: no backlog moved
RELIABLE = 0.5  # the share of the intervals' spread in mean prompt size that must be the mix's, not sampling


def _balanced(iv: Interval) -> bool:
    """The requests that left the prefills in it are the ones that arrived in it (the sizes the router saw
    arrive are the sizes done): the prefills held few at its start (the queue is first in, first out: a backlog
    worked through leaves with other sizes, a burst's), and finished about what arrived."""
    return (iv.sized >= 2 and iv.prefill_done > 0 and iv.prefill_held <= BALANCED * iv.prefill_done
            and abs(iv.arrivals - iv.prefill_done) <= BALANCED * iv.arrivals)


def _as_one(intervals: list[Interval]) -> Interval:
    """Consecutive intervals (oldest first) as one: what the prefills held at its start, the oldest's."""
    summed = Interval(*(sum(getattr(iv, f.name) for iv in intervals) for f in fields(Interval)))
    return replace(summed, prefill_held=intervals[0].prefill_held)


def prefill_per_size(intervals: list[Interval]) -> float | None:
    """A prefill's seconds per unit of prompt size over `intervals` (the window's, oldest first); None with fewer
    than `MIN_DONE` requests behind it. Read as one window while none of its intervals began with a queue (over
    `BALANCED` of what it finished) and it is balanced whole: a forward across two intervals' edge counts in the
    second, and balance judged per interval kept those whose long prompts still ran at their end and left out
    those that finished them (heavy-tailed prompts read a third of their cost at a start, a fifth under later).
    Else from the intervals balanced each (`_balanced`). Not scaled by the requests that ended whole: those are
    the short answers' kinds more than the mix is, and read a mix of both kinds' prefill a fifth low."""
    if not intervals:
        return None
    whole = _as_one(intervals)
    queued = max(iv.prefill_held for iv in intervals) > BALANCED * whole.prefill_done
    busy = size = done = 0.0
    for iv in (intervals if queued or not _balanced(whole) else [whole]):
        if _balanced(iv):
            busy += iv.prefill_busy_s
            size += iv.prefill_done * iv.prompt_size / iv.sized
            done += iv.prefill_done
    return busy / size if done >= MIN_DONE and size > 0 else None


def prefill_line(intervals: tuple[Interval, ...]) -> tuple[float, float] | None:
    """A prefill request's seconds as a line, fixed + per size x its prompt size, fitted over the intervals kept
    in which the prefills finished about what arrived (so the sizes that arrived are the sizes done): the
    servers' constants, not the mix's, so the whole memory counts, not the window. Each interval's mean size is
    a sample: its sampling variance (from the sizes' squares) is taken off the spread the slope is read against,
    which would otherwise flatten it; None while the sizes did not vary beyond sampling enough to tell the two
    parts apart (then scaling by size alone is as good). Scaling a cost measured on one mix by size alone is
    biased for another where a request's cost has a fixed part: short prompts' costs scaled up overstate long
    ones."""
    rows = []  # (weight: requests done, mean size, seconds per request, sampling variance of the mean size)
    for iv in intervals:
        if not _balanced(iv):
            continue
        mean = iv.prompt_size / iv.sized
        noise = max(0.0, iv.prompt_squares / iv.sized - mean * mean) / iv.sized
        rows.append((iv.prefill_done, mean, iv.prefill_busy_s / iv.prefill_done, noise))
    if len(rows) < 2 * MIN_DONE:
        return None
    total = sum(w for w, _, _, _ in rows)
    x_bar = sum(w * x for w, x, _, _ in rows) / total
    y_bar = sum(w * y for w, _, y, _ in rows) / total
    spread = sum(w * (x - x_bar) ** 2 for w, x, _, _ in rows) / total
    noise = sum(w * v for w, _, _, v in rows) / total
    if spread <= 0 or spread - noise < RELIABLE * spread:
        return None
    per_size = sum(w * (x - x_bar) * (y - y_bar) for w, x, y, _ in rows) / total / (spread - noise)
    fixed = y_bar - per_size * x_bar
    return (fixed, per_size) if fixed >= 0 and per_size > 0 else None


def fit(obs: Observation, intervals: tuple[Interval, ...], window_secs: float, previous: Mix | None,
        changed_at: float | None = None) -> Fit:
    """The mix over the newest intervals covering `window_secs`. A figure with too few requests behind it keeps
    its previous value (a pool that finished nothing in the window says nothing new of what a request costs)."""
    secs = arrivals = prefill_done = decode_done = decode_started = 0
    busy = tokens = 0.0
    used = []
    for iv in reversed(intervals):
        if secs >= window_secs:
            break
        used.append(iv)
        secs += iv.secs
        arrivals += iv.arrivals
        prefill_done += iv.prefill_done
        busy += iv.prefill_busy_s
        decode_done += iv.decode_done
        decode_started += iv.decode_started
        tokens += iv.decode_tokens
    if secs <= 0:
        return Fit(None, "no interval yet (one look so far)")
    # the router keeps the sizes of the last `window_secs` of arrivals; the intervals summed reach past it by up
    # to a look, and read over that span the sizes' oldest stretch was short of its requests (a level read under
    # itself, and a change up read from it: burst4 kept a burst as a change 15 s against a second of "old" level)
    sized_secs = min(secs, window_secs)
    change = read_change(obs, sized_secs, changed_at)
    unsettled = unsettled_start(secs, window_secs, change, secs < window_secs and halves_apart(obs, sized_secs))
    if unsettled:
        return Fit(None, unsettled, secs)
    rates, rate_variances = _grouped_rates(used, _slice_count(arrivals, len(used)))
    rate = whole_rate = _typical(rates, rate_variances)
    # the window's slices of each side (requests, prompt work, answer work): the window read whole
    sliced = [_slices(obs, sized_secs, side) for side in range(3)] if len(obs.request_sizes) >= MIN_DONE else None
    sizes = whole_sizes = _arriving_sizes(sliced) if sliced else None
    if change is not None:  # the mix changed within the window: read it since the change
        # the router sizes nearly every request; the prefills' counts also hold requests sent again (a shed
        # server's queue), which arrived once: their ratio scales only down
        covered = min(1.0, arrivals / len(obs.request_sizes)) if obs.request_sizes and arrivals else 1.0
        rate, sizes = change.rate * covered, change.work
    measured_prefill = busy / prefill_done if prefill_done >= MIN_DONE else None
    # the tokens of a window come from the requests that finished in it and from those that arrived in it, each
    # in part: per request, over the mean of the two (completions alone overstate it while a batch grows, as
    # it does in an overload: 26 to 56 tokens read for answers of 15; arrivals alone understate it)
    through = (decode_done + decode_started) / 2
    measured_tokens = tokens / through if decode_done >= MIN_DONE and through > 0 else None
    cost_line = prefill_line(intervals)
    # oldest first; where no interval of the window says (it worked through a queue), the memory's do: a cost per
    # unit of prompt is the servers', not the mix's (scaled by the requests that finished instead, a lagging
    # sample of another mix, drift6-slow's mixed phase read its prefill 0.78 of the arrivals' after a queue)
    per_size = prefill_per_size(used[::-1]) or prefill_per_size(list(intervals))
    answer_share = previous.answer_share if previous is not None else 1.0
    # the router read each request's token budget as it arrived: that is the mix now; the servers' tokens say
    # what share of it requests decode, read only while the decode pool is steady (its rows lag by up to 15
    # steps, which a pool whose batch grows makes seconds, and which a steady one makes no difference to). A
    # budget of one token decodes none (the KV brings it): its 0 counts, as in the budget and the requests
    # through the pool (left out, a third of one-token requests read a share of 0.67 where it was 1)
    finished = [a - 1 for _, a in obs.finished_sizes]
    steady = abs(decode_started - decode_done) <= STEADY_SHARE * max(decode_done, decode_started)
    if sizes and sizes[1] > 1 and measured_tokens is not None and finished and sum(finished) > 0 and steady:
        answer_share = min(1.0, max(0.01, measured_tokens / (sum(finished) / len(finished))))

    def costs_of(read: tuple[float, float] | None) -> tuple[float | None, float | None]:
        """A request's prefill seconds and decode tokens, for arriving requests of these mean sizes."""
        if read and cost_line is not None:
            prefill = cost_line[0] + cost_line[1] * read[0]
        elif read and per_size is not None:
            prefill = per_size * read[0]
        else:  # what finished is a lagging sample of what arrives: scaled by the sizes the router saw of each
            prefill = _rescaled(measured_prefill, obs, read[0] if read else None, 1)
        if read and read[1] > 1:
            return prefill, (read[1] - 1) * answer_share
        return prefill, _rescaled(measured_tokens, obs, read[1] if read else None, 2)
    prefill_s, decode_tokens = costs_of(sizes)
    line = step_line(obs)
    fixed, per_request = line if line else (None, None)
    if fixed is None:
        steps = [w.decode_step_s for w in obs.decode if w.decode_step_s is not None]
        if steps:  # no fitted line yet: the step as it is, as if it did not grow with the batch
            fixed, per_request = sum(steps) / len(steps), 0.0
    if previous is not None:
        prefill_s = previous.prefill_s if prefill_s is None else prefill_s
        decode_tokens = previous.decode_tokens if decode_tokens is None else decode_tokens
        if fixed is None:
            fixed, per_request = previous.step_fixed_s, previous.step_per_request_s
    if decode_tokens is not None and decode_tokens <= 1.0 and fixed is None:
        fixed, per_request = 0.0, 0.0  # answers of a token or none: the decode pool's speed does not matter
    missing = [name for name, v in (("prefill seconds per request", prefill_s),
                                    ("decode tokens per request", decode_tokens), ("decode step", fixed)) if v is None]
    if missing:
        return Fit(None, f"not measured yet: {', '.join(missing)}", secs)
    wait_p = waits_on_prefill(obs) or 0.0
    wait_d = waits_on_decode(obs) or 0.0
    rate_error = _relative_error(rates)
    if change is not None:
        spread = change.error
    elif sliced:
        spread = (max(rate_error, _relative_error(sliced[1][0])), max(rate_error, _relative_error(sliced[2][0])))
    else:
        spread = (rate_error, rate_error)
    mix = Mix(rate=rate, prefill_s=prefill_s, decode_tokens=decode_tokens, step_fixed_s=fixed,
              step_per_request_s=per_request, shapes=_shapes(obs.request_sizes), decode_slots=decode_slots(obs),
              waiting_prefill=wait_p, waiting_decode=wait_d, answer_share=answer_share)
    whole = None
    if change is not None:
        whole_prefill, whole_tokens = costs_of(whole_sizes)
        # a figure the window whole has no reading of (None) is the one since the change; a measured 0 is kept
        whole = replace(mix, rate=whole_rate, prefill_s=prefill_s if whole_prefill is None else whole_prefill,
                        decode_tokens=decode_tokens if whole_tokens is None else whole_tokens)
    return Fit(mix, "", secs, spread, obs.now - change.secs if change is not None else None, whole)


def decode_slots(obs: Observation) -> float:
    """The requests a decode server holds at once: where requests wait for KV room now (0.5.23's prealloc
    queue, handshake done), the ones holding room (running, waiting for a place in the batch, or in transfer:
    room reserved for KV still to come); else its running cap; inf when nothing tells. The pool's figure is its
    servers' mean."""
    readings = []
    for w in obs.decode:
        waiting_room = w.prealloc_ready if w.prealloc_ready is not None else w.prealloc
        holders = (w.running or 0) + (w.waiting_queue or 0) + (w.transfer or 0)
        if waiting_room and holders:
            readings.append(float(holders))
        elif w.max_running:
            readings.append(float(w.max_running))
    return sum(readings) / len(readings) if readings else float("inf")


def overgrown_batch(obs: Observation, steady_batch: float) -> float:
    """Requests decoding beyond the batch the decodes would hold in a steady state: a backlog the decode pool
    carries in its batch (an overload grows the batch, not a queue)."""
    return max(0.0, decoding_now(obs) - steady_batch * len(obs.decode))
