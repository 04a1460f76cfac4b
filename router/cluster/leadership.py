"""One replica at a time runs the cluster's singleton loops (the rebalancer, the weight reconciler): the one
whose lease holds the `leader` key. Every replica campaigns when the key is absent (create-if-absent on its
own lease); when the leader dies its key goes with its lease and the others campaign again."""

from __future__ import annotations

import asyncio
import logging

from router.cluster.etcd import EtcdClient
from router.cluster.etcd_types import EtcdError, EtcdTxnFailed
from router.cluster.etcd_keys import ClusterKeys, decode, encode
from router.cluster.mirror import Mirror
from router.cluster.replica import Membership

logger = logging.getLogger(__name__)

CAMPAIGN_RETRY_S = 1.0


class Leadership:
    def __init__(self, client: EtcdClient, keys: ClusterKeys, mirror: Mirror, membership: Membership) -> None:
        self.client = client
        self.keys = keys
        self.mirror = mirror
        self.membership = membership
        self.terms = 0  # times this replica became the leader

    @property
    def leader(self) -> str | None:
        kv = self.mirror.get(self.keys.leader)
        return decode(kv.value).get("replica") if kv is not None else None

    @property
    def leading(self) -> bool:
        """This replica holds the key on its live lease (a key left from a lost lease does not count)."""
        kv = self.mirror.get(self.keys.leader)
        lease = self.membership.lease_id
        return kv is not None and lease != 0 and kv.lease == lease

    async def run(self) -> None:
        """Campaign whenever nobody leads and this replica has a lease (cancel to stop)."""
        while True:
            await self.mirror.wait_for(lambda: self.mirror.get(self.keys.leader) is None
                                       and self.membership.alive, timeout=CAMPAIGN_RETRY_S)
            if self.mirror.get(self.keys.leader) is not None or not self.membership.alive:
                continue
            lease = self.membership.lease_id
            try:
                await self.client.create(self.keys.leader, encode({"replica": self.membership.identity.id}),
                                         lease=lease)
            except EtcdTxnFailed:
                pass  # another replica won: the watch brings its key
            except EtcdError as exc:
                logger.debug("cluster: campaigning for the leadership failed (%s)", exc)
            else:
                self.terms += 1
                logger.info("cluster %s: replica %s leads (runs the rebalancer and the weight reconciler)",
                            self.keys.name, self.membership.identity.id)
                # until the watch shows the key, `leading` is False: wait for it rather than campaign again
                await self.mirror.wait_for(lambda: self.mirror.get(self.keys.leader) is not None,
                                           timeout=CAMPAIGN_RETRY_S)
            await asyncio.sleep(0)
