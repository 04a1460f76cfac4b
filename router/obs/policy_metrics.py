"""Prometheus view of the policies, the load monitor and the rebalancer, read at scrape time (a collector
registered on the app's CollectorRegistry: nothing is counted on the request path)."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from policies import Policy, effective_load
from policies.rebalance import GUARDS, RebalanceMode
from router.control.load_monitor import LoadMonitor
from router.core.registry import Registry, Role
from router.flows.rebalancer import Rebalancer

PREFIX = "pd_router"


class PolicyCollector:
    def __init__(self, registry: Registry, policies: dict[Role, Policy], monitor: LoadMonitor,
                 rebalancer: Rebalancer) -> None:
        self.registry, self.policies, self.monitor, self.rebalancer = registry, policies, monitor, rebalancer

    def describe(self):
        return []

    def collect(self):
        yield from self._workers()
        yield from self._policies()
        yield from self._rebalancer()

    def _workers(self):
        labels = ["worker", "role"]
        effective = GaugeMetricFamily(f"{PREFIX}_worker_effective_load",
                                      "requests on the worker as load-aware policies see them", labels=labels)
        reported = GaugeMetricFamily(f"{PREFIX}_worker_reported_requests",
                                     "the server's own last report (/v1/loads)", labels=labels + ["state"])
        kv = GaugeMetricFamily(f"{PREFIX}_worker_kv_usage", "KV cache usage the server last reported",
                               labels=labels)
        for w in self.registry.workers():
            key = [w.url, w.role.value]
            effective.add_metric(key, effective_load(w))
            load = w.server_load
            if load is not None:
                reported.add_metric(key + ["running"], load.running)
                reported.add_metric(key + ["waiting"], load.waiting)
                if load.token_usage is not None:
                    kv.add_metric(key, load.token_usage)
        yield from (effective, reported, kv)
        yield CounterMetricFamily(f"{PREFIX}_load_polls", "load reports asked for", value=self.monitor.polls)
        yield CounterMetricFamily(f"{PREFIX}_load_poll_failures", "load reports that did not come",
                                  value=self.monitor.failures)

    def _policies(self):
        decisions = CounterMetricFamily(f"{PREFIX}_policy_decisions", "choices by kind (cache_aware)",
                                        labels=["role", "policy", "decision"])
        for role, policy in self.policies.items():
            for kind, count in getattr(policy, "decisions", {}).items():
                decisions.add_metric([role.value, policy.name, kind], count)
        yield decisions

    def _rebalancer(self):
        r = self.rebalancer
        mode = GaugeMetricFamily(f"{PREFIX}_rebalancer_mode", "1 for the rebalancer's mode", labels=["mode"])
        for m in RebalanceMode:
            mode.add_metric([m.value], 1 if r.config.mode is m else 0)
        yield mode
        decisions = CounterMetricFamily(f"{PREFIX}_rebalancer_decisions", "decisions by action",
                                        labels=["action"])
        for action in ("convert", "hold"):
            decisions.add_metric([action], r.counters.get(f"decisions_{action}", 0))
        yield decisions
        guards = CounterMetricFamily(f"{PREFIX}_rebalancer_guard_holds", "decisions held back, by guard",
                                     labels=["guard"])
        for guard in GUARDS:
            guards.add_metric([guard], r.counters.get(f"guard_{guard}", 0))
        yield guards
        conversions = CounterMetricFamily(f"{PREFIX}_rebalancer_conversions",
                                          "conversions the rebalancer started, finished, or only advised",
                                          labels=["outcome"])
        for outcome, key in (("advised", "would_convert"), ("started", "conversions_started"),
                             ("succeeded", "conversions_succeeded"), ("failed", "conversions_failed")):
            conversions.add_metric([outcome], r.counters.get(key, 0))
        yield conversions
        refills = CounterMetricFamily(f"{PREFIX}_rebalancer_refills",
                                      "conversions refilling a pool left without a routable server",
                                      labels=["outcome"])
        for outcome, key in (("advised", "would_refill"), ("started", "refills_started"),
                             ("succeeded", "refills_succeeded"), ("failed", "refills_failed")):
            refills.add_metric([outcome], r.counters.get(key, 0))
        yield refills
        fitted = next((d["model"] for d in reversed(r.decisions) if (d.get("model") or {}).get("now")), None)
        if fitted is not None:  # the newest decision whose model was fitted
            load = GaugeMetricFamily(f"{PREFIX}_pool_load", "the fleet model's load on each pool at the current "
                                     "split (1.0 = saturated): prefill compute, decode compute", labels=["role"])
            load.add_metric(["prefill"], fitted["now"]["prefill_load"])
            load.add_metric(["decode"], fitted["now"]["decode_load"])
            yield load
            attainment = GaugeMetricFamily(f"{PREFIX}_rebalancer_predicted_attainment",
                                           "the share of requests the fleet model predicts within both SLO "
                                           "targets over its horizon: at the current split, and at the best",
                                           labels=["split"])
            candidates = fitted.get("candidates") or []
            current = next((c for c in candidates if c["moves"] == 0), None)
            if current is not None:
                attainment.add_metric(["current"], current["value"])
            if candidates:
                attainment.add_metric(["best"], max(c["value"] for c in candidates))
            yield attainment
