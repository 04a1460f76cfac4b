"""The rebalancer's model core: choose the split a fitted model of the fleet predicts serves the SLOs best.

`decide(observation, state, config) -> Decision`, pure, the same live, in replay (bench/replay.py) and in
tests. One look:

1. **Refill an empty pool** (`rebalance.refill`, unchanged): with no prefill or no decode nothing is served.
2. **Fit the model** (`rebalance_estimate.fit`): what arrives and what it costs, from the counters between
   this look and the last ones within `window_secs`.
3. **Value every split** (`fleet_model.plan`): each split within the floors, its predicted SLO attainment over
   `horizon_secs`, the backlogs now and the conversions' cost (their measured duration per direction)
   included. Several servers move at once when the best split is several away.
4. **Choose**: the best split, unless holding is predicted to meet `attainment_target` already, or the best
   gains less than `min_gain` over holding (what the fit's noise could make up). Hysteresis is the model's:
   a move back costs a conversion's duration again, and pays only if the mix changed.
5. **Guards**, each a small named function in `rebalance_guards.py`, for what is not the model's job.

Each decision carries the model's reading (`Decision.model`): the fitted mix, every candidate split with its
steady attainment, its value over the horizon and the cost it was charged, and why the choice was made.
"""

from __future__ import annotations

from dataclasses import replace

from . import rebalance_guards as guards
from .fleet_model import DECODE, PREFILL, Costs, Slo, plan, predict
from .rebalance import Decision, RebalanceConfig, RebalanceState, refill
from .rebalance_estimate import MAX_INTERVALS, counters, fit, interval, overgrown_batch
from .rebalance_signals import Observation

__all__ = ["decide", "costs_of", "observe_counters"]

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
        intervals = (*intervals, interval(state.last_counters, now_counters, obs.now - state.last_look_at))
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


def decide(obs: Observation, state: RebalanceState, config: RebalanceConfig) -> Decision:
    refilled = refill(obs, state)
    if refilled is not None:
        return refilled
    seen = observe_counters(obs, state)
    fitted = fit(obs, seen.intervals, config.window_secs, state.mix)
    slo = Slo(config.ttft_target_secs, config.itl_target_secs)
    costs = costs_of(state, config)
    reading: dict = {"window_secs": round(fitted.window_secs, 2),
                     "costs_s": {"to_prefill": round(costs.to_prefill_s, 2), "to_decode": round(costs.to_decode_s, 2)},
                     "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s}}
    pressures = {PREFILL: {"workers": len(obs.prefill)}, DECODE: {"workers": len(obs.decode)}}

    def hold(reason: str, fired: tuple[str, ...], new_state: RebalanceState, **extra) -> Decision:
        return Decision(at=obs.now, action="hold", reason=reason, guards=fired, state=new_state,
                        pressures=pressures, model=reading, **extra)

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
    best = candidates[0]
    summary = (f"{n_p}P{n_d}D predicted {staying.value * 100:.1f}% within the SLOs over "
               f"{config.horizon_secs:g} s (steady {staying.steady * 100:.1f}%)")
    if staying.value >= config.attainment_target:
        reading["choice"] = {"split": f"{staying.prefills}P{staying.decodes}D", "why": MEETS_TARGET}
        return hold(f"{summary}: meets the {config.attainment_target * 100:g}% target", (), seen)
    # the split changes for the workload, not for a backlog: a backlog clears at the split the workload needs,
    # and it is what a move's urgency and cost are weighed on (a move to clear one is a move back later)
    candidates = [c for c in candidates if c.moves == 0 or c.steady - staying.steady >= config.min_gain]
    best = candidates[0]
    # the mix is an estimate: a move must not lose at either end of what the window's spread allows (one
    # standard error more work on one pool and less on the other), or it bets on the noise; near an edge that
    # bet flips look after look
    error_p, error_d = fitted.spread
    reading["spread"] = {"prefill": round(error_p, 3), "decode": round(error_d, 3)}
    if best.moves and (error_p or error_d):
        for sign in (1, -1):
            shifted = replace(mix, prefill_s=mix.prefill_s * (1 + sign * error_p),
                              decode_tokens=mix.decode_tokens * (1 - sign * error_d))
            again = {(c.prefills, c.decodes): c for c in plan(
                shifted, n_p, n_d, slo, costs, config.horizon_secs, min_prefill=config.min_prefill,
                min_decode=config.min_decode, arriving=arriving)}
            kept = again[(staying.prefills, staying.decodes)]
            if again[(best.prefills, best.decodes)].value < kept.value:
                reading["choice"] = {"split": f"{staying.prefills}P{staying.decodes}D", "why": UNSURE}
                return hold(f"{summary}: {best.prefills}P{best.decodes}D gains under the estimate, but loses within "
                            f"its spread (prefill work +-{error_p * 100:.0f}%, decode +-{error_d * 100:.0f}%)",
                            (), seen)
    if best.moves == 0 or best.value - staying.value < config.min_gain:
        why = NO_GAIN
        text = f"{summary}: no split gains {config.min_gain * 100:g} points"
        if best.moves:
            text += f" ({best.prefills}P{best.decodes}D: {best.value * 100:.1f}%)"
        reading["choice"] = {"split": f"{staying.prefills}P{staying.decodes}D", "why": why}
        return hold(text, (), seen)
    direction = f"to_{best.direction}"
    donor_role = DECODE if best.direction == PREFILL else PREFILL
    proposal = (f"{summary}; {best.prefills}P{best.decodes}D predicted {best.value * 100:.1f}% "
                f"(steady {best.steady * 100:.1f}%, {best.moves} conversion(s) of ~{best.cost_s:.0f} s)")
    reading["choice"] = {"split": f"{best.prefills}P{best.decodes}D", "why": "best", "gain": round(
        best.value - staying.value, 4)}
    fired, notes = guards.check(obs, state, config, best.direction)
    donors = guards.donors(obs, donor_role, best.moves)
    if not donors:
        fired, notes = (*fired, guards.NO_CANDIDATE), (*notes, f"no convertible {donor_role} server")
    extra = dict(direction=direction, from_role=donor_role, to_role=best.direction,
                 predicted_worst=None, improvement=round(best.value - staying.value, 4))
    if fired:
        return hold(f"{proposal}; held: {'; '.join(notes)}", tuple(fired), seen, **extra)
    ids = tuple(w.id for w in donors)
    done = replace(seen, last_conversion_at=obs.now, last_direction=direction,
                   conversions=state.conversions + len(ids))
    mode = "shed" if best.direction == PREFILL and config.conversion_mode == "drain" else None
    reason = f"{proposal}: convert {', '.join(ids)}"
    if mode:
        reason += "; shed mode: its requests still waiting on a prefill are re-sent, the rest finish"
    return Decision(at=obs.now, action="convert", reason=reason, worker_id=ids[0], workers=ids, pressures=pressures,
                    state=done, conversion_mode=mode, model=reading, **extra)
