"""The rebalancer's view of the fleet, and which queue waits on which pool (pure; no I/O).

`Observation` is what the decision core sees at a look: each routable server's report and the router's own
counts (`WorkerView`), the conversions under way, and the sizes of recent requests. The fleet model
(policies/fleet_model.py) reads its work from counters (policies/rebalance_estimate.py); what it reads here is
the backlog: the requests waiting on each pool now, counted where they wait (SGLang 0.5.23's queues:
docs/SGLANG_LOADS.md).

Waiting on prefill compute (`waits_on_prefill`): the prefill servers' waiting queues (`queues.waiting`), or,
when larger, the decode servers' transfer queues less the prefills' inflight ones: a decode request in its
transfer queue has its KV room and waits for the prefill to compute its KV. 0.5.23 adds those to the decode's
`num_waiting_reqs`; read as decode load they make a prefill-short fleet look decode-short too. (The prefills'
own count misses the batch of a forward in progress: the row shown is the one published before it.) The decode
rows' transfers count only up to what the prefills still have: the prefill legs the router has open on them (a
0.5.23 prefill answers its leg once the KV went out: a fresh count), less those waiting for decode room (the
prefills' bootstrap queues or the decodes' prealloc queues, whichever side's rows are the fresher:
`waiting_for_room`). A 0.5.23 decode running batches publishes its row every 15 steps: the requests it admitted
in that step sit in that row's transfer queue for 14 more, long after their KV came. Requests waiting for KV
room held by transfers wait on prefill as much (`blocked_share`).

Waiting on decode (`waits_on_decode`): the decode waiting queue (KV arrived, no place in the batch), the
prealloc requests whose handshake is done (`queues.prealloc_ready`: waiting for KV room) and the retracted ones.
(A prefill's bootstrap queue holds the same requests seen from the prefill side: it is not counted again.)

A server that does not send the breakdown (no `disaggregation` / `queues` sections) is read conservatively:
its `num_waiting_reqs` counts for its own pool.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


PREFILL, DECODE = "prefill", "decode"


@dataclass(frozen=True, slots=True)
class WorkerView:
    """One routable server as the rebalancer sees it. Reported figures are None when the server does not send
    them; `waiting` is 0.5.23's `num_waiting_reqs` (its meaning depends on the role), the others its parts."""

    id: str
    inflight: int = 0  # the router's own count
    running: int | None = None
    waiting: int | None = None
    convertible: bool = True  # healthy, breaker closed, no recent failed conversion
    waiting_queue: int | None = None  # queues.waiting
    bootstrap: int | None = None  # prefill: waiting for the decode side
    inflight_queue: int | None = None  # prefill: KV being sent
    prealloc: int | None = None  # decode: handshake or waiting for KV room
    prealloc_ready: int | None = None  # decode: handshake done, waiting for KV room
    transfer: int | None = None  # decode: KV room taken, waiting for the prefill's KV
    retracted: int | None = None
    used_tokens: int | None = None
    decode_step_s: float | None = None  # mean decode step since the last poll
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

    def to_dict(self) -> dict:
        """As JSON takes it (`from_dict` gives it back, equal): a live run's observations, recorded and
        replayed through the decision core (bench/replay.py)."""
        return asdict(self)

    @staticmethod
    def from_dict(doc: dict) -> "Observation":
        def views(rows) -> tuple[WorkerView, ...]:
            return tuple(WorkerView(**row) for row in rows)

        def rows(items) -> tuple[tuple[float, ...], ...]:
            return tuple(tuple(item) for item in items)
        return Observation(**{**doc, "prefill": views(doc["prefill"]), "decode": views(doc["decode"]),
                              "converting_into": tuple(doc.get("converting_into", ())),
                              "pending": tuple(doc.get("pending", ())), "joining": tuple(doc.get("joining", ())),
                              "request_sizes": rows(doc.get("request_sizes", ())),
                              "finished_sizes": rows(doc.get("finished_sizes", ()))})


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
