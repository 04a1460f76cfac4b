"""The rebalancer's view of the fleet and the pressure it reads on each pool (pure; no I/O).

Which signal stands for which bottleneck, and why (SGLang 0.5.23's queues: docs/SGLANG_LOADS.md). Each term is
a ratio to its target, 1.0 = at target; a pool's pressure is its largest term.

Prefill pool: its capacity is prefill compute (one forward at a time per server).
- `queue`: requests waiting for a prefill forward, per prefill server / `queue_target`. Counted where they
  are: the prefill servers' waiting queues (`queues.waiting`), or, when larger, the decode servers' transfer
  queues less the prefills' inflight ones: a decode request in its transfer queue has its KV room and waits
  for the prefill to compute its KV. 0.5.23 adds those to the decode's `num_waiting_reqs`; read as decode
  load they make a prefill-short fleet look decode-short too, and nothing ever moves to prefill. (The
  prefills' own count misses the batch of a forward in progress: the row shown is the one published before
  it.) The decode rows' transfers count only up to what the prefills still have: the prefill legs the
  router has open on them (a 0.5.23 prefill answers its leg once the KV went out: a fresh count), less those
  waiting for decode room (the prefills' bootstrap queues or the decodes' prealloc queues, whichever side's
  rows are the fresher: each side's row is up to a batch old; `waiting_for_room`). A 0.5.23 decode running
  batches publishes its row every 15 steps: the requests it admitted in that step sit in that row's transfer
  queue for 14 more, long after their KV came.
  Read as prefill load, the transfers of a decode-heavy fleet whose requests finish together (and whose
  successors are admitted together) looked prefill-short right after a server moved to decode, and the
  rebalancer moved it straight back (seen on real servers). (With router replicas the leader counts only its
  own legs: the decode rows then count for less, the prefills' queues as much.)
- `busy`: the prefill servers' mean share of time in forwards (`total_prefill_busy_us` between two polls) /
  `busy_target`: saturation before a queue builds.
- `ttft`: the router's p90 time to first token / `ttft_target_secs`, when prefill is where requests wait.

Decode pool: its capacity is decode KV room and decode compute (a continuously batched step loop).
- `queue`: requests waiting for decode capacity, per decode server / `queue_target`: the decode waiting queue
  (KV arrived, no place in the batch), the prealloc requests whose handshake is done (`queues.prealloc_ready`:
  waiting for KV room) and the retracted ones. (A prefill's bootstrap queue holds the same requests seen from
  the prefill side: it is not counted again.) When the room they wait for is held by the decode's transfer
  queue (reserved for KV a prefill has still to compute), they wait on prefill: a prealloc request counts for
  prefill in the share of the decode's KV holders that are in its transfer queue. Seen on real 0.5.23 with long
  prompts: a 4096-token decode pool admits two 1500-token requests; both wait for their prefill, and every other
  request waits for their room.
- `kv`: the decode servers' KV in use for their own work (`num_active_tokens`: without the room reserved for
  KV still to come from a prefill, which is the prefill's doing) / `kv_target`.
- `itl`: the time between tokens / `itl_target_secs`: the servers' own mean decode step over the steps they
  last published (`decode_moments`; a 0.5.23 decode publishes every 15 steps, and a row that has aged since
  bounds the step from below: the load monitor), else the router's p90 inter-token latency, and only while
  the decode pool has requests (a latency left from an earlier phase is not charged to a pool that is idle
  now); or, when larger, the step predicted for the batches open now: the decode legs the router has open
  less its prefill legs, per decode server, through each server's step line fitted on its moments
  (`step_now`). The rows lag most when it matters most: an overloaded decode's batch grows, its steps grow
  longer, and 15 of them took 15 s on the benchmark's fleet; the router's counts are current. What a step
  says of the load holds in a steady state; past saturation the batch grows and the load that arrives is
  larger than the step's (`decode_overload`, from the router's counts): the predictions read that one.
- `ttft`: as above, when decode is where requests wait.

TTFT has two causes in PD (waiting for a prefill forward, or for decode KV room or a batch slot), so it is
charged only to a pool whose waiting requests clearly outnumber the other's (at least `TTFT_MIN_WAITING` and
twice as many): never on a tie (0 vs 0 included), never flipped by one request, never to a pool with nothing
waiting now (a slow first token from the previous phase, with its queue gone, is nobody's).

A server that does not send the breakdown (no `disaggregation` / `queues` sections) is read conservatively:
its `num_waiting_reqs` counts for its own pool.
"""

from __future__ import annotations

from dataclasses import dataclass

from .rebalance_config import RebalanceConfig

PREFILL, DECODE = "prefill", "decode"
TTFT_MIN_WAITING = 2  # requests waiting before TTFT is charged to a pool


@dataclass(frozen=True, slots=True)
class WorkerView:
    """One routable server as the rebalancer sees it. Reported figures are None when the server does not send
    them; `waiting` is 0.5.23's `num_waiting_reqs` (its meaning depends on the role), the others its parts."""

    id: str
    inflight: int = 0  # the router's own count
    running: int | None = None
    waiting: int | None = None
    kv_usage: float | None = None  # token_usage
    convertible: bool = True  # healthy, breaker closed, no recent failed conversion
    waiting_queue: int | None = None  # queues.waiting
    bootstrap: int | None = None  # prefill: waiting for the decode side
    inflight_queue: int | None = None  # prefill: KV being sent
    prealloc: int | None = None  # decode: handshake or waiting for KV room
    prealloc_ready: int | None = None  # decode: handshake done, waiting for KV room
    transfer: int | None = None  # decode: KV room taken, waiting for the prefill's KV
    retracted: int | None = None
    own_kv_usage: float | None = None  # num_active_tokens / capacity
    used_tokens: int | None = None
    prefill_busy: float | None = None  # share of time in prefill forwards since the last poll
    decode_step_s: float | None = None  # mean decode step since the last poll
    decode_batch: float | None = None
    decode_step_fixed_s: float | None = None  # a decode step = fixed + per_request x batch (fitted)
    decode_step_per_request_s: float | None = None
    row_age_s: float | None = None  # how old the row it reported was when it answered
    started: int = 0  # the router's count of requests it sent to the server (since it was registered)
    max_running: int | None = None  # the most it runs at once (max_running_requests, summed over ranks)
    busy_total_s: float | None = None  # prefill: seconds in forwards since the server started (cumulative)
    tokens_total: float | None = None  # decode: tokens decoded since the server started (decode_moments)

    @property
    def busy(self) -> int:
        """Requests on it: the router's count, or the server's when it reports more (traffic of others)."""
        reported = (self.running or 0) + (self.waiting or 0) + (self.inflight_queue or 0)
        return max(self.inflight, reported)

    @property
    def cost(self) -> tuple:
        """How dear it is to take out of its pool: requests in flight or queued, then the KV it holds (what a
        drain waits for), then its id (a stable order)."""
        return (self.busy, self.used_tokens or 0, self.id)


@dataclass(frozen=True, slots=True)
class Observation:
    now: float
    prefill: tuple[WorkerView, ...]  # routable servers only
    decode: tuple[WorkerView, ...]
    ttft_s: float | None = None  # p90 over the window (failed and abandoned requests included)
    itl_s: float | None = None
    samples: int = 0
    busy: str | None = None  # what conversion is in progress, if any
    converting_into: tuple[str, ...] = ()  # roles that conversions in progress move servers into
    pending: tuple[str, ...] = ()  # roles with servers not read yet (they may still join their pool)
    joining: tuple[str, ...] = ()  # the role each of the rebalancer's own conversions in progress moves into
    others_busy: str | None = None  # the conversions in progress that are not the rebalancer's (an operator's)
    # the requests that arrived in the window as the router saw them (arrived at, prompt size, answer size): in
    # its own units (tokens when it has them, else a proxy); only ratios of sizes count (rebalance_estimate)
    request_sizes: tuple[tuple[float, float, float], ...] = ()
    finished_sizes: tuple[tuple[float, float], ...] = ()  # (prompt, answer) of the requests that ended in it

    def pool(self, role: str) -> tuple[WorkerView, ...]:
        return self.prefill if role == PREFILL else self.decode


def _total(values) -> int | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def blocked_share(w: WorkerView) -> float:
    """Of a decode server's KV holders, the share in its transfer queue: their room is reserved for KV a
    prefill has still to compute. Requests waiting for KV room behind them wait on prefill as much."""
    holders = (w.transfer or 0) + (w.running or 0) + (w.waiting_queue or 0)
    return (w.transfer or 0) / holders if holders else 0.0


def _ready(w: WorkerView) -> float:
    return w.prealloc_ready if w.prealloc_ready is not None else (w.prealloc or 0)


# Rows published this close together are equally current (0.5.23 republishes a stalled scheduler's every 50 ms).
SAME_AGE_S = 0.05


def waiting_for_room(obs: Observation) -> int:
    """The requests waiting for decode KV room. The prefills' bootstrap queues and the decodes' prealloc queues
    hold the same requests, each side's row up to a batch old (a prefill's during a long forward, a decode's
    while it runs batches: 0.5.23 republishes it every 15 steps): the count of the side whose rows are the
    fresher, by the rows' ages. The smaller count when the ages do not tell: the requests a stale row lists
    have mostly moved on. Not always: on a decode-heavy fleet a decode row published in the step that admitted
    its batch lists none waiting for room, while the current prefill row shows the six that do; read as
    pipeline, they made a decode-short fleet look prefill-short (the simulated fleet's CI failure)."""
    sides = []
    for pool, count in ((obs.prefill, lambda w: w.bootstrap), (obs.decode, lambda w: w.prealloc)):
        reporting = [w for w in pool if count(w) is not None]
        if reporting:
            ages = [w.row_age_s for w in reporting]
            sides.append((sum(count(w) for w in reporting), None if None in ages else max(ages)))
    if not sides:
        return 0
    if len(sides) == 2 and None not in (sides[0][1], sides[1][1]) and abs(sides[0][1] - sides[1][1]) > SAME_AGE_S:
        return min(sides, key=lambda side: side[1])[0]
    return min(total for total, _ in sides)


def waiting_parts(obs: Observation) -> dict[str, float | None]:
    """The counts waiting on prefill compute, by where they are seen (see the module docstring):
    `prefill_queue` in the prefills' own waiting queues; `pipeline` the requests the prefills still have
    beyond those waiting for decode room (the prefill legs the router has open on them, less
    `waiting_for_room`): waiting, in a forward, or sending their KV;
    `decode_transfer` the decodes' transfers a prefill still has (up to `pipeline`), less the prefills'
    inflight queues; `behind_transfers` the prealloc requests whose room those transfers hold;
    `uncounted_transfer` the transfers the decode rows show beyond the pipeline (their KV came since the row was
    published): counted for nobody, and the room they hold is the decode's own."""
    own = []
    for w in obs.prefill:
        if w.waiting_queue is not None:
            own.append(w.waiting_queue)
        elif w.waiting is not None:  # no breakdown: its waiting count, less what waits on decode if known
            own.append(max(0, w.waiting - (w.bootstrap or 0)))
    shown = _total(w.transfer for w in obs.decode)
    sent = _total(w.inflight_queue for w in obs.prefill) or 0
    pipeline = max(0, sum(w.inflight for w in obs.prefill) - waiting_for_room(obs))
    real = None if shown is None else min(shown, max(pipeline, sum(own) + sent))
    share = 1.0 if not shown else real / shown
    return {
        "prefill_queue": sum(own) if own else None,
        "pipeline": pipeline,
        "decode_transfer": None if real is None else max(0, real - sent),
        "behind_transfers": share * sum(_ready(w) * blocked_share(w) for w in obs.decode if w.prealloc is not None),
        "uncounted_transfer": None if shown is None else shown - real,
        "share": share,
    }


def waits_on_prefill(obs: Observation) -> float | None:
    """Requests waiting for prefill compute (see the module docstring); None: nothing tells."""
    parts = waiting_parts(obs)
    mine, seen_from_decode = parts["prefill_queue"], parts["decode_transfer"]
    if seen_from_decode is None:
        return mine
    return max(mine or 0, seen_from_decode) + parts["behind_transfers"]


def waits_on_decode(obs: Observation) -> float | None:
    """Requests waiting for decode KV room or a batch slot (see the module docstring); None: nothing tells."""
    parts = []
    share = waiting_parts(obs)["share"]
    for w in obs.decode:
        if w.waiting_queue is not None or w.prealloc is not None:
            # behind transfers no prefill has any more, the room they wait for is the decode's own
            ready = _ready(w) * (1 - blocked_share(w) * share)
            parts.append((w.waiting_queue or 0) + ready + (w.retracted or 0))
        elif w.waiting is not None:  # no breakdown: its whole waiting count is read as its own
            parts.append(w.waiting)
    return sum(parts) if parts else None


def _mean(values) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def decoding_now(obs: Observation) -> int:
    """Requests decoding (or waiting for a batch slot) now, by the router's own counts: the decode legs it has
    open less the prefill legs (a request whose prefill leg is open waits for its KV, not for decode)."""
    return max(0, sum(w.inflight for w in obs.decode) - sum(w.inflight for w in obs.prefill))


def step_line(obs: Observation) -> tuple[float, float] | None:
    """The decode pool's step line (fixed, per request): the mean of its servers' fitted lines (None: no fit)."""
    fits = [(w.decode_step_fixed_s, w.decode_step_per_request_s) for w in obs.decode
            if w.decode_step_fixed_s is not None and w.decode_step_per_request_s is not None]
    if not fits:
        return None
    return sum(f for f, _ in fits) / len(fits), sum(p for _, p in fits) / len(fits)


def step_now(obs: Observation) -> float | None:
    """The decode step the batches the router has open now take, by the servers' fitted step line (None: no fit
    yet). Current where the reported step is not: a decode republishes its row every 15 steps, and a batch
    that grew takes longer steps, so its row is the older the more it is overloaded. (With router replicas
    the leader counts only its own legs: the prediction then falls short, and the rows' step stands.)"""
    line = step_line(obs)
    if line is None:
        return None
    fixed, per_request = line
    return fixed + per_request * decoding_now(obs) / len(obs.decode)


def ttft_charged_to(wp: float | None, wd: float | None) -> str | None:
    """The pool a slow first token is charged to: the one whose waiting requests clearly dominate."""
    wp, wd = wp or 0, wd or 0
    if wp >= TTFT_MIN_WAITING and wp >= 2 * wd:
        return PREFILL
    if wd >= TTFT_MIN_WAITING and wd >= 2 * wp:
        return DECODE
    return None


def pool_terms(obs: Observation, config: RebalanceConfig) -> tuple[dict[str, float], dict[str, float], dict]:
    """Both pools' terms, and how they were read (`notes`: the waiting counts and where TTFT went)."""
    prefill: dict[str, float] = {}
    decode: dict[str, float] = {}
    wp, wd = waits_on_prefill(obs), waits_on_decode(obs)
    if wp is not None and obs.prefill:
        prefill["queue"] = wp / len(obs.prefill) / config.queue_target
    if wd is not None and obs.decode:
        decode["queue"] = wd / len(obs.decode) / config.queue_target
    busy = _mean(w.prefill_busy for w in obs.prefill)
    if busy is not None:
        prefill["busy"] = busy / config.busy_target
    kv = _mean(w.own_kv_usage if w.own_kv_usage is not None else w.kv_usage for w in obs.decode)
    if kv is not None:
        decode["kv"] = kv / config.kv_target
    steps = [(w.decode_step_s, w.decode_batch or 1.0) for w in obs.decode if w.decode_step_s is not None]
    decoding = sum((w.running or 0) + w.inflight for w in obs.decode) > 0 or (wd or 0) > 0
    if steps:
        weight = sum(b for _, b in steps)
        decode["itl"] = sum(s * b for s, b in steps) / weight / config.itl_target_secs
    elif obs.itl_s is not None and decoding:
        decode["itl"] = obs.itl_s / config.itl_target_secs
    now = step_now(obs)
    if now is not None and now / config.itl_target_secs > decode.get("itl", 0.0):
        decode["itl"] = now / config.itl_target_secs
    charged = ttft_charged_to(wp, wd)
    if obs.ttft_s is not None and charged is not None:
        (prefill if charged == PREFILL else decode)["ttft"] = obs.ttft_s / config.ttft_target_secs
    line = step_line(obs)
    notes = {"waiting_on_prefill": wp, "waiting_on_decode": wd, "ttft_charged_to": charged,
             "decode_step_fixed_s": line[0] if line else None,
             "prefill_parts": {k: None if v is None else round(v, 3) for k, v in waiting_parts(obs).items()}}
    return prefill, decode, notes


SATURATED = 0.95  # a decode this busy (the per-request part of its steps) is read as saturated
MAX_OVERLOAD = 4.0  # arrivals read as at most this many times the completions (a pool barely completing any)


def decode_counts(obs: Observation) -> tuple[int, int, int]:
    """What `decode_overload` compares between two looks: the requests decoding now (the router's counts), the
    requests ever sent to the decode pool's servers, and how many servers it has."""
    return decoding_now(obs), sum(w.started for w in obs.decode), len(obs.decode)


def decode_overload(now: tuple[int, int, int], before: tuple[int, int, int], elapsed_s: float) -> float:
    """How many times its completions the decode pool's arrivals are, between two looks at the same servers
    (1.0: it keeps up). A step, 1 - fixed / step per request, tells the utilisation of the batch the decodes
    run now; past saturation that batch grows look after look and never settles, so the step says too little:
    a 2P6D fleet turned decode-heavy ran 2 decodes at steps ten times their fixed part (u 0.9) while 2.04
    times their capacity arrived. By Little's law the batch's utilisation is the completions' (batch / time in
    it), so the arrivals' is u x arrivals / completions, and completions are arrivals less the batch's
    growth."""
    decoding, started, servers = now
    decoding_before, started_before, servers_before = before
    if elapsed_s <= 0 or servers != servers_before:
        return 1.0
    arrivals = (started - started_before) / elapsed_s
    growth = (decoding - decoding_before) / elapsed_s
    if arrivals <= 0 or growth <= 0:
        return 1.0
    completions = arrivals - growth
    return MAX_OVERLOAD if completions * MAX_OVERLOAD <= arrivals else arrivals / completions


def step_after(step_s: float, fixed_s: float, scale: float, overload: float = 1.0) -> float:
    """A decode step once each server's load is `scale` times what it is, by the step line (fixed + per
    request x batch): the steps' per-request share is the utilisation u = 1 - fixed / step, which scales with
    the load, and a step is fixed / (1 - u) in a steady state. Past saturation, longer in proportion. With
    `overload` (`decode_overload`), the utilisation is that of what arrives, not of the batch running now."""
    util = (max(0.0, 1.0 - fixed_s / step_s) if step_s > 0 else 0.0) * overload
    scaled = util * scale
    if scaled <= 0:
        return step_s  # nothing of it is per request
    if scaled < SATURATED:
        return fixed_s / (1.0 - scaled)
    return fixed_s / (1.0 - SATURATED) * scaled / SATURATED


def pool_after(terms: dict[str, float], n: int, n_new: int, fixed_s: float | None = None,
               itl_target_s: float | None = None, overload: float = 1.0) -> float:
    """A pool's pressure with n_new servers instead of n: each term proportional to the load per server,
    except decode latency with a fitted step line (`step_after`). Proportional, a latency near saturation
    looked nearly linear: a 2P2D fleet serving a steady mix at half its decodes' capacity read 1D as 1.03,
    and moved a decode to prefill that 1D could not serve (it saturated, and the rebalancer flapped)."""
    worst = 0.0
    for name, value in terms.items():
        if name == "itl" and fixed_s and itl_target_s and value > 0:
            value = step_after(value * itl_target_s, fixed_s, n / n_new, overload) / itl_target_s
        else:
            value = value * n / n_new
        worst = max(worst, value)
    return worst
