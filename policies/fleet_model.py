"""A model of a P/D fleet: the SLO attainment each split of its servers is predicted to reach (pure; no I/O).

The rebalancer's objective is the operator's: **SLO attainment**, the share of requests that meet both the TTFT
and the TPOT target. This module predicts it for a split (n prefill, m decode servers) from what the fleet is
measured to be doing (`Mix`, fitted online by `policies/rebalance_estimate.py`, or given by a replay), and
values every split the fleet could move to over a horizon, the conversions' cost included (`plan`).

The model (each part the simplest that keeps the tail, not only the mean):

- **Prefill** is one forward at a time per server: a queue. A request costs `s_i` seconds of prefill compute
  (`Mix.prefill_s` times its relative size); the pool's load is rho = lambda E[s] / n. The router sends each
  request to a least loaded prefill, which makes the pool behave as one queue in front of n servers (M/G/n): a
  request waits at all with the Erlang C probability, and, when it does, for an exponential time of mean
  (1 + scv) / 2 x E[s] / (n (1 - rho)) (Allen-Cunneen: the spread of prompt lengths lengthens the waits). Read
  as n separate M/G/1 queues, a pool of three serving heavy-tailed prompts at rho 0.57 was predicted to wait
  0.61 s on average; it waited 0.13 s. A request meets its TTFT when its wait and its own forward fit in the
  target (the first token comes with the KV).
- **Decode** is a continuously batched step loop: a step takes `fixed + per_request x batch` (the servers'
  fitted step line) and gives every member one token. A request stays for its answer's tokens, so by Little's
  law a server's mean batch B solves B = lambda / m x E[O] x step(B): B = lambda_m E[O] fixed / (1 - u) with
  u = lambda_m E[O] per_request (u >= 1: the batch grows without end). A request meets its TPOT when the steps
  it sees average under the target: the batch it shares is itself plus the others, Poisson of mean B
  (M/G/infinity), averaged over its own tokens against the batch's turnover (a long answer sees the mean,
  a short one the batch of its moment): a normal of mean fixed + per_request (B + 1) and variance
  per_request^2 B E[O] / (E[O] + O_i).
- **Decode room**: a decode server holds at most `decode_slots` requests at once (the KV room it reserves for
  each from the handshake on, or its running cap), each for its whole stay: the prefill's wait and forward,
  then its tokens. The pool is then also n x slots places (M/M/c per server: Erlang C again), and a request
  that finds them taken waits for one before its prefill starts (PD reserves the room first); that wait adds
  to its TTFT. Past the slots (the mean held at or over them) the pool is saturated, whatever its compute.
- **Attainment** is the mean over the mix's requests (its sampled shapes: the spread of prompt and answer
  lengths, not only their means) of P(TTFT ok) x P(TPOT ok). A saturated pool (rho or u >= `SATURATED`) serves
  nobody within its targets: its queue grows for as long as the split lasts.
- **A backlog** (requests already waiting on a pool) delays everyone who arrives until it clears: a request
  arriving while the backlog per server is longer than its target misses it. It clears at the pool's spare
  capacity, so the split that clears it fastest wins back the time the backlog would cost.
- **A move costs** its servers for the conversion's duration (`Costs`: drain and switch, measured per direction):
  the donor pool loses them at once, the other pool gains them at the end. `plan` values each split as the
  attainment it is predicted to deliver over the horizon, transition included, less nothing else: hysteresis is
  the cost of going and of coming back, not a rule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

PREFILL, DECODE = "prefill", "decode"
SATURATED = 0.98  # a pool this loaded is read as saturated (the queueing formulas diverge near 1)
MAX_SHAPES = 256  # request shapes a prediction averages over (a sample of the mix)
HEADROOM_STEPS = 10  # bisections of `headroom`'s [1/8, 8]: 64 times narrower, read to under 1%


@dataclass(frozen=True, slots=True)
class Mix:
    """What arrives and what it costs the servers, fleet-wide. Per-request costs are the servers' own
    measurements (seconds of prefill compute, decode tokens); `shapes` are the requests' sizes relative to the
    mean (prefill, decode), each pair one request, from the router's own counts (mean 1 on both sides)."""

    rate: float  # requests per second arriving
    prefill_s: float  # mean seconds of prefill compute per request
    decode_tokens: float  # mean tokens decoded per request
    step_fixed_s: float  # a decode step = fixed + per_request x batch
    step_per_request_s: float
    shapes: tuple[tuple[float, float], ...] = ((1.0, 1.0),)
    # the requests a decode server holds at once (KV room reserved from the handshake on, or its running cap):
    # a request waits for room when they are taken; inf: unbounded
    decode_slots: float = float("inf")
    waiting_prefill: float = 0.0  # requests waiting on prefill compute now (a backlog)
    # the share of its token budget (max_new_tokens) a request decodes, as last measured (the estimator's
    # calibration, kept from look to look; 1.0 until measured: requests read as running to their budget)
    answer_share: float = 1.0
    waiting_decode: float = 0.0  # requests waiting on decode (a batch slot, KV room, or an overgrown batch)

    def to_dict(self) -> dict:
        return {"rate": round(self.rate, 4), "prefill_s": round(self.prefill_s, 6),
                "decode_tokens": round(self.decode_tokens, 3), "step_fixed_s": round(self.step_fixed_s, 6),
                "step_per_request_s": round(self.step_per_request_s, 6), "shapes": len(self.shapes),
                "prefill_scv": round(scv(s for s, _ in self.shapes), 3),
                "decode_scv": round(scv(o for _, o in self.shapes), 3),
                "decode_slots": None if math.isinf(self.decode_slots) else round(self.decode_slots, 1),
                "waiting_prefill": round(self.waiting_prefill, 2), "waiting_decode": round(self.waiting_decode, 2),
                "answer_share": round(self.answer_share, 3)}


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_s: float
    tpot_s: float


@dataclass(frozen=True, slots=True)
class Prediction:
    """One split's steady state under the mix."""

    prefills: int
    decodes: int
    attainment: float  # share of requests predicted to meet both targets
    prefill_load: float  # rho
    decode_load: float  # u
    prefill_wait_s: float  # mean queueing wait (inf: saturated)
    decode_batch: float  # mean batch per decode server (inf: saturated)
    tpot_s: float  # mean step a request sees

    def to_dict(self) -> dict:
        def r(x: float) -> float | None:
            return None if math.isinf(x) else round(x, 4)
        return {"split": f"{self.prefills}P{self.decodes}D", "attainment": round(self.attainment, 4),
                "prefill_load": round(self.prefill_load, 3), "decode_load": round(self.decode_load, 3),
                "prefill_wait_s": r(self.prefill_wait_s), "decode_batch": r(self.decode_batch),
                "tpot_s": r(self.tpot_s)}


def scv(values) -> float:
    """Squared coefficient of variation (variance / mean^2) of `values`; 0 for fewer than two."""
    xs = list(values)
    if len(xs) < 2:
        return 0.0
    mean = sum(xs) / len(xs)
    if mean <= 0:
        return 0.0
    return sum((x - mean) ** 2 for x in xs) / len(xs) / (mean * mean)


def erlang_c(servers: int, offered: float) -> float:
    """The probability that an arrival waits in an M/M/n queue offered `offered` servers' worth of work."""
    if offered <= 0:
        return 0.0
    if offered >= servers:
        return 1.0
    term, total = 1.0, 1.0  # a^k / k!, summed for k < n
    for k in range(1, servers):
        term *= offered / k
        total += term
    last = term * offered / servers / (1.0 - offered / servers)
    return last / (total + last)


MAX_SLOTS_EXACT = 512  # more places than this: a wait for one is negligible (and Erlang C's sum is long)


def _wait_tail(p1: float, m1: float, p2: float, m2: float, t: float) -> float:
    """P(W1 + W2 > t) for two independent waits, each 0 with probability 1 - p and else exponential of mean m."""
    def one(p: float, m: float) -> float:
        return p * math.exp(-t / m) if p > 0 and m > 0 else 0.0
    tail = one(p1, m1) * (1 - p2) + one(p2, m2) * (1 - p1)
    if p1 > 0 and p2 > 0 and m1 > 0 and m2 > 0:
        both = (m1 * math.exp(-t / m1) - m2 * math.exp(-t / m2)) / (m1 - m2) if abs(m1 - m2) > 1e-12 \
            else (1 + t / m1) * math.exp(-t / m1)
        tail += p1 * p2 * both
    return min(1.0, tail)


def _normal_cdf(z: float) -> float:
    return 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))


def predict(mix: Mix, prefills: int, decodes: int, slo: Slo) -> Prediction:
    """The steady state of `prefills` P and `decodes` D servers under `mix` (see the module docstring)."""
    inf = float("inf")
    if prefills < 1 or decodes < 1:
        return Prediction(prefills, decodes, 0.0, inf, inf, inf, inf, inf)
    shapes = mix.shapes[:MAX_SHAPES] or ((1.0, 1.0),)
    mean_s = mix.prefill_s
    spread_s = sum(r * r for r, _ in shapes) / len(shapes) - 1.0  # scv of the prefill costs (shapes: mean 1)
    rho = mix.rate / prefills * mean_s
    u = mix.rate / decodes * mix.decode_tokens * mix.step_per_request_s
    fixed, per_request = mix.step_fixed_s, mix.step_per_request_s
    if rho >= SATURATED or u >= SATURATED:
        return Prediction(prefills, decodes, 0.0, rho, u, inf if rho >= SATURATED else 0.0,
                          inf if u >= SATURATED else 0.0, inf)
    waits = erlang_c(prefills, rho * prefills) if rho > 0 else 0.0
    when_waiting = (1.0 + max(0.0, spread_s)) / 2.0 * mean_s / (prefills * (1.0 - rho))
    wait = waits * when_waiting
    batch = mix.rate / decodes * mix.decode_tokens * fixed / (1.0 - u)
    step_seen = fixed + per_request * (batch + 1.0)
    room_waits, room_wait_s = 0.0, 0.0
    if not math.isinf(mix.decode_slots):
        stay = wait + mean_s + mix.decode_tokens * step_seen  # a request holds its room this long
        held = mix.rate / decodes * stay
        if held >= mix.decode_slots * SATURATED:
            return Prediction(prefills, decodes, 0.0, rho, u, wait, inf, inf)
        slots = max(1, int(mix.decode_slots))
        room_waits = erlang_c(slots, held) if slots <= MAX_SLOTS_EXACT else 0.0
        room_wait_s = stay / max(1e-9, slots - held)
    total = 0.0
    for r_prefill, r_decode in shapes:
        slack = slo.ttft_s - mean_s * r_prefill
        if slack < 0:
            continue
        p_ttft = 1.0 - _wait_tail(waits, when_waiting, room_waits, room_wait_s, slack)
        tokens = max(1.0, mix.decode_tokens * r_decode)
        spread = per_request * math.sqrt(batch * mix.decode_tokens / (mix.decode_tokens + tokens))
        if spread > 0:
            p_tpot = _normal_cdf((slo.tpot_s - step_seen) / spread)
        else:
            p_tpot = 1.0 if step_seen <= slo.tpot_s else 0.0
        total += p_ttft * p_tpot
    return Prediction(prefills, decodes, total / len(shapes), rho, u, wait, batch, step_seen)


def headroom(mix: Mix, prefills: int, decodes: int, slo: Slo, target: float) -> float:
    """How many times the arriving rate (the mix otherwise unchanged) the split takes before its predicted
    attainment falls under `target`: the slack a split keeps against a rate read low (a lull's few seconds)
    or rising. Under 1: it misses the target already. Read to a few percent (bisection), within [1/8, 8]."""
    def meets(k: float) -> bool:
        return predict(replace(mix, rate=mix.rate * k), prefills, decodes, slo).attainment >= target
    low, high = 0.125, 8.0
    if meets(high):
        return high
    if not meets(low):
        return low
    for _ in range(HEADROOM_STEPS):
        middle = math.sqrt(low * high)
        low, high = (middle, high) if meets(middle) else (low, middle)
    return low


# ---- over a horizon: backlogs, transitions, costs ----------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Costs:
    """What a move costs: the seconds its servers serve in neither pool (drain + switch), per direction."""

    to_prefill_s: float
    to_decode_s: float

    def of(self, direction: str) -> float:
        return self.to_prefill_s if direction == PREFILL else self.to_decode_s


def _late_secs(backlog_s: float, servers: int, growth: float, secs: float, target_s: float) -> tuple[float, float]:
    """Over `secs` with `servers` servers, of a pool holding `backlog_s` server-seconds of queued work that grows
    by `growth` per second (arrivals' work less the pool's capacity, negative when it clears): how long a new
    arrival waits longer than `target_s` behind the backlog, and the backlog left at the end."""
    limit = servers * target_s  # the backlog a newcomer can wait behind and still meet its target
    left = max(0.0, backlog_s + growth * secs)
    if growth == 0:
        late = secs if backlog_s > limit else 0.0
    elif growth > 0:
        late = secs - min(secs, max(0.0, (limit - backlog_s) / growth))
    else:
        late = min(secs, max(0.0, (backlog_s - limit) / -growth))
    return late, left


@dataclass(frozen=True, slots=True)
class Segment:
    secs: float
    prefills: int  # routable in the segment
    decodes: int


def _backlogs(mix: Mix) -> tuple[float, float, float]:
    """The backlogs now, in server-seconds of work (prefill, decode), and a request's marginal decode work."""
    per_decode = mix.decode_tokens * mix.step_per_request_s  # a request's marginal decode work
    if not math.isinf(mix.decode_slots) and mix.decode_slots > 0:  # or its share of a server's room
        per_decode = max(per_decode, (mix.prefill_s + mix.decode_tokens * (mix.step_fixed_s + mix.step_per_request_s))
                         / mix.decode_slots)
    return mix.waiting_prefill * mix.prefill_s, mix.waiting_decode * per_decode, per_decode


def _pools(mix: Mix, seg: Segment, per_decode: float) -> tuple[tuple[int, float], tuple[int, float]]:
    """Each pool's servers in `seg` and how fast its backlog grows there (the arrivals' work per second less the
    servers; negative: it clears), prefill then decode."""
    return ((seg.prefills, mix.rate * mix.prefill_s - seg.prefills),
            (seg.decodes, mix.rate * per_decode - seg.decodes))


def recovery_secs(mix: Mix, segments: list[Segment], slo: Slo) -> float:
    """When, from now, the backlogs stop making arrivals late (0: they do not; inf: never), the last segment's
    split lasting on past its end."""
    backlog_p, backlog_d, per_decode = _backlogs(mix)
    start, late_until = 0.0, 0.0
    for index, seg in enumerate(segments):
        secs = math.inf if index == len(segments) - 1 else seg.secs
        (servers_p, growth_p), (servers_d, growth_d) = _pools(mix, seg, per_decode)
        for backlog, servers, growth in ((backlog_p, servers_p, growth_p), (backlog_d, servers_d, growth_d)):
            over = backlog - servers * slo.ttft_s  # past what a newcomer can wait behind
            if growth < 0 and over > 0:  # late until it clears
                late_until = max(late_until, start + min(secs, over / -growth))
            elif growth > 0 and -over / growth < secs:  # late from when it grows past the limit to the end
                late_until = max(late_until, start + secs)
            elif growth == 0 and over > 0:
                late_until = max(late_until, start + secs)
        if math.isinf(secs):
            break
        _, backlog_p = _late_secs(backlog_p, servers_p, growth_p, secs, slo.ttft_s)
        _, backlog_d = _late_secs(backlog_d, servers_d, growth_d, secs, slo.ttft_s)
        start += secs
    return late_until


def value(mix: Mix, segments: list[Segment], slo: Slo) -> tuple[float, float]:
    """The attainment predicted over `segments` (time-weighted), the backlogs now included: a request arriving
    while a backlog per server exceeds its target is late; and the wait behind the backlogs left at their end
    (the longer of the two pools': their queued work over their servers)."""
    total_secs = sum(s.secs for s in segments)
    if total_secs <= 0:
        return 0.0, 0.0
    backlog_p, backlog_d, per_decode = _backlogs(mix)
    good = 0.0
    for seg in segments:
        p = predict(mix, seg.prefills, seg.decodes, slo)
        (servers_p, growth_p), (servers_d, growth_d) = _pools(mix, seg, per_decode)
        late_p, backlog_p = _late_secs(backlog_p, servers_p, growth_p, seg.secs, slo.ttft_s)
        late_d, backlog_d = _late_secs(backlog_d, servers_d, growth_d, seg.secs, slo.ttft_s)
        good += p.attainment * max(0.0, seg.secs - max(late_p, late_d))
    last = segments[-1]
    return good / total_secs, max(_per_server(backlog_p, last.prefills), _per_server(backlog_d, last.decodes))


def _per_server(backlog_s: float, servers: int) -> float:
    if backlog_s <= 0:
        return 0.0
    return backlog_s / servers if servers else math.inf


@dataclass(frozen=True, slots=True)
class Candidate:
    """A split the fleet could move to, and what the model says of it."""

    prefills: int
    decodes: int
    moves: int  # servers converted (0: hold)
    direction: str | None  # the pool the moved servers go to
    steady: float  # attainment of the split once reached
    value: float  # attainment over the horizon, the transition included
    cost_s: float  # how long the moved servers serve in neither pool
    horizon_s: float = 0.0  # what `value` is over (`plan`'s horizon, after the quickest recovery from a backlog)
    # the wait behind the backlogs left at the horizon's end (`value`): where no split serves the workload, the
    # least of it serves the most requests and recovers first when the load eases
    behind_s: float = 0.0

    def to_dict(self) -> dict:
        return {"split": f"{self.prefills}P{self.decodes}D", "moves": self.moves, "to": self.direction,
                "steady": round(self.steady, 4), "value": round(self.value, 4), "cost_s": round(self.cost_s, 2),
                "horizon_s": round(self.horizon_s, 1),
                "behind_s": None if math.isinf(self.behind_s) else round(self.behind_s, 2)}


# The horizon starts after the quickest recovery from the backlogs now, if that comes within this many horizons
# (a bound on the arithmetic: past it, or never, the horizon starts now and every split is as late as the next).
MAX_RECOVERY_HORIZONS = 10.0


def plan(mix: Mix, prefills: int, decodes: int, slo: Slo, costs: Costs, horizon_s: float, *,
         min_prefill: int = 1, min_decode: int = 1, arriving: tuple[str, int, float] | None = None,
         ) -> list[Candidate]:
    """Every split within the floors, and holding, valued over `horizon_s` from now, best first (holding wins
    ties). The fleet has `prefills` and `decodes` routable servers; `arriving` = (pool, count, seconds left) for servers
    of ours already on their way into a pool: every split counts them, and a split that moves more does so
    alongside them (the other way would undo them: not offered).

    The horizon is counted from the quickest recovery from the backlogs now (`recovery_secs` of the split that
    clears them first): over a horizon from now, a backlog longer than it makes every split late all of it, and
    holding that never recovers values as a move that recovers just after it (0 both)."""
    total = prefills + decodes
    arrive_pool, arrive_n, arrive_s = arriving if arriving else (None, 0, 0.0)
    splits = []
    for final_p in range(0, total + arrive_n + 1):
        final_d = total + arrive_n - final_p
        now_p = prefills + (arrive_n if arrive_pool == PREFILL else 0)
        moves = final_p - now_p
        if moves and (final_p < min_prefill or final_d < min_decode):
            continue  # holding is always a candidate, even below floors raised since (it is what a move beats)
        direction = PREFILL if moves > 0 else DECODE if moves < 0 else None
        if arrive_n and direction not in (None, arrive_pool):
            continue
        k = abs(moves)
        if k > (decodes if direction == PREFILL else prefills):
            continue
        splits.append((final_p, final_d, k, direction, costs.of(direction) if direction else 0.0))

    def segments_of(final_p: int, final_d: int, k: int, direction: str | None, cost: float,
                    horizon: float) -> list[Segment]:
        segments = []
        # those of ours on their way arrive first (their time left), then the moves made now
        base_p, base_d = prefills, decodes
        if arrive_n and arrive_s > 0:
            take_p = base_p - (k if direction == DECODE else 0)
            take_d = base_d - (k if direction == PREFILL else 0)
            segments.append(Segment(min(arrive_s, horizon), take_p, take_d))
        after_arrival_p = base_p + (arrive_n if arrive_pool == PREFILL else 0)
        after_arrival_d = base_d + (arrive_n if arrive_pool == DECODE else 0)
        spent = sum(s.secs for s in segments)
        if k:
            mid_p = after_arrival_p - (k if direction == DECODE else 0)
            mid_d = after_arrival_d - (k if direction == PREFILL else 0)
            segments.append(Segment(max(0.0, min(cost, horizon) - spent), mid_p, mid_d))
            spent = sum(s.secs for s in segments)
        segments.append(Segment(max(0.0, horizon - spent), final_p, final_d))
        return [s for s in segments if s.secs > 0]

    recovery = min((recovery_secs(mix, segments_of(*split, math.inf), slo) for split in splits), default=0.0)
    horizon = horizon_s + (recovery if recovery <= horizon_s * MAX_RECOVERY_HORIZONS else 0.0)
    out = []
    for split in splits:
        v, behind = value(mix, segments_of(*split, horizon), slo)
        final_p, final_d, k, direction, cost = split
        steady = predict(mix, final_p, final_d, slo).attainment
        out.append(Candidate(final_p, final_d, k, direction, steady, v, cost, horizon, behind))
    out.sort(key=lambda c: (-c.value, c.moves))
    return out


@dataclass(frozen=True, slots=True)
class Choice:
    """The split `plan` picks, against holding."""

    best: Candidate
    hold: Candidate
    candidates: list[Candidate] = field(default_factory=list)

    @property
    def gain(self) -> float:
        return self.best.value - self.hold.value
