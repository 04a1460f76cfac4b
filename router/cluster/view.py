"""What a replica shows of its cluster: `GET /admin/cluster` (its route is `server/app.py`'s) and the
`pd_router_cluster_*` metrics.

The view (what `pd-router ctl cluster` prints): the replicas with their leases (TTL left, seconds since the
last renewal), the leader, the operations running and who runs them, the last ones taken over, etcd's
endpoints and their health, and this replica's own state (applied revision, watch, lease, writes).
The metrics are read at scrape time (nothing is counted on the request path).
"""

from __future__ import annotations

import asyncio
import time
from aiohttp import web
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from router.cluster.etcd_types import EtcdError
from router.cluster.etcd_keys import decode
from router.cluster.runtime import Cluster

LEASE_INFO_TIMEOUT_S = 1.0


async def _lease_ages(cluster: Cluster, leases: list[int]) -> dict[int, dict]:
    async def one(lease: int) -> tuple[int, dict]:
        try:
            info = await cluster.client.lease_info(lease, timeout=LEASE_INFO_TIMEOUT_S)
        except EtcdError:
            return lease, {}
        return lease, {"ttl_s": info.granted_ttl, "left_s": info.ttl,
                       "renewed_s_ago": max(info.granted_ttl - info.ttl, 0) if info.ttl >= 0 else None}

    return dict(await asyncio.gather(*(one(lease) for lease in leases)))


async def describe(cluster: Cluster) -> dict:
    keys, mirror = cluster.keys, cluster.mirror
    now = time.time()
    replica_kvs = mirror.under(keys.replicas)
    (ages, endpoints) = await asyncio.gather(_lease_ages(cluster, [kv.lease for kv in replica_kvs]),
                                             cluster.status.endpoints())
    leader = cluster.leadership.leader
    replicas = []
    for kv in replica_kvs:
        record = decode(kv.value)
        replica_id = record.get("id") or keys.kind_of(kv.key)[1]
        started = record.get("started_at")
        replicas.append({"id": replica_id, "host": record.get("host"), "pid": record.get("pid"),
                         "port": record.get("port"), "version": record.get("version"),
                         "this": replica_id == cluster.identity.id, "leader": replica_id == leader,
                         "up_s": round(now - started, 1) if isinstance(started, (int, float)) else None,
                         "lease": f"{kv.lease:x}", **{f"lease_{k}": v for k, v in ages.get(kv.lease, {}).items()}})
    operations = [{"id": r.get("id"), "kind": r.get("kind"), "scope": r.get("scope"), "owner": r.get("owner"),
                   "step": r.get("step"), "age_s": round(now - r.get("started_at", now), 3),
                   "taken_over_from": r.get("taken_over_from")}
                  for r in cluster.coordinator.running()]
    lease = cluster.membership.lease_id
    return {
        "cluster": keys.name,
        "prefix": keys.prefix,
        "replica": cluster.identity.id,
        "leader": leader,
        "replicas": replicas,
        "operations": operations,
        "taken_over": list(cluster.takeover.taken),
        "etcd": {"endpoints": endpoints, **cluster.status.to_dict()},
        "applied_revision": mirror.revision,
        "watch": {"connected": mirror.watching, "reconnects": mirror.watch_reconnects, "reloads": mirror.reloads,
                  "last_event_s_ago": None if mirror.last_event_at is None
                  else round(time.monotonic() - mirror.last_event_at, 3)},
        "lease": {"id": f"{lease:x}" if lease else None, "ttl_s": cluster.membership.ttl,
                  "joins": cluster.membership.joins},
        "fleet_holds": dict(cluster.gate.closed),
        # workers the cluster removed, newest first: no command line brings them back (POST /workers does)
        "removed": sorted(({k: v for k, v in decode(kv.value).items() if k in ("url", "role", "by", "how", "at")}
                           for kv in mirror.under(keys.removals)), key=lambda r: -float(r.get("at") or 0))[:50],
        "published": cluster.publisher.stats(),
    }


CLUSTER = web.AppKey("cluster", Cluster)


class ClusterCollector:
    """The cluster's state at scrape time."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster

    def collect(self):
        cluster = self.cluster
        prefix = "pd_router_cluster"
        gauges = [
            ("replicas", "router replicas this replica sees (live keys under replicas/)",
             len(cluster.mirror.under(cluster.keys.replicas))),
            ("leader", "1 when this replica runs the singleton loops (rebalancer, weight reconciler)",
             int(cluster.leadership.leading)),
            ("etcd_reachable", "1 when etcd answered this replica's last call",
             int(bool(cluster.status.reachable))),
            ("lease_alive", "1 while this replica holds a live etcd lease", int(cluster.membership.alive)),
            ("applied_revision", "the etcd revision this replica has applied", cluster.mirror.revision),
            ("etcd_revision", "etcd's revision at its last status answer", cluster.status.revision),
            ("watch_connected", "1 while this replica's watch of the cluster's keys is open",
             int(cluster.mirror.watching)),
            ("last_event_age_seconds", "seconds since this replica's watch brought a change",
             -1 if cluster.mirror.last_event_at is None else time.monotonic() - cluster.mirror.last_event_at),
            ("publish_pending", "changes made here not yet written to etcd", cluster.publisher.pending_count),
        ]
        for name, help_text, value in gauges:
            yield GaugeMetricFamily(f"{prefix}_{name}", help_text, value=value)
        running = GaugeMetricFamily(f"{prefix}_operations_running", "operations running in the cluster",
                                    labels=["kind"])
        counts: dict[str, int] = {}
        for record in cluster.coordinator.running():
            counts[str(record.get("kind"))] = counts.get(str(record.get("kind")), 0) + 1
        for kind, count in sorted(counts.items()):
            running.add_metric([kind], count)
        yield running
        yield CounterMetricFamily(f"{prefix}_takeovers", "operations this replica took over from a dead replica",
                                  value=cluster.takeover.count)
        yield CounterMetricFamily(f"{prefix}_joins", "times this replica joined (again, after losing its lease)",
                                  value=cluster.membership.joins)
