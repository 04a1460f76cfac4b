"""The key layout of one cluster in etcd, under `/pd-router/<cluster-name>/v1/` (docs/CLUSTER.md).

    replicas/<replica-id>            a live replica (on its lease): membership is these keys
    leader                           the replica that runs the singleton loops (rebalancer, reconciler), leased
    workers/<url>                    one server: role, bootstrap port, admin state, hold, facts (persistent)
    removed/<url>                    a server the cluster removed: no command line brings it back (persistent,
                                     until it is registered again on purpose; the newest coordinator.MAX_REMOVALS kept)
    fleet                            the fleet's weight version and holds (persistent)
    locks/fleet | locks/abort        the one fleet-wide operation running now, on its owner's lease
    locks/worker/<url>               the one operation on that server (a conversion, a reinstate), leased
    ops/<op-id>                      an operation's record: kind, owner, step, plan, outcome (persistent)
    acks/<op-id>/<replica-id>        a replica's answer to an operation's barrier (on the replica's lease)

A URL in a key is percent-encoded whole (`http%3A%2F%2F10.0.0.1%3A30000`), so a key has one meaning and the
prefix of one server never matches another's. Values are JSON objects.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import quote, unquote

import orjson

LAYOUT_VERSION = "v1"


def encode(value: dict) -> bytes:
    return orjson.dumps(value)


def decode(raw: bytes) -> dict:
    """A record's value; an unreadable one (another version's, a hand-written key) reads as empty."""
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


@dataclass(frozen=True, slots=True)
class ClusterKeys:
    name: str

    @property
    def prefix(self) -> str:
        return f"/pd-router/{self.name}/{LAYOUT_VERSION}/"

    # ---- whole keys ----------------------------------------------------------------------------------
    def replica(self, replica_id: str) -> str:
        return f"{self.prefix}replicas/{replica_id}"

    @property
    def leader(self) -> str:
        return f"{self.prefix}leader"

    def worker(self, url: str) -> str:
        return f"{self.prefix}workers/{quote(url, safe='')}"

    def removal(self, url: str) -> str:
        return f"{self.prefix}removed/{quote(url, safe='')}"

    @property
    def fleet(self) -> str:
        return f"{self.prefix}fleet"

    def lock(self, scope: str) -> str:
        """`scope`: "fleet", "abort", or "worker/<url>" (the URL is encoded here)."""
        if scope.startswith("worker/"):
            return f"{self.prefix}locks/worker/{quote(scope.removeprefix('worker/'), safe='')}"
        return f"{self.prefix}locks/{scope}"

    def op(self, op_id: str) -> str:
        return f"{self.prefix}ops/{op_id}"

    def ack(self, op_id: str, replica_id: str) -> str:
        return f"{self.prefix}acks/{op_id}/{replica_id}"

    # ---- prefixes ------------------------------------------------------------------------------------
    @property
    def replicas(self) -> str:
        return f"{self.prefix}replicas/"

    @property
    def workers(self) -> str:
        return f"{self.prefix}workers/"

    @property
    def removals(self) -> str:
        return f"{self.prefix}removed/"

    @property
    def locks(self) -> str:
        return f"{self.prefix}locks/"

    @property
    def ops(self) -> str:
        return f"{self.prefix}ops/"

    def acks(self, op_id: str) -> str:
        return f"{self.prefix}acks/{op_id}/"

    # ---- reading a key back --------------------------------------------------------------------------
    def kind_of(self, key: str) -> tuple[str, str]:
        """("replica", id), ("worker", url), ("removed", url), ("fleet", ""), ("leader", ""), ("lock", scope),
        ("op", id), ("ack", "op-id/replica-id"), or ("other", key)."""
        if not key.startswith(self.prefix):
            return "other", key
        rest = key[len(self.prefix):]
        if rest in ("fleet", "leader"):
            return rest, ""
        head, _, tail = rest.partition("/")
        if head == "replicas":
            return "replica", tail
        if head == "workers":
            return "worker", unquote(tail)
        if head == "removed":
            return "removed", unquote(tail)
        if head == "locks":
            if tail.startswith("worker/"):
                return "lock", worker_scope(unquote(tail.removeprefix("worker/")))
            return "lock", tail
        if head == "ops":
            return "op", tail
        if head == "acks":
            return "ack", tail
        return "other", key


def worker_scope(url: str) -> str:
    return f"worker/{url}"
