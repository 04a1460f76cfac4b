"""Replay: a P/D fleet in virtual time, driven by the real rebalancer decision core, in seconds not minutes.

The fleet has the simulator's capacity model (simulator/capacity.py), without HTTP and without sleeping: one
prefill forward at a time per server, taking the waiting requests first come first served up to
`max_prefill_tokens` prompt tokens, lasting `prefill_overhead_s + prefill_per_token_s x` its tokens (the first
token comes with the KV); a continuously batched decode step of `step_s + step_per_running_s x` the batch, one
token to each member, at most `max_running` in the batch (the others wait). The router's part is the one that
matters to a split: both legs open at arrival, the least loaded server of each pool by the router's own open
legs, a server out of routing while it converts (drained, or shed: its requests still waiting on a prefill go
to another decode), its role switch taking `switch_s`, its counters starting again in its new pool.

The decision core sees what it sees live: an `Observation` of each routable server's counters (the router's
requests sent and open, a prefill's forward seconds, a decode's tokens and fitted step line, their queues), the
conversions under way, and the sizes of recent requests as the router reads them (prompt tokens, the answer's
max_new_tokens); it is asked every `interval_secs`, and its conversions are carried out. `record` keeps every
observation and decision, so that recorded observations replay through the core (`redecide`) to the same
decisions.

    python -m bench.workload_suite          # the suite: every workload, every static split, the oracle, the core
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Callable

from policies.rebalance import RebalanceConfig, RebalanceState, conversion_ended, initial_state
from policies.rebalance_signals import DECODE, PREFILL, Observation, WorkerView
from router.control.load_monitor import step_fit


PUBLISH_STEPS = 15  # 0.5.23's --load-snapshot-publish-interval: a decode's row is republished every 15 steps


@dataclass(frozen=True)
class Capacity:
    """The simulator's capacity model (its flags of the same names), and how long a role switch takes."""

    prefill_overhead_s: float = 0.005
    prefill_per_token_s: float = 0.0002
    max_prefill_tokens: int = 16384
    step_s: float = 0.04
    step_per_running_s: float = 0.008
    max_running: int = 2048
    switch_s: float = 0.5  # a role switch's own time (the drain comes on top)

    def scaled(self, k: float) -> "Capacity":
        return replace(self, prefill_overhead_s=self.prefill_overhead_s * k,
                       prefill_per_token_s=self.prefill_per_token_s * k, step_s=self.step_s * k,
                       step_per_running_s=self.step_per_running_s * k, switch_s=self.switch_s * k)


@dataclass(eq=False)
class Req:
    n: int
    at: float
    prompt: int  # tokens
    answer: int  # tokens in all (the first comes with the KV)
    phase: int
    prefill: "Server | None" = None
    decode: "Server | None" = None
    first_at: float | None = None
    last_at: float | None = None
    decoded: int = 0
    abandoned: bool = False  # its client gave up (the router aborted it on both servers)
    resent_from: "Server | None" = None  # sent again while in a forward on this prefill (shed): that forward ends for nothing

    @property
    def done(self) -> bool:
        return self.first_at is not None and 1 + self.decoded >= self.answer and not self.abandoned

    def meets(self, ttft_s: float, tpot_s: float) -> bool:
        if not self.done:
            return False
        if self.first_at - self.at > ttft_s:
            return False
        return self.decoded == 0 or (self.last_at - self.first_at) / self.decoded <= tpot_s


@dataclass(eq=False)
class Server:
    id: str
    role: str
    routable: bool = True
    converting_to: str | None = None
    started: int = 0  # the router's counts, since it joined its pool
    inflight: int = 0
    queue: deque = field(default_factory=deque)  # prefill: waiting for a forward
    forwarding: list = field(default_factory=list)
    busy_s: float = 0.0
    batch: list = field(default_factory=list)  # decode
    waiting: deque = field(default_factory=deque)  # KV in hand, waiting for a place in the batch
    pending: dict = field(default_factory=dict)  # assigned, KV not here yet (a dict: in order, so runs repeat)
    stepping: bool = False
    moments: list = field(default_factory=lambda: [0.0] * 6)
    shown: tuple = (0.0,) * 6  # the moments of the row last published (0.5.23: every 15 steps, and as a batch starts)
    seen: tuple = (0.0, 0.0, (0.0, 0.0, 0.0))  # (at, busy_s, moments[0..2]) at the last look: a poll's rates
    record: dict | None = None  # the conversion under way
    switching: bool = False

    def idle(self) -> bool:
        return not (self.queue or self.forwarding or self.batch or self.waiting or self.pending)


class Fleet:
    def __init__(self, prefills: int, decodes: int, capacity: Capacity, seed: int = 1,
                 abandon_s: float | None = None, routing: str = "least") -> None:
        self.capacity = capacity
        self.routing = routing
        self.abandon_s = abandon_s
        self.now = 0.0
        self.rng = random.Random(seed)
        self.servers = [Server(f"p{i}", PREFILL) for i in range(prefills)]
        self.servers += [Server(f"d{i}", DECODE) for i in range(decodes)]
        self._events: list = []
        self._seq = itertools.count()
        self.conversions: list[dict] = []
        self.on_conversion_end: Callable[[dict], None] | None = None
        self.sizes: deque = deque(maxlen=8192)  # (at, prompt, answer) as the router reads them
        self.finished: deque = deque(maxlen=8192)  # the same, at the request's end

    # ---- events -------------------------------------------------------------------------------------
    def at(self, t: float, fn: Callable, *args) -> None:
        heapq.heappush(self._events, (t, next(self._seq), fn, args))

    def run_until(self, t: float) -> None:
        while self._events and self._events[0][0] <= t:
            when, _, fn, args = heapq.heappop(self._events)
            self.now = when
            fn(*args)
        self.now = t

    def pool(self, role: str) -> list[Server]:
        return [s for s in self.servers if s.role == role and s.routable]

    def _least_loaded(self, role: str) -> Server | None:
        """The server a request goes to: the less loaded of two drawn at random (power_of_two, the router's
        count: what bench.rebalance_splits runs live), or the least loaded of all (`routing` "least")."""
        pool = self.pool(role)
        if not pool:
            return None
        if self.routing == "power_of_two" and len(pool) > 2:
            pool = self.rng.sample(pool, 2)
        low = min(s.inflight for s in pool)
        return self.rng.choice([s for s in pool if s.inflight == low])

    # ---- the request path ---------------------------------------------------------------------------
    def arrive(self, req: Req) -> None:
        self.sizes.append((self.now, req.prompt, req.answer))
        self._route(req)
        if self.abandon_s is not None:
            self.at(self.now + self.abandon_s, self._abandon, req)

    def _route(self, req: Req) -> None:
        """Both legs to the least loaded pair (a re-sent request too: its arrival time stays its own)."""
        p, d = self._least_loaded(PREFILL), self._least_loaded(DECODE)
        if p is None or d is None:
            return  # nothing routable: the request fails (counted as missed)
        req.prefill, req.decode = p, d
        for s in (p, d):
            s.started += 1
            s.inflight += 1
        d.pending[req] = None
        p.queue.append(req)
        if not p.forwarding:
            self._forward(p)

    def _abandon(self, req: Req) -> None:
        """The client gave up before its answer ended: the router aborts the request on both its servers."""
        if req.done or req.abandoned:
            return
        req.abandoned = True
        p, d = req.prefill, req.decode
        if req in p.queue:
            p.queue.remove(req)
            p.inflight -= 1
        if d.pending.pop(req, False) is None:
            d.inflight -= 1
        else:
            for place in (d.waiting, d.batch):
                if req in place:
                    place.remove(req)
                    d.inflight -= 1
                    break
        self._check_drained(p)
        self._check_drained(d)

    def _forward(self, p: Server) -> None:
        batch, tokens = [], 0
        while p.queue and (not batch or tokens + p.queue[0].prompt <= self.capacity.max_prefill_tokens):
            req = p.queue.popleft()
            batch.append(req)
            tokens += req.prompt
        if not batch:
            return
        p.forwarding = batch
        took = self.capacity.prefill_overhead_s + self.capacity.prefill_per_token_s * tokens
        self.at(self.now + took, self._forwarded, p, took)

    def _forwarded(self, p: Server, took: float) -> None:
        p.busy_s += took
        batch, p.forwarding = p.forwarding, []
        for req in batch:
            p.inflight -= 1
            if req.abandoned or req.resent_from is p:  # gone, or sent again while in this forward
                if req.resent_from is p:
                    req.resent_from = None
                continue
            req.first_at = self.now
            d = req.decode
            d.pending.pop(req, None)
            if req.done:
                self._finish(d, req)
            else:
                d.waiting.append(req)
                if not d.stepping:
                    self._step(d)
        if p.queue:
            self._forward(p)
        self._check_drained(p)

    def _step(self, d: Server) -> None:
        while d.waiting and len(d.batch) < self.capacity.max_running:
            d.batch.append(d.waiting.popleft())
        if not d.batch:
            d.stepping = False
            self._check_drained(d)
            return
        if not d.stepping:  # the row a batch starting now leaves shown until its 15th step
            d.shown = tuple(d.moments)
        d.stepping = True
        took = self.capacity.step_s + self.capacity.step_per_running_s * len(d.batch)
        self.at(self.now + took, self._stepped, d, took)

    def _stepped(self, d: Server, took: float) -> None:
        size = len(d.batch)
        m = d.moments
        m[0] += 1
        m[1] += size
        m[2] += took * 1e6
        m[3] += size * size
        m[4] += size * took * 1e6
        m[5] += size
        if int(m[0]) % PUBLISH_STEPS == 0:
            d.shown = tuple(m)
        kept = []
        for req in d.batch:
            req.decoded += 1
            req.last_at = self.now
            if req.done:
                self._finish(d, req)
            else:
                kept.append(req)
        d.batch = kept
        self._step(d)

    def _finish(self, d: Server, req: Req) -> None:
        d.inflight -= 1
        self.finished.append((self.now, req.prompt, req.answer))

    # ---- conversions --------------------------------------------------------------------------------
    def convert(self, server: Server, to_role: str, mode: str = "drain") -> None:
        server.routable = False
        server.converting_to = to_role
        record = {"worker_id": server.id, "from_role": server.role, "to_role": to_role, "started_at": self.now,
                  "mode": mode}
        server.record = record
        if mode == "shed" and server.role == DECODE:
            # its requests still waiting on a prefill are aborted on both their servers and sent again, whole
            # (their prefill runs again elsewhere); those whose KV came finish where they are
            for req in list(server.pending):
                p = req.prefill
                server.pending.pop(req, None)
                server.inflight -= 1
                if req in p.queue:
                    p.queue.remove(req)
                    p.inflight -= 1
                    self._check_drained(p)
                else:  # in a forward: it ends for nothing
                    req.resent_from = req.prefill
                self._route(req)
        self._check_drained(server)

    def _check_drained(self, server: Server) -> None:
        if server.converting_to is None or not server.idle() or server.switching:
            return
        server.switching = True
        self.at(self.now + self.capacity.switch_s, self._switched, server)

    def _switched(self, server: Server) -> None:
        record = server.record
        server.role, server.converting_to, server.switching = record["to_role"], None, False
        server.started = server.inflight = 0
        server.routable = True
        record.update(ended_at=self.now, ok=True, secs=self.now - record["started_at"])
        self.conversions.append(record)
        if self.on_conversion_end:
            self.on_conversion_end(record)

    # ---- what the rebalancer sees -------------------------------------------------------------------
    def observe(self, window_s: float) -> Observation:
        views = {PREFILL: [], DECODE: []}
        for s in self.servers:
            if not s.routable:
                continue
            m0 = s.seen[2]
            if s.role == PREFILL:
                view = WorkerView(id=s.id, inflight=s.inflight, started=s.started, running=len(s.forwarding),
                                  waiting=len(s.queue), waiting_queue=len(s.queue), bootstrap=0, inflight_queue=0,
                                  busy_total_s=s.busy_s)
            else:
                shown = s.shown  # what its last published row says, as a poll would read it
                steps = shown[0] - m0[0]
                step_s = (shown[2] - m0[2]) / steps / 1e6 if steps > 0 else None
                fit = step_fit(tuple(shown))
                view = WorkerView(id=s.id, inflight=s.inflight, started=s.started, running=len(s.batch),
                                  max_running=self.capacity.max_running,
                                  waiting=len(s.waiting), waiting_queue=len(s.waiting), prealloc=0, prealloc_ready=0,
                                  transfer=len(s.pending), retracted=0, decode_step_s=step_s,
                                  decode_step_fixed_s=fit.get("decode_step_fixed_s"),
                                  decode_step_per_request_s=fit.get("decode_step_per_request_s"),
                                  tokens_total=shown[5])
            s.seen = (self.now, s.busy_s, tuple((s.moments if s.role == PREFILL else s.shown)[:3]))
            views[s.role].append(view)
        joining = tuple(s.converting_to for s in self.servers if s.converting_to)
        busy = ", ".join(f"{s.id} converting to {s.converting_to}" for s in self.servers if s.converting_to) or None
        sizes = tuple((at, p, a) for at, p, a in self.sizes if at >= self.now - window_s)
        finished = tuple((p, a) for at, p, a in self.finished if at >= self.now - window_s)
        return Observation(finished_sizes=finished, now=self.now, prefill=tuple(views[PREFILL]), decode=tuple(views[DECODE]), busy=busy,
                           converting_into=tuple(sorted(set(joining))), joining=joining, request_sizes=sizes)


# ---- driving a fleet through a workload ---------------------------------------------------------------
@dataclass
class Run:
    requests: list[Req]
    conversions: list[dict]
    decisions: list[dict]
    observations: list[Observation]
    phases: list[tuple[str, float, float]]  # (name, start, end)

    def goodput(self, ttft_s: float, tpot_s: float, phase: int | None = None) -> float:
        reqs = [r for r in self.requests if phase is None or r.phase == phase]
        return sum(r.meets(ttft_s, tpot_s) for r in reqs) / len(reqs) if reqs else 1.0

    def flaps(self) -> int:
        """Conversions that undid one of the same phase (went back the other way within it)."""
        count = 0
        for name, start, end in self.phases:
            inside = [c["to_role"] for c in self.conversions if start <= c["started_at"] < end]
            count += sum(1 for a, b in zip(inside, inside[1:]) if a != b)
        return count


Arrival = tuple[float, int, int, int]  # (at, prompt tokens, answer tokens, phase)


def run(arrivals: list[Arrival], phases: list[tuple[str, float, float]], prefills: int, decodes: int,
        capacity: Capacity, *, config: RebalanceConfig | None = None, decide: Callable | None = None,
        schedule: list[tuple[float, int]] | None = None, drain_s: float = 60.0, seed: int = 1,
        record: bool = False, abandon_s: float | None = 30.0, routing: str = "least") -> Run:
    """One fleet through `arrivals`: static (no `decide`, no `schedule`), driven by a decision core (`decide`
    with `config`), or by a `schedule` of (time, prefill servers) targets (the oracle). A client gives up on a
    request `abandon_s` after sending it (None: never), and the router aborts it on its servers."""
    fleet = Fleet(prefills, decodes, capacity, seed, abandon_s, routing)
    requests = [Req(n, at, prompt, answer, phase) for n, (at, prompt, answer, phase) in enumerate(arrivals)]
    for req in requests:
        fleet.at(req.at, fleet.arrive, req)
    end = phases[-1][2]
    decisions: list[dict] = []
    observations: list[Observation] = []
    if decide is not None:
        box = {"state": initial_state(0.0)}

        def ended(record_: dict) -> None:
            box["state"] = conversion_ended(box["state"], fleet.now, True, record_["to_role"], record_["secs"])
        fleet.on_conversion_end = ended

        def look() -> None:
            obs = fleet.observe(config.window_secs)
            decision = decide(obs, box["state"], config)
            box["state"] = decision.state
            if record:
                observations.append(obs)
                decisions.append(decision.to_dict())
            if decision.convert:
                for wid in decision.workers or (decision.worker_id,):
                    server = next(s for s in fleet.servers if s.id == wid)
                    fleet.convert(server, decision.to_role, decision.conversion_mode or config.conversion_mode)
            if fleet.now + config.interval_secs < end:
                fleet.at(fleet.now + config.interval_secs, look)
        fleet.at(0.0, look)  # as the live rebalancer: a look as it starts, then every interval
    for when, target in schedule or ():
        fleet.at(when, _reach, fleet, target)
    fleet.run_until(end + drain_s)
    return Run(requests, fleet.conversions, decisions, observations, phases)


def _reach(fleet: Fleet, target_prefills: int) -> None:
    """The oracle's move: convert the cheapest servers at once, in parallel, to reach `target_prefills`."""
    prefills, decodes = fleet.pool(PREFILL), fleet.pool(DECODE)
    moves = target_prefills - len(prefills)
    donors, to_role = (decodes, PREFILL) if moves > 0 else (prefills, DECODE)
    for server in sorted(donors, key=lambda s: s.inflight)[:abs(moves)]:
        fleet.convert(server, to_role, "shed" if to_role == PREFILL else "drain")


def redecide(observations: list[Observation], config: RebalanceConfig, decide: Callable,
             conversions: list[dict], started_at: float = 0.0) -> list[dict]:
    """Recorded observations through the decision core again (the conversions' ends fed back at their times,
    failed ones as failures): the decisions it makes now. `started_at`: when the rebalancer started (its
    warm-up counts from then)."""
    state: RebalanceState = initial_state(started_at)
    ends = sorted((c for c in conversions if "ended_at" in c), key=lambda c: c["ended_at"])
    out = []
    for obs in observations:
        while ends and ends[0]["ended_at"] <= obs.now:
            c = ends.pop(0)
            secs = c.get("secs", c["ended_at"] - c["started_at"] if "started_at" in c else None)
            state = conversion_ended(state, c["ended_at"], c.get("ok", True), c["to_role"], secs)
        decision = decide(obs, state, config)
        state = decision.state
        out.append(decision.to_dict())
    return out


def replay_recording(recording: dict, decide: Callable, **changes) -> tuple[list[dict], list[dict]]:
    """A live router's recording (GET /admin/rebalancer/recording) through the decision core: (the decisions it
    made, the ones the core makes now). With `changes` (any RebalanceConfig field), what it would have decided
    with another setting."""
    config = RebalanceConfig().with_changes(recording["config"])
    if changes:
        config = config.with_changes(changes)
    observations = [Observation.from_dict(o) for o in recording["observations"]]
    again = redecide(observations, config, decide, recording["conversions"], recording.get("started_at", 0.0))
    return recording["decisions"], again


def _same(made: dict, again: dict) -> bool:
    return (made["action"], made["reason"], tuple(made.get("workers") or ())) == (
        again["action"], again["reason"], tuple(again.get("workers") or ()))


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json
    from policies.rebalance import decide
    parser = argparse.ArgumentParser(
        prog="python -m bench.replay", description="A live router's rebalancer recording through the decision "
        "core again: `curl ROUTER/admin/rebalancer/recording > rec.json; python -m bench.replay rec.json`. "
        "It says whether the core decides the same, and with --set what it would have decided otherwise.")
    parser.add_argument("recording", help="the JSON of GET /admin/rebalancer/recording")
    parser.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE",
                        help="change a RebalanceConfig field (e.g. window_secs=10)")
    args = parser.parse_args(argv)
    with open(args.recording) as f:
        recording = json.load(f)
    changes = {}
    for item in args.set:
        name, _, value = item.partition("=")
        changes[name] = json.loads(value) if value[:1].isdigit() or value in ("true", "false") else value
    try:
        made, again = replay_recording(recording, decide, **changes)
    except ValueError as exc:  # an unknown field or a bad value: said like any other bad argument
        parser.error(str(exc))
    differ = 0
    for m, a in zip(made, again):
        if not _same(m, a):
            differ += 1
            print(f"t={a['at']:.1f}: recorded {m['action']} ({m['reason']})\n          now {a['action']} ({a['reason']})")
    converts = sum(a["action"] == "convert" for a in again)
    print(f"{len(again)} decisions replayed, {converts} conversions, {differ} differ from the recording")
    return 1 if differ and not changes else 0


if __name__ == "__main__":
    raise SystemExit(main())
