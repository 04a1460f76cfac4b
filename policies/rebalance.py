"""The P/D rebalancer's decision core: `decide(observation, state, config) -> Decision`, with no I/O.

Two rules, in this order:

1. **Refill an empty pool.** When one pool has no routable server left (its servers died, failed or were
   removed) and the other can spare one, convert the cheapest of the other pool at once: no load signal,
   warm-up, cooldown or confirmation is waited for (with no prefill, or no decode, nothing is served at all).
   Drain mode when the chosen server has nothing in flight (nothing to wait for), else abort mode (its
   requests are aborted and re-sent by the router; waiting for them would keep the fleet down). Held only
   while a conversion into that pool is already under way, while servers of that role are still being read
   at start-up, or when the other pool has a single server.
2. **Follow the load.** Compare the pressure on the prefill pool with the pressure on the decode pool and
   move one server from the cold pool to the hot one. Which signal stands for which bottleneck, and why, is
   in `policies/rebalance_signals.py`: queues are attributed to the pool whose capacity they wait on (a decode
   server's transfer queue waits on prefill compute, a prefill's bootstrap queue on decode KV room), TTFT is
   charged only to a pool whose waiting requests clearly dominate, latency is measured on failed and abandoned
   requests too, and a pool that is idle now is charged no latency left from before.

The same code runs live, in replay and in tests: time comes in the observation, and the state is a value
returned inside the decision. Every decision, a refusal included, names the guards that held it back:

  no_signal      a pool has no data at all (no reports, no latency samples); the streak is kept
  deadband       the hot pool is below `min_pressure`: nothing is worth a conversion; the streak restarts
  margin         moving one server is predicted to improve the worst pressure by less than `min_improvement`
                 (it would only move the bottleneck); the streak is kept, not counted. Waived for a pool short
                 of capacity (see below)
  draining       the hot pool's backlog shrank by a quarter or more since the last look: what it has copes
                 (after a conversion, the backlog it left is draining); the streak is kept, not counted
  warmup         less than `warmup_secs` since the rebalancer started
  busy           a conversion is in progress (an operator's, one the other way, or ours while the servers on
                 their way are predicted to bring the hot pool under `min_pressure`): one at a time, except
                 that a hot pool still over `min_pressure` once ours in progress have arrived gets the
                 next server at once, its drain beside theirs (a decode converted to prefill drains requests
                 that wait on the very prefill backlog it is to relieve: one after the other, the drains added
                 up to most of a phase)
  cooldown       less than `cooldown_secs` since a conversion the other way ended (no flapping)
  step_cooldown  less than `step_cooldown_secs` (default: a quarter of `cooldown_secs`) since a conversion the
                 same way ended (let it act first); not beside ours still on their way (busy). A look less
                 than half an interval before its end counts as after it: looks come once an interval, and a
                 step cooldown of one interval, run from a conversion's end, held every next look (one move
                 every two looks)
  failure_cooldown  less than `failure_cooldown_secs` since a conversion failed
  floor          the donor pool would fall below its minimum size (refill: the donor has one server)
  confirmations  the proposal has not yet held for `confirmations` intervals (those that passed the margin); one
                 is enough when the hot pool's pressure is at least `urgent_pressure` (3.0): an overload that
                 large grows while it is being confirmed; and one is enough after a conversion the same way
                 (within `cooldown_secs` of it, its step cooldown over): the overload was confirmed before it,
                 and the pool still hot says one server was not enough. Not to undo the last conversion within
                 twice the cooldown, though: the moments after one (the server converted admits a backlog at once, the
                 other pool's queues settle) look urgent for a poll or two, and undoing on one sighting of that
                 is a flap. Nor, for prefill, a queue that appeared since the last look while the prefills
                 were mostly idle (busy under `BURST_BUSY` of `busy_target`): a burst of arrivals the next
                 forward clears (a batch of answers finishing together on a decode-heavy fleet, or a server
                 the machine starved of CPU for a moment) is not short compute; a second look must see it too
  same_look      asked again in the look that started a conversion (the loop does so at once in enabled mode:
                 a pool short of several servers gets them in one look, not one a look): the next server goes
                 only if `busy` lets it (the hot pool, with those on their way, still over `min_pressure`) and
                 the donor keeps `SPARE_DONOR` servers, predicted under `min_pressure` without it. A phase
                 turning on eight servers needs four moves; one a look, the backlog built over four looks took
                 most of the phase to clear
  no_candidate   the donor pool has no server that can be converted (each is doubted by a health verdict or a
                 breaker, or failed a conversion lately)
  refilling      a pool is empty and a conversion into it is already under way
  pending        a pool is empty but servers of its role have not been read yet (start-up)

No guard undoes another's count: margin, draining, warm-up, busy and the cooldowns hold a proposal without
resetting its streak, so once they pass, a proposal that kept holding converts at once; only a change of
direction or the end of the pressure (deadband) restarts it, and a finished conversion (what was seen during
it does not count).

**A pool short of capacity.** Proportionally, one more server relieves a pool of n by 1/(n + 1), so a margin
of 20 % capped every pool at five servers. That proportion holds for a pool that keeps up; it is far from the
truth for one that does not: a backlog clears at (capacity - arrivals), and a server added to a pool that barely
keeps up multiplies that pace (eight servers: 5P3D drained 99 waiting prefills at 0.7 a second, for 140 s of
a phase the oracle's 6P2D served 98 % of). So the margin is waived when the hot pool's backlog, at the pace it
changed since the last look (one after the last conversion ended), would take longer than `ttft_target_secs`
to clear (or grows), when the cold pool is predicted to stay under `min_pressure` without the server (the move
cannot move the bottleneck), and when the cold pool keeps at least `SPARE_DONOR` (2) servers: the cold pool's
prediction is the weakest at one server (a decode's latency at low batch says little about its capacity: on
the eight-server benchmark 2D read 0.32 and 1D then 1.4 to 3.8), and a pool of one has nobody to share a
misprediction with.

The prediction takes a pool's terms to be proportional to its load per server: moving one server from a
pool of n_cold to a pool of n_hot scales the hot terms by n_hot / (n_hot + 1) and the cold ones by
n_cold / (n_cold - 1); with k of ours on their way into the hot pool (out of the cold pool already), by
n_hot / (n_hot + k + 1), against n_hot / (n_hot + k) without the move. Decode latency is not proportional
near saturation: with the decodes' fitted step line (fixed + per request x batch), the share of a step that
is per request is the utilisation, it scales with the load, and the step is fixed / (1 - utilisation)
(`rebalance_signals.step_after`). Past saturation the step understates the load: the batch grows look after
look and never settles, so the utilisation is read on what arrives (`rebalance_signals.decode_overload`: the
router's own counts of requests sent to the decodes and of those decoding, between two looks at the same
servers; by Little's law the batch's utilisation times arrivals / completions), and the margin compares the
split as it is on that reading too. The server moved is the cheapest of the donor pool (`WorkerView.cost`: fewest requests
in flight or queued, then the least KV held, i.e. the quickest drain), never one that is doubted. A decode
moved to prefill (with `conversion_mode` drain) is emptied in `shed` mode: its requests that still wait on a
prefill forward are re-sent elsewhere (their clients have seen nothing of them) instead of waited for, since
they wait on the very backlog the move is to relieve; those decoding finish where they are.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

from .rebalance_config import RebalanceConfig, RebalanceMode, UnknownFields
from .rebalance_signals import (
    DECODE, PREFILL, Observation, WorkerView, decode_counts, decode_overload, pool_after, pool_terms,
    ttft_charged_to, waits_on_decode, waits_on_prefill,
)

__all__ = ["BUSY", "CONFIRMATIONS", "COOLDOWN", "DEADBAND", "DRAINING", "FAILURE_COOLDOWN", "FLOOR", "GUARDS",
           "MARGIN", "NO_CANDIDATE", "NO_SIGNAL", "PENDING", "REFILLING", "STEP_COOLDOWN", "WARMUP", "Decision",
           "Observation", "RebalanceConfig", "RebalanceMode", "RebalanceState", "UnknownFields", "WorkerView",
           "conversion_ended", "decide", "initial_state", "pool_pressures", "ttft_charged_to", "waits_on_decode",
           "waits_on_prefill"]

# Guard names (a fixed catalogue, so that metrics and logs can count them).
NO_SIGNAL = "no_signal"
DEADBAND = "deadband"
MARGIN = "margin"
DRAINING = "draining"
WARMUP = "warmup"
BUSY = "busy"
COOLDOWN = "cooldown"
STEP_COOLDOWN = "step_cooldown"
FAILURE_COOLDOWN = "failure_cooldown"
FLOOR = "floor"
CONFIRMATIONS = "confirmations"
NO_CANDIDATE = "no_candidate"
REFILLING = "refilling"
PENDING = "pending"
SAME_LOOK = "same_look"
GUARDS = (NO_SIGNAL, DEADBAND, MARGIN, DRAINING, WARMUP, BUSY, COOLDOWN, STEP_COOLDOWN, FAILURE_COOLDOWN, FLOOR,
          CONFIRMATIONS, NO_CANDIDATE, REFILLING, PENDING, SAME_LOOK)

DRAIN_SHARE = 0.25  # a backlog that shrank by this share since the last look is draining
# A prefill pool busy under this share of `busy_target` is not short of compute: its queue is a burst.
BURST_BUSY = 0.5
# Undoing the last conversion within this many cooldowns of it takes every confirmation, however urgent.
REVERSAL_WINDOW = 2
# The margin is waived for a pool short of capacity only if the donor pool keeps at least this many servers.
SPARE_DONOR = 2


@dataclass(frozen=True, slots=True)
class RebalanceState:
    started_at: float
    streak_direction: str | None = None  # "to_prefill" | "to_decode"
    streak: int = 0
    last_conversion_at: float | None = None
    last_direction: str | None = None  # of the last conversion
    last_failure_at: float | None = None
    conversions: int = 0
    refills: int = 0
    last_waits: tuple[float | None, float | None] | None = None  # (on prefill, on decode) at the last look
    last_hot: str | None = None  # the direction whose pool was over min_pressure at the last look
    last_look_at: float | None = None  # when last_waits were seen
    look_moves: int = 0  # conversions decided at last_look_at (the same look: see `same_look`)
    last_decode_counts: tuple[int, int, int] | None = None  # rebalance_signals.decode_counts at the last look
    decode_overload: float = 1.0  # rebalance_signals.decode_overload read at the last look
    # the model core's (policies/rebalance_model.py): the last look's counters, the intervals since, the last
    # fitted mix, and the recent conversions' durations per direction ((to_prefill...), (to_decode...))
    last_counters: tuple | None = None
    intervals: tuple = ()
    mix: object | None = None
    conversion_secs: tuple[tuple[float, ...], tuple[float, ...]] = ((), ())


def initial_state(now: float) -> RebalanceState:
    return RebalanceState(started_at=now)


RECENT_CONVERSIONS = 5  # conversions per direction whose durations the model's cost averages


def conversion_ended(state: RebalanceState, now: float, ok: bool, to_role: str | None = None,
                     secs: float | None = None) -> RebalanceState:
    """After a conversion finished (or failed): cooldowns run from now, and what was seen during the
    transition does not count towards the next proposal; a successful one's duration (`secs`, into `to_role`)
    is what the model charges the next move that way."""
    if ok:
        durations = state.conversion_secs
        if secs is not None and to_role in (PREFILL, DECODE):
            side = 0 if to_role == PREFILL else 1
            recent = (*durations[side], secs)[-RECENT_CONVERSIONS:]
            durations = (recent, durations[1]) if side == 0 else (durations[0], recent)
        return replace(state, last_conversion_at=now, streak=0, streak_direction=None, conversion_secs=durations)
    return replace(state, last_failure_at=now, streak=0, streak_direction=None)


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
    pressures: dict = field(default_factory=dict)
    predicted_worst: float | None = None
    improvement: float | None = None
    streak: int = 0
    refill: bool = False  # rule 1: a pool was empty
    conversion_mode: str | None = None  # how to empty the server ("drain" | "shed" | "abort"); None: the config's
    state: RebalanceState | None = None
    workers: tuple[str, ...] = ()  # every server to convert (the model core moves several at once); () = worker_id
    model: dict | None = None  # the model core's reading: the fitted mix, each candidate split, the choice

    @property
    def convert(self) -> bool:
        return self.action == "convert"

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "state"}
        out["guards"] = list(self.guards)
        return out


def pool_pressures(obs: Observation, config: RebalanceConfig) -> tuple[dict[str, float], dict[str, float]]:
    """Both pools' terms (rebalance_signals.pool_terms without its notes)."""
    prefill, decode, _ = pool_terms(obs, config)
    return prefill, decode


def _pressure(terms: dict[str, float]) -> float | None:
    return max(terms.values()) if terms else None


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def _fmt(x: float | None) -> str:
    return "?" if x is None else f"{x:.2f}"


def _hold(obs: Observation, reason: str, guards: tuple[str, ...], state: RebalanceState, **extra) -> Decision:
    return Decision(at=obs.now, action="hold", reason=reason, guards=guards, streak=state.streak, state=state,
                    **extra)


def _other(role: str) -> str:
    return DECODE if role == PREFILL else PREFILL


def backlog_clear_secs(waiting: float | None, before: float | None, elapsed: float) -> float | None:
    """How long a backlog of `waiting` takes to clear at the pace it changed from `before`, `elapsed` seconds
    ago: infinite when it did not shrink; None when there is no earlier look to tell."""
    if waiting is None or before is None or elapsed <= 0:
        return None
    pace = (before - waiting) / elapsed
    return waiting / pace if pace > 0 else float("inf")


def short_of_capacity(state: RebalanceState, now: float, hot: str, waiting: float | None, before: float | None,
                      cold: str, cold_after: float, cold_left: int, config: RebalanceConfig) -> str | None:
    """Why the margin is waived for the hot pool (module docstring, "A pool short of capacity"), or None.
    (The move then always improves the worst pressure: the hot pool gains a server, the cold one stays under
    min_pressure, which the hot pool is over.)"""
    # the pace between two looks at the same servers: right after a conversion, what the backlog did during
    # it says nothing of the pool as it is now
    if state.last_look_at is None or (state.last_conversion_at is not None
                                      and state.last_look_at < state.last_conversion_at):
        return None
    clear_s = backlog_clear_secs(waiting, before, now - state.last_look_at)
    if clear_s is None or clear_s <= config.ttft_target_secs or cold_after >= config.min_pressure \
            or cold_left < SPARE_DONOR:
        return None
    took = "grows" if clear_s == float("inf") else f"would take {clear_s:.0f} s to clear"
    return (f"the {hot} backlog ({waiting:g} waiting) {took} at its pace, over the {config.ttft_target_secs:g} s "
            f"TTFT target, and {cold} keeps {cold_left} servers at {_fmt(cold_after)}")


def refill(obs: Observation, state: RebalanceState) -> Decision | None:
    """Rule 1 (see the module docstring); None when neither pool is empty."""
    empty = [role for role in (PREFILL, DECODE) if not obs.pool(role)]
    if not empty:
        return None
    pressures = {PREFILL: {"workers": len(obs.prefill)}, DECODE: {"workers": len(obs.decode)}}
    if len(empty) == 2:
        return _hold(obs, "no routable server in either pool: nothing to refill from", (FLOOR,), state,
                     pressures=pressures)
    (role,) = empty
    donor_role = _other(role)
    donors = obs.pool(donor_role)
    head = f"the {role} pool has no routable server"
    direction = f"to_{role}"
    extra = dict(pressures=pressures, direction=direction, from_role=donor_role, to_role=role, refill=True)
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
    done = replace(state, streak=0, streak_direction=None, last_conversion_at=obs.now, last_direction=direction,
                   conversions=state.conversions + 1, refills=state.refills + 1)
    reason = (f"{head}: refill it at once from {donor_role} {worker.id}, the cheapest of "
              f"{len(donors)} ({mode} mode: {why})")
    return Decision(at=obs.now, action="convert", reason=reason, worker_id=worker.id, state=done,
                    conversion_mode=mode, **extra)


def decide(obs: Observation, state: RebalanceState, config: RebalanceConfig) -> Decision:
    now = obs.now
    refilled = refill(obs, state)
    if refilled is not None:
        return refilled
    p_terms, d_terms, notes = pool_terms(obs, config)
    p_pressure, d_pressure = _pressure(p_terms), _pressure(d_terms)
    pressures = {PREFILL: {"pressure": _round(p_pressure), "workers": len(obs.prefill),
                           **{k: round(v, 4) for k, v in p_terms.items()}},
                 DECODE: {"pressure": _round(d_pressure), "workers": len(obs.decode),
                          **{k: round(v, 4) for k, v in d_terms.items()}},
                 "signals": notes}
    waits = (notes["waiting_on_prefill"], notes["waiting_on_decode"])
    # asked again in the look that started a conversion (see `same_look`)
    same_look = state.last_look_at == now and state.last_conversion_at == now
    counts = decode_counts(obs)
    if same_look:  # the look's first reading stands: since, the pools only lost the servers it moved
        overload, counts = state.decode_overload, state.last_decode_counts
    elif (state.last_decode_counts is not None and state.last_look_at is not None and not obs.busy
          and (state.last_conversion_at is None or state.last_conversion_at < state.last_look_at)):
        overload = decode_overload(counts, state.last_decode_counts, now - state.last_look_at)
    else:
        overload = 1.0
    notes["decode_overload"] = round(overload, 3)
    seen = replace(state, last_waits=waits, last_hot=None, last_look_at=now, last_decode_counts=counts,
                   decode_overload=overload)

    def hold(reason: str, guards: tuple[str, ...], new_state: RebalanceState, **extra) -> Decision:
        return _hold(obs, reason, guards, new_state, pressures=pressures, **extra)

    if p_pressure is None or d_pressure is None:
        missing = " and ".join(r for r, p in ((PREFILL, p_pressure), (DECODE, d_pressure)) if p is None)
        return hold(f"no load signal from the {missing} pool", (NO_SIGNAL,), seen)

    if p_pressure >= d_pressure:
        hot, hot_p, cold_p = PREFILL, p_pressure, d_pressure
    else:
        hot, hot_p, cold_p = DECODE, d_pressure, p_pressure
    cold = _other(hot)
    hot_pool, cold_pool = obs.pool(hot), obs.pool(cold)
    direction = f"to_{hot}"
    summary = f"{hot} pressure {_fmt(hot_p)} vs {cold} {_fmt(cold_p)}"
    if overload > 1:
        summary += f" (decode arrivals {overload:.2f}x its completions)"
    if hot_p < config.min_pressure:
        return hold(f"{summary}: below {config.min_pressure:g}, nothing to relieve", (DEADBAND,),
                    replace(seen, streak=0, streak_direction=None))

    n_hot, n_cold = len(hot_pool), len(cold_pool)
    seen = replace(seen, last_hot=direction)
    prediction: dict = {"direction": direction, "from_role": cold, "to_role": hot}
    fired: list[str] = []
    notes_out: list[str] = []
    # Ours on their way into the hot pool, when nothing else is converting: the hot pool as they will leave it.
    arriving = len(obs.joining) if obs.joining and set(obs.joining) == {hot} and not obs.others_busy else 0
    hot_terms, cold_terms = (p_terms, d_terms) if hot == PREFILL else (d_terms, p_terms)
    fixed = notes["decode_step_fixed_s"]

    def after(terms: dict, role: str, n: int, n_new: int) -> float:
        if role == PREFILL:
            return pool_after(terms, n, n_new)
        return pool_after(terms, n, n_new, fixed, config.itl_target_secs, overload)

    hot_after = after(hot_terms, hot, n_hot, n_hot + arriving) if arriving and n_hot else hot_p
    hot_waits = waits[0] if hot == PREFILL else waits[1]
    before = None if state.last_waits is None else state.last_waits[0 if hot == PREFILL else 1]
    margin_ok = True
    if n_cold > 1:  # with one server the floor guard holds anyway, and the cold pool would be empty
        # against the pressure now: while those on their way drain, the hot pool's backlog grows
        cold_after = after(cold_terms, cold, n_cold, n_cold - 1)
        predicted = max(after(hot_terms, hot, n_hot, n_hot + arriving + 1) if n_hot else 0.0, cold_after)
        # an overloaded decode pool's batch grows: the split as it is, on what arrives, is the reference
        reference = max(hot_p, after(hot_terms, hot, n_hot, n_hot)) if overload > 1 and n_hot else hot_p
        improvement = 1 - predicted / reference
        prediction.update(predicted_worst=round(predicted, 4), improvement=round(improvement, 4))
        margin_ok = improvement >= config.min_improvement - 1e-9  # "at least": n -> n+1 can gain exactly it
        proposal = (f"convert a {cold} server to {hot} (predicted worst pressure {_fmt(predicted)}, "
                    f"{improvement * 100:.0f}% better"
                    + (f"; {_fmt(hot_after)} once the {arriving} on their way arrive" if arriving else "")
                    + ")")
        waived = None if margin_ok else short_of_capacity(state, now, hot, hot_waits, before, cold, cold_after,
                                                          n_cold - 1, config)
        if waived:
            margin_ok = True
            proposal += f"; margin waived: {waived}"
        elif not margin_ok:
            fired.append(MARGIN)
            notes_out.append(f"it would leave the worst pressure at {_fmt(predicted)} (only "
                             f"{improvement * 100:.0f}% better, needs {config.min_improvement * 100:g}%)")
    else:
        proposal = f"convert a {cold} server to {hot}"
    draining = before is not None and hot_waits is not None and before >= 2 and hot_waits <= before * (1 - DRAIN_SHARE)
    if draining:
        fired.append(DRAINING)
        notes_out.append(f"its backlog is draining ({before:g} -> {hot_waits:g} waiting)")
    counts = margin_ok and not draining
    if state.streak_direction == direction:
        streak = state.streak + (1 if counts else 0)
    else:
        streak = 1 if counts else 0
    new_state = replace(seen, streak=streak, streak_direction=direction)
    if now - state.started_at < config.warmup_secs:
        fired.append(WARMUP)
        notes_out.append(f"warming up ({config.warmup_secs - (now - state.started_at):.0f} s left)")
    alongside = bool(arriving and hot_after >= config.min_pressure)
    if obs.busy and not alongside:
        fired.append(BUSY)
        notes_out.append(f"a conversion is in progress ({obs.busy})")
    if state.last_conversion_at is not None:
        since = now - state.last_conversion_at
        if state.last_direction not in (None, direction) and since < config.cooldown_secs:
            fired.append(COOLDOWN)
            notes_out.append(f"the last conversion went the other way ({config.cooldown_secs - since:.0f} s of "
                             f"cooldown left)")
        elif (state.last_direction in (None, direction) and since < config.step_cooldown - config.interval_secs / 2
              and not alongside):
            fired.append(STEP_COOLDOWN)
            notes_out.append(f"the last conversion went this way ({config.step_cooldown - since:.0f} s "
                             f"left to see it act)")
    if state.last_failure_at is not None and now - state.last_failure_at < config.failure_cooldown_secs:
        fired.append(FAILURE_COOLDOWN)
        notes_out.append(f"a conversion failed {now - state.last_failure_at:.0f} s ago")
    # Asked again in the look that started a conversion (the loop does so at once, rather than a look later):
    # the next server goes beside it only if the donor keeps two and stays under min_pressure without it and
    # the ones this look took (the donor's figures are still those of the pool that had them).
    if same_look:
        cold_look_after = after(cold_terms, cold, n_cold + state.look_moves, n_cold - 1) if n_cold > 1 else None
        if n_cold - 1 < SPARE_DONOR or cold_look_after is None or cold_look_after >= config.min_pressure:
            fired.append(SAME_LOOK)
            notes_out.append(f"another server in this look needs {cold} to keep {SPARE_DONOR} servers under "
                             f"{config.min_pressure:g} without it and the {state.look_moves} this look took "
                             f"(it would keep {n_cold - 1} at {_fmt(cold_look_after)})")
    minimum = config.min_prefill if cold == PREFILL else config.min_decode
    if n_cold <= minimum:
        fired.append(FLOOR)
        notes_out.append(f"the {cold} pool has {n_cold} server(s), its minimum is {minimum}")
    urgent = config.urgent_pressure and hot_p >= config.urgent_pressure
    undoing = (state.last_conversion_at is not None and state.last_direction not in (None, direction)
               and now - state.last_conversion_at < REVERSAL_WINDOW * config.cooldown_secs)
    # the busy term reads 0 through a forward longer than a poll (0.5.23 adds a forward's time when it ends):
    # then the second look decides
    prefill_busy = p_terms.get("busy") if hot == PREFILL else None
    burst = prefill_busy is not None and prefill_busy < BURST_BUSY and state.last_hot != direction
    # The same way as a conversion that ended within the cooldown, its step cooldown over and the pool still
    # hot: the overload was confirmed before that move, and one sighting says the move was not enough. Each
    # move waited on fresh confirmations otherwise: one every two looks, five moves taking most of a phase.
    continuing = (state.last_direction == direction and state.last_conversion_at is not None
                  and now - state.last_conversion_at < config.cooldown_secs)
    needed = 1 if (urgent or continuing) and not undoing and not burst else config.confirmations
    if streak < needed:
        fired.append(CONFIRMATIONS)
        why = ""
        if urgent and undoing:
            why = " (undoing the last conversion: never on one sighting)"
        elif urgent and burst:
            busy_pct = prefill_busy * config.busy_target * 100
            why = (f" (a burst: new since the last look, the prefills busy {busy_pct:.0f}% "
                   f"of the time: never on one sighting)")
        notes_out.append(f"signal seen {streak}/{needed} intervals" + why)
    candidates = [w for w in cold_pool if w.convertible]
    if not candidates:
        fired.append(NO_CANDIDATE)
        notes_out.append(f"no convertible {cold} server")
    if fired:
        return hold(f"{summary}: would {proposal}, held: {'; '.join(notes_out)}", tuple(fired), new_state,
                    **prediction)

    worker = min(candidates, key=lambda w: w.cost)
    done = replace(new_state, streak=0, streak_direction=None, last_conversion_at=now, last_direction=direction,
                   conversions=state.conversions + 1, look_moves=state.look_moves + 1 if same_look else 1)
    reason = f"{summary}: {proposal.replace(f'a {cold} server', f'{cold} {worker.id}', 1)}"
    if continuing and not urgent and streak < config.confirmations:
        reason += "; one sighting: the last conversion went this way and was not enough"
    # A decode moving to a short prefill pool: its requests that still wait on a prefill are re-sent, not waited
    # for (they wait on the very backlog it is to relieve; drains of 30 to 154 s on the eight-server benchmark)
    mode = "shed" if hot == PREFILL and config.conversion_mode == "drain" else None
    if mode:
        reason += "; shed mode: its requests still waiting on a prefill are re-sent, the rest finish"
    return Decision(at=now, action="convert", reason=reason, worker_id=worker.id, pressures=pressures,
                    streak=streak, state=done, conversion_mode=mode, **prediction)
