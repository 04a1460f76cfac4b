"""The P/D rebalancer's decision core: `decide(observation, state, config) -> Decision`, pure (no I/O), the same
live (router/flows/rebalancer.py), in replay (bench/replay.py) and in tests. It chooses the split of the fleet
that a model fitted to it predicts serves the operator's SLOs best. One look:

1. **Refill an empty pool** (`refill`). When one pool has no routable server left (its servers died, failed or
   were removed) and the other can spare one, convert the cheapest of the other pool at once: no model, warm-up
   or guard is waited for (with no prefill, or no decode, nothing is served at all). Drain mode when the chosen
   server has nothing in flight, else abort mode (its requests are aborted and re-sent by the router). Held
   only while a conversion into that pool is already under way, while servers of that role are still being
   read at start-up, or when the other pool has a single server.
2. **Fit the model** (`rebalance_estimate.fit`): what arrives and what it costs, from the counters between this
   look and the last ones within `window_secs` (the router's requests sent and open on each server, the
   prefills' forward seconds, the decodes' tokens and step lines), the backlogs the signals read
   (`rebalance_signals`: which queue waits on which pool) and the spread of request sizes the router saw; what
   arrives read since a change of the mix when there was one (`rebalance_change.read_change`).
3. **Value every split** (`fleet_model.plan`): each split within the floors, its predicted SLO attainment (the
   share of requests meeting both the TTFT and the TPOT target) over `horizon_secs`, the backlogs now and the
   conversions' cost (their measured duration per direction) included. Several servers move at once when the
   best split is several away.
4. **Choose**: the move best at its worst within the fit's spread (`most_robust`), unless holding is predicted
   to meet `attainment_target` already, the move gains less than `min_gain` over holding, or it would lose to
   holding at either end of the spread. The split changes
   for the workload (its steady attainment must gain too), not for a backlog alone. Hysteresis is the
   model's: a move costs its conversion's duration, and a move back costs it again.
5. **Guards** (`rebalance_guards`), each a small named function, for what is not the model's job.

Each decision carries the model's reading (`Decision.model`): the fitted mix, every candidate split with its
steady attainment, its value over the horizon and the cost it was charged, and why the choice was made. The
server moved is the cheapest of the donor pool (`WorkerView.cost`: the quickest drain), never a doubted one;
a decode moved to prefill (with `conversion_mode` drain) is emptied in `shed` mode: its requests still waiting
on a prefill are re-sent elsewhere (they wait on the very backlog the move is to relieve), those decoding
finish where they are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace

from . import rebalance_guards as guards
from .fleet_model import Costs, Mix, Slo, headroom, plan, predict
from .rebalance_config import RebalanceConfig, RebalanceMode, UnknownFields
from .rebalance_estimate import MAX_INTERVALS, counters, fit, interval, overgrown_batch
from .rebalance_signals import DECODE, PREFILL, Observation, WorkerView

__all__ = ["GUARDS", "Decision", "Observation", "RebalanceConfig", "RebalanceMode", "RebalanceState",
           "UnknownFields", "WorkerView", "conversion_ended", "decide", "initial_state", "refill"]

# Guard names (a fixed catalogue, so that metrics and logs can count them): the model core's and the refill's.
NO_SIGNAL, WARMUP, BUSY, FAILURE_COOLDOWN, NO_CANDIDATE = (guards.NO_SIGNAL, guards.WARMUP, guards.BUSY,
                                                           guards.FAILURE_COOLDOWN, guards.NO_CANDIDATE)
FLOOR = "floor"
REFILLING = "refilling"
PENDING = "pending"
GUARDS = (NO_SIGNAL, WARMUP, BUSY, FAILURE_COOLDOWN, NO_CANDIDATE, FLOOR, REFILLING, PENDING)
RECENT_CONVERSIONS = 5  # conversions per direction whose durations a move's cost averages
# the standard errors of the fitted mix its spread's ends lie at: the choice must hold there. At one, the truth
# fell beyond an end on first readings of a few seconds of heavy-tailed sizes, whose sample is as short of the
# tail in its noise as in its mean (tails6 read its prompts 1.2 of them low at a start, moved to 1P5D and back;
# drift6-slow moved four servers on a lull's six seconds); at 1.5 the suite's shifts are followed as soon
# and three of its four flaps are gone
SPREAD_Z = 1.5


@dataclass(frozen=True, slots=True)
class RebalanceState:
    started_at: float
    last_conversion_at: float | None = None
    last_direction: str | None = None  # of the last conversion
    last_failure_at: float | None = None
    conversions: int = 0
    refills: int = 0
    last_look_at: float | None = None
    last_counters: tuple | None = None  # every routable server's counters at the last look (rebalance_estimate)
    intervals: tuple = ()  # what happened between looks (rebalance_estimate.Interval), newest last
    mix: object | None = None  # the mix fitted at the last look (fleet_model.Mix)
    changed_at: float | None = None  # when the fit last read a change of the mix (rebalance_change.read_change)
    # the recent successful conversions' durations: ((into prefill...), (into decode...))
    conversion_secs: tuple[tuple[float, ...], tuple[float, ...]] = ((), ())


def initial_state(now: float) -> RebalanceState:
    return RebalanceState(started_at=now)


def conversion_ended(state: RebalanceState, now: float, ok: bool, to_role: str | None = None,
                     secs: float | None = None) -> RebalanceState:
    """After a conversion finished (or failed): the failure cooldown runs from now; a successful one's duration
    (`secs`, into `to_role`) is what the next move that way is charged."""
    if not ok:
        return replace(state, last_failure_at=now)
    durations = state.conversion_secs
    if secs is not None and to_role in (PREFILL, DECODE):
        side = 0 if to_role == PREFILL else 1
        recent = (*durations[side], secs)[-RECENT_CONVERSIONS:]
        durations = (recent, durations[1]) if side == 0 else (durations[0], recent)
    return replace(state, last_conversion_at=now, conversion_secs=durations)


@dataclass(frozen=True, slots=True)
class Decision:
    at: float
    action: str  # "convert" | "hold"
    reason: str
    guards: tuple[str, ...] = ()
    direction: str | None = None  # "to_prefill" | "to_decode"
    worker_id: str | None = None
    from_role: str | None = None
    to_role: str | None = None
    pools: dict = field(default_factory=dict)  # routable servers per pool at the look
    gain: float | None = None  # the chosen split's predicted attainment over holding's, over the horizon
    refill: bool = False  # rule 1: a pool was empty
    conversion_mode: str | None = None  # how to empty the server ("drain" | "shed" | "abort"); None: the config's
    state: RebalanceState | None = None
    workers: tuple[str, ...] = ()  # every server to convert (several at once when the model says so)
    model: dict | None = None  # the model's reading: the fitted mix, each candidate split, the choice

    @property
    def convert(self) -> bool:
        return self.action == "convert"

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "state"}
        out["guards"] = list(self.guards)
        out["workers"] = list(self.workers or ((self.worker_id,) if self.worker_id else ()))
        return out


def _hold(obs: Observation, reason: str, guards_fired: tuple[str, ...], state: RebalanceState, **extra) -> Decision:
    return Decision(at=obs.now, action="hold", reason=reason, guards=guards_fired, state=state, **extra)


def _other(role: str) -> str:
    return DECODE if role == PREFILL else PREFILL


def refill(obs: Observation, state: RebalanceState) -> Decision | None:
    """Rule 1 (see the module docstring); None when neither pool is empty."""
    empty = [role for role in (PREFILL, DECODE) if not obs.pool(role)]
    if not empty:
        return None
    pools = {PREFILL: len(obs.prefill), DECODE: len(obs.decode)}
    if len(empty) == 2:
        return _hold(obs, "no routable server in either pool: nothing to refill from", (FLOOR,), state, pools=pools)
    (role,) = empty
    donor_role = _other(role)
    donors = obs.pool(donor_role)
    head = f"the {role} pool has no routable server"
    direction = f"to_{role}"
    extra = dict(pools=pools, direction=direction, from_role=donor_role, to_role=role, refill=True)
    if role in obs.converting_into:
        return _hold(obs, f"{head}: a conversion into it is under way ({obs.busy})", (REFILLING,), state, **extra)
    if role in obs.pending:
        return _hold(obs, f"{head} yet: servers of that role are still being read", (PENDING,), state, **extra)
    if len(donors) < 2:
        return _hold(obs, f"{head}, and the {donor_role} pool has {len(donors)} server(s): none to spare",
                     (FLOOR,), state, **extra)
    candidates = [w for w in donors if w.convertible]
    if not candidates:
        return _hold(obs, f"{head}, and no {donor_role} server can be converted (each is doubted by its health "
                          f"verdict or breaker, or failed a conversion lately)", (NO_CANDIDATE,), state, **extra)
    worker = min(candidates, key=lambda w: w.cost)
    mode = "drain" if worker.busy == 0 else "abort"
    why = "nothing in flight on it" if mode == "drain" else f"{worker.busy} request(s) on it are aborted and re-sent"
    done = replace(state, last_conversion_at=obs.now, last_direction=direction, conversions=state.conversions + 1,
                   refills=state.refills + 1)
    reason = (f"{head}: refill it at once from {donor_role} {worker.id}, the cheapest of "
              f"{len(donors)} ({mode} mode: {why})")
    return Decision(at=obs.now, action="convert", reason=reason, worker_id=worker.id, state=done,
                    conversion_mode=mode, **extra)


HOLD = "hold"
MEETS_TARGET = "meets_target"
NO_GAIN = "no_gain"
UNSURE = "within_spread"


def costs_of(state: RebalanceState, config: RebalanceConfig) -> Costs:
    """What a move each way costs: the mean of the recent conversions that way, else the configured prior."""
    to_prefill, to_decode = state.conversion_secs

    def mean(values: tuple[float, ...]) -> float:
        return sum(values) / len(values) if values else config.conversion_secs
    return Costs(mean(to_prefill), mean(to_decode))


def observe_counters(obs: Observation, state: RebalanceState) -> RebalanceState:
    """The state with this look's counters and the interval since the last look (the model's memory)."""
    now_counters = counters(obs)
    intervals = state.intervals
    if state.last_counters is not None and state.last_look_at is not None and obs.now > state.last_look_at:
        prompts = tuple(e[1] for e in obs.request_sizes if state.last_look_at < e[0] <= obs.now)
        intervals = (*intervals, interval(state.last_counters, now_counters, obs.now - state.last_look_at, prompts))
        intervals = intervals[-MAX_INTERVALS:]
    return replace(state, last_counters=now_counters, intervals=intervals, last_look_at=obs.now)


def _arriving(obs: Observation, costs: Costs) -> tuple[str, int, float] | None:
    """Ours on their way (one direction at a time: the guards see to it), as `plan` counts them: they arrive
    in half a conversion's time on average."""
    if not obs.joining:
        return None
    into_prefill = obs.joining.count(PREFILL)
    net = into_prefill - (len(obs.joining) - into_prefill)  # a refill the other way: the net counts
    if net == 0:
        return None
    pool = PREFILL if net > 0 else DECODE
    return pool, abs(net), costs.of(pool) / 2


def most_robust(moves: list, ends: list[dict], headroom_of=None, tie: float = 0.0) -> object:
    """Of the candidate moves (`fleet_model.Candidate`), the one whose value is best at its worst: at the estimate
    or at either end of its spread (`ends`: each split's value there, by (prefills, decodes)). Moves within `tie`
    of that best (the caller's `min_gain`: a difference no move is made for) are equal there, and go to the most
    headroom (`headroom_of(candidate)`: `fleet_model.headroom`, the rate each takes before missing the target),
    then to the better estimate, then to fewer moves. The spread's ends move work from one pool to the other; a
    rate read low (a lull's first seconds of a phase: drift6-slow seed 29 read 4.7 requests/s where 9 came) is
    what headroom covers: 1P5D, 2P4D and 3P3D all served that reading, 1P5D was best at its worst by 1.2 points,
    and the fleet moved to it and on to 2P4D 18 s later."""
    def worst(c) -> float:
        return min((c.value, *(end[(c.prefills, c.decodes)] for end in ends)))
    best = max(worst(c) for c in moves)
    tied = [c for c in moves if worst(c) >= best - tie]
    if len(tied) > 1 and headroom_of is not None:
        return max(tied, key=lambda c: (headroom_of(c), c.value, -c.moves))
    return max(tied, key=lambda c: (worst(c), c.value, -c.moves))


def least_behind(moves: list, ends: list[dict]) -> object | None:
    """Of the candidate moves where no split serves the workload, the one leaving the shortest wait behind its
    backlogs at the horizon's end at its worst (at the estimate or either end of its spread: `ends`, each split's
    candidate there); ties to fewer moves. None: no move."""
    def worst(c) -> float:
        return max((c.behind_s, *(end[(c.prefills, c.decodes)].behind_s for end in ends)))
    return min(moves, key=lambda c: (worst(c), c.moves), default=None)


def served_choice(candidates: list, staying, at_ends, spread: str, min_gain: float, headroom_of=None) -> tuple:
    """The move where some split serves the workload: (the candidate, "", "") or (None, why, text) to hold.
    The split changes for the workload, not for a backlog: a backlog clears at the split the workload needs, and
    it is what a move's urgency and cost are weighed on (a move to clear one is a move back later). The mix is an
    estimate: what the window's spread allows is valued too (`at_ends()`); of the moves, the one whose worst case
    is best is chosen (a split good at the estimate and bad within its noise, one server short at an edge, is
    corrected a look later: a flap; `most_robust`, near-ties to the most headroom), and it must not lose to
    holding at either end, or it bets on the noise."""
    key = (staying.prefills, staying.decodes)
    candidates = [c for c in candidates if c.moves == 0 or c.steady - staying.steady >= min_gain]
    best = candidates[0]
    if best.moves:
        ends = [{split: c.value for split, c in end.items()} for end in at_ends()]
        if ends:
            best = most_robust([c for c in candidates if c.moves], ends, headroom_of, min_gain)
            if any(end[(best.prefills, best.decodes)] < end[key] for end in ends):
                return None, UNSURE, (f"{best.prefills}P{best.decodes}D gains under the estimate, but loses within "
                                      f"its spread ({spread})")
    if best.moves == 0 or best.value - staying.value < min_gain:
        text = f"no split gains {min_gain * 100:g} points"
        if best.moves:
            text += f" ({best.prefills}P{best.decodes}D: {best.value * 100:.1f}%)"
        return None, NO_GAIN, text
    return best, "", ""


def overloaded_choice(candidates: list, staying, ends: list[dict], whole: dict | None, spread: str,
                      min_gain: float) -> tuple:
    """The move where no split serves the workload within the SLOs (every one saturates a pool): (the
    candidate, "", "") or (None, why, text) to hold. Valued on attainment alone every split reads 0, and the
    fleet held at its worst; the one leaving the shortest wait behind its backlogs at the horizon's end
    (`least_behind`) serves the most requests and recovers first when the load eases, and it must leave less
    than holding at either end of the spread (`ends`). What it spares comes after the move, so the overload
    must not be a burst: where the mix is read since a change, the move must not lose to holding on the window
    read whole either (`whole`: a burst left out; one read as a change ends before a server moved for it
    arrives), once steady (the burst's backlog is in both readings, and a move to clear it is a move back):
    where holding serves the window whole, the move must gain there as any move must (`min_gain`); where that
    overloads every split too, it must leave less waiting there (burst4 seed 18: 2P2D and 3P1D both served the
    window whole, 3P1D cleared the burst's backlog sooner, and moved back 6 s later)."""
    key = (staying.prefills, staying.decodes)
    best = least_behind([c for c in candidates if c.moves], ends)
    if best is None or best.behind_s >= staying.behind_s or any(
            end[(best.prefills, best.decodes)].behind_s >= end[key].behind_s for end in ends):
        return None, NO_GAIN, ("no split serves the workload, and none leaves less of it waiting within its "
                               f"spread ({spread})")
    if whole is not None:
        moved, held = whole[(best.prefills, best.decodes)], whole[key]
        if held.steady >= min_gain:  # holding serves the window whole: the move must gain there, as any move must
            loses = moved.steady < held.steady + min_gain
        else:  # every split overloads it too: the move must leave less waiting there
            loses = (moved.steady, -moved.behind_s) < (held.steady, -held.behind_s)
        if loses:
            return None, UNSURE, (f"no split serves the mix since its change; {best.prefills}P{best.decodes}D leaves "
                                  f"the least of it waiting, but loses to holding on the window read whole "
                                  f"({moved.steady * 100:.1f}% against {held.steady * 100:.1f}% once steady): it "
                                  f"may be a burst")
    return best, "", ""


def _behind(c) -> str:
    return "an unbounded wait" if math.isinf(c.behind_s) else f"{c.behind_s:.0f} s"


def decide(obs: Observation, state: RebalanceState, config: RebalanceConfig) -> Decision:
    refilled = refill(obs, state)
    if refilled is not None:
        return refilled
    seen = observe_counters(obs, state)
    fitted = fit(obs, seen.intervals, config.window_secs, state.mix, state.changed_at)
    seen = replace(seen, changed_at=fitted.changed_at)
    slo = Slo(config.ttft_target_secs, config.itl_target_secs)
    costs = costs_of(state, config)
    reading: dict = {"window_secs": round(fitted.window_secs, 2),
                     "costs_s": {"to_prefill": round(costs.to_prefill_s, 2), "to_decode": round(costs.to_decode_s, 2)},
                     "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s}}
    pools = {PREFILL: len(obs.prefill), DECODE: len(obs.decode)}

    def hold(reason: str, fired: tuple[str, ...], new_state: RebalanceState, **extra) -> Decision:
        return Decision(at=obs.now, action="hold", reason=reason, guards=fired, state=new_state,
                        pools=pools, model=reading, **extra)

    if fitted.mix is None:
        return hold(f"no model yet: {fitted.missing}", (guards.NO_SIGNAL,), seen)
    mix = fitted.mix
    n_p, n_d = len(obs.prefill), len(obs.decode)
    now_split = predict(mix, n_p, n_d, slo)
    if now_split.decode_batch != float("inf"):
        mix = replace(mix, waiting_decode=mix.waiting_decode + overgrown_batch(obs, now_split.decode_batch))
    seen = replace(seen, mix=mix)
    reading["mix"] = mix.to_dict()
    arriving = _arriving(obs, costs)
    candidates = plan(mix, n_p, n_d, slo, costs, config.horizon_secs, min_prefill=config.min_prefill,
                      min_decode=config.min_decode, arriving=arriving)
    reading["candidates"] = [c.to_dict() for c in candidates]
    reading["now"] = now_split.to_dict()
    staying = next(c for c in candidates if c.moves == 0)
    summary = (f"{n_p}P{n_d}D predicted {staying.value * 100:.1f}% within the SLOs over "
               f"{staying.horizon_s:.0f} s (steady {staying.steady * 100:.1f}%)")
    if staying.value >= config.attainment_target:
        reading["choice"] = {"split": f"{staying.prefills}P{staying.decodes}D", "why": MEETS_TARGET}
        return hold(f"{summary}: meets the {config.attainment_target * 100:g}% target", (), seen)
    error_p, error_d = fitted.spread
    reading["spread"] = {"prefill": round(error_p, 3), "decode": round(error_d, 3)}
    if fitted.changed_at is not None:  # the mix is read since then (rebalance_change.read_change)
        reading["changed_secs_ago"] = round(obs.now - fitted.changed_at, 2)

    def planned(of: Mix) -> dict:
        return {(c.prefills, c.decodes): c for c in plan(
            of, n_p, n_d, slo, costs, config.horizon_secs, min_prefill=config.min_prefill,
            min_decode=config.min_decode, arriving=arriving)}

    def at_ends() -> list[dict]:  # `SPREAD_Z` standard errors more work on one pool and less on the other
        if not (error_p or error_d):
            return []
        return [planned(replace(mix, prefill_s=mix.prefill_s * (1 + sign * SPREAD_Z * error_p),
                                decode_tokens=mix.decode_tokens * (1 - sign * SPREAD_Z * error_d)))
                for sign in (1, -1)]
    spread = f"prefill work +-{SPREAD_Z * error_p * 100:.0f}%, decode +-{SPREAD_Z * error_d * 100:.0f}%"

    def headroom_of(c) -> float:
        return headroom(mix, c.prefills, c.decodes, slo, config.attainment_target)
    if max(c.steady for c in candidates) < config.min_gain:
        if fitted.window_secs < config.window_secs:  # the start: what arrived so far could be a burst, and no more
            reading["choice"] = {"split": f"{staying.prefills}P{staying.decodes}D", "why": UNSURE}
            return hold(f"{summary}: no split serves the {fitted.window_secs:.0f} s since the start; an overload is "
                        f"read on a full window ({config.window_secs:g} s): a burst could be most of it", (), seen)
        whole = planned(fitted.whole) if fitted.whole is not None else None
        best, why, text = overloaded_choice(candidates, staying, at_ends(), whole, spread, config.min_gain)
    else:
        best, why, text = served_choice(candidates, staying, at_ends, spread, config.min_gain, headroom_of)
    if best is None:
        reading["choice"] = {"split": f"{staying.prefills}P{staying.decodes}D", "why": why}
        return hold(f"{summary}: {text}", (), seen)
    direction = f"to_{best.direction}"
    donor_role = DECODE if best.direction == PREFILL else PREFILL
    proposal = (f"{summary}; {best.prefills}P{best.decodes}D predicted {best.value * 100:.1f}% "
                f"(steady {best.steady * 100:.1f}%, {best.moves} conversion(s) of ~{best.cost_s:.0f} s")
    if best.steady < config.min_gain:
        proposal += f"; {_behind(best)} waiting behind its backlogs at the horizon's end, holding {_behind(staying)}"
    proposal += ")"
    reading["choice"] = {"split": f"{best.prefills}P{best.decodes}D", "why": "best", "gain": round(
        best.value - staying.value, 4), "headroom": round(headroom_of(best), 2)}
    fired, notes = guards.check(obs, state, config, best.direction)
    donors = guards.donors(obs, donor_role, best.moves)
    if not donors:
        fired, notes = (*fired, guards.NO_CANDIDATE), (*notes, f"no convertible {donor_role} server")
    extra = dict(direction=direction, from_role=donor_role, to_role=best.direction,
                 gain=round(best.value - staying.value, 4))
    if fired:
        return hold(f"{proposal}; held: {'; '.join(notes)}", tuple(fired), seen, **extra)
    ids = tuple(w.id for w in donors)
    done = replace(seen, last_conversion_at=obs.now, last_direction=direction,
                   conversions=state.conversions + len(ids))
    mode = "shed" if best.direction == PREFILL and config.conversion_mode == "drain" else None
    reason = f"{proposal}: convert {', '.join(ids)}"
    if mode:
        reason += "; shed mode: its requests still waiting on a prefill are re-sent, the rest finish"
    return Decision(at=obs.now, action="convert", reason=reason, worker_id=ids[0], workers=ids, pools=pools,
                    state=done, conversion_mode=mode, model=reading, **extra)
