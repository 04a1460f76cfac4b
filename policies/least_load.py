"""least_load: the worker whose own load report says it will get to a new request soonest (SMG's).

The score, in seconds, lower is better (lightseekorg/smg policies/least_load.rs):

    (queued tokens + tokens routed since its report) / throughput  +  kv_pressure_weight x k / (1 - k)

- queued tokens: the server's `num_waiting_uncached_tokens` (its prefill work waiting; 0 on a decode);
- tokens routed since the report: this policy credits each request it sends to a worker with
  `--least-load-mean-prefill-tokens` per sequence (the peers' rule when a request is not tokenized) until that
  worker's next report, so that a whole poll interval of arrivals does not land on the one worker that looked
  idle;
- throughput: the server's `gen_throughput`, or `--least-load-default-throughput` when it reports none (a
  prefill server generates nothing: in a prefill pool the drain time is measured at the default rate, the
  same for every server, so prefills compare by their queued work);
- k: the server's KV usage (`token_usage`, the highest of its ranks where SMG averages them), a barrier that
  grows without bound as KV fills.
A worker without a report while others have one is scored as its router-side count times the mean prefill at
the pool's mean throughput; with no report anywhere (the load poll off, or failing), the fewest requests by
the router's count wins. `--least-load-max-waiting-requests N` (0: off) leaves out workers whose reported
waiting requests plus those routed since reached N, unless that leaves none. Ties: pool order.

The reports are the load monitor's (`worker.server_load`, router/control/load_monitor.py): the policy never
asks a server. `ExpectedWait` is also power_of_two's `expected_wait` metric.
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence

from .base import Candidate, Policy, RequestInfo
from .params import PolicyParams


class ExpectedWait:
    """The score and its since-the-report credits, per worker."""

    def __init__(self, params: PolicyParams) -> None:
        self.kv_weight = params.least_load_kv_pressure_weight
        self.default_throughput = params.least_load_default_throughput
        self.mean_tokens = params.least_load_mean_prefill_tokens
        # worker id -> (taken_at of the report the credit is on top of, tokens, requests)
        self._credits: dict[str, tuple[float, int, int]] = {}

    def credit(self, worker: Candidate) -> tuple[int, int]:
        """Tokens and requests routed to the worker since its last report."""
        load = getattr(worker, "server_load", None)
        entry = self._credits.get(worker.id)
        if entry is None or load is None or entry[0] != load.taken_at:
            return 0, 0
        return entry[1], entry[2]

    def routed(self, worker: Candidate, sequences: int) -> None:
        load = getattr(worker, "server_load", None)
        if load is None:
            return
        tokens, requests = self.credit(worker)
        self._credits[worker.id] = (load.taken_at, tokens + sequences * self.mean_tokens, requests + sequences)

    def forget(self, worker: Candidate) -> None:
        self._credits.pop(worker.id, None)

    def scores(self, candidates: Sequence[Candidate]) -> list[float]:
        loads = [getattr(w, "server_load", None) for w in candidates]
        reported = [load for load in loads if load is not None]
        if not reported:
            return [float(w.inflight) for w in candidates]
        rates = [r for load in reported if load.report is not None and (r := load.report.gen_throughput or 0) > 0]
        nominal = sum(rates) / len(rates) if rates else self.default_throughput
        out = []
        for worker, load in zip(candidates, loads):
            if load is None:
                out.append(worker.inflight * self.mean_tokens / nominal)
                continue
            report = load.report
            queued = (report.waiting_uncached_tokens or 0) if report is not None else 0
            rate = (report.gen_throughput or 0) if report is not None else 0
            k = min(max(load.token_usage or 0.0, 0.0), 0.999)
            out.append((queued + self.credit(worker)[0]) / (rate if rate > 0 else self.default_throughput)
                       + self.kv_weight * k / (1 - k))
        return out


class LeastLoadPolicy(Policy):
    name = "least_load"
    reads_server_load = True

    def __init__(self, params: PolicyParams | None = None) -> None:
        params = params or PolicyParams()
        if problems := params.problems():
            raise ValueError("; ".join(problems))
        self.wait = ExpectedWait(params)
        self._max_waiting = params.least_load_max_waiting_requests
        self.decisions: Counter[str] = Counter()  # reports, no_reports, capped

    @classmethod
    def build(cls, params: PolicyParams, rng=None) -> "LeastLoadPolicy":
        return cls(params)

    def _under_cap(self, candidates: Sequence[Candidate]) -> Sequence[Candidate]:
        cap = self._max_waiting
        if cap <= 0:
            return candidates
        kept = [w for w in candidates
                if (load := getattr(w, "server_load", None)) is None or load.waiting + self.wait.credit(w)[1] < cap]
        if len(kept) < len(candidates):
            self.decisions["capped"] += 1
        return kept or candidates

    def select(self, candidates: Sequence[Candidate], request: RequestInfo) -> Candidate:
        pool = self._under_cap(candidates)
        scores = self.wait.scores(pool)
        chosen = pool[scores.index(min(scores))]
        self.decisions["reports" if any(getattr(w, "server_load", None) for w in pool) else "no_reports"] += 1
        self.wait.routed(chosen, max(1, request.batch_size))
        return chosen

    def on_worker_removed(self, worker: Candidate) -> None:
        self.wait.forget(worker)

    def state(self) -> dict:
        return {"name": self.name, "kv_pressure_weight": self.wait.kv_weight,
                "default_throughput": self.wait.default_throughput, "mean_prefill_tokens": self.wait.mean_tokens,
                "max_waiting_requests": self._max_waiting, "decisions": dict(self.decisions)}
