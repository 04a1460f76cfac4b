"""Announce one worker to pd-router through etcd, under a lease: run it beside the server (a sidecar, or a line
after the server's start in the same container).

    python -m router.cluster.announce --etcd-endpoints http://etcd:2379 --cluster-name prod \\
        --url http://10.0.0.7:30000 --role prefill --bootstrap-port 8998

It writes `/pd-router/<cluster-name>/v1/discovery/<url>` (router/cluster/discovery_watch.py) bound to a lease
of `--ttl-secs` and keeps the lease alive. The key goes when the announcer stops: at once on SIGTERM/SIGINT
(the lease is revoked, exit 0), within the TTL when it dies (the lease expires). It announces only while
the server answers `GET --check-path` (`/model_info`: it answers while the server is paused, unlike
`/health`, so a weight update does not withdraw the fleet): first when the server answers, withdrawn after
`--check-failures` failed checks in a row, announced again when it answers. `--no-check` announces at once.
A lease lost while etcd was unreachable, or a key deleted by hand, is announced again.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

import aiohttp
import orjson

from router.cluster.discovery_watch import discovery_key
from router.cluster.etcd import EtcdClient
from router.cluster.etcd_lease import LeaseKeeper
from router.cluster.etcd_types import EtcdError
from router.control.worker_sources import Listing, ListingError, parse_listing
from router.core.config import DISCOVER

logger = logging.getLogger("router.cluster.announce")


class Announcer:
    def __init__(self, client: EtcdClient, cluster_name: str, listing: Listing, *, ttl: int,
                 check: "ServerCheck | None", interval: float, failures: int) -> None:
        self.client = client
        self.key = discovery_key(cluster_name, listing.url)
        value = {"url": listing.url}
        if listing.role is not None:
            value["worker_type"] = listing.role.value
        if listing.bootstrap_port is not DISCOVER:
            value["bootstrap_port"] = listing.bootstrap_port
        self.value = orjson.dumps(value)
        self.ttl = ttl
        self.check = check
        self.interval = interval
        self.failures = failures
        self.lease: LeaseKeeper | None = None
        self._failed = 0

    async def _wanted(self) -> bool:
        """Whether the server should be announced now (it answers its check, or failed fewer times in a row)."""
        if self.check is None:
            return True
        if await self.check.answers():
            self._failed = 0
            return True
        self._failed += 1
        if self._failed == 1 or self._failed == self.failures:
            logger.warning("%s did not answer %s (%d in a row)", self.check.url, self.check.path, self._failed)
        return self.lease is not None and self._failed < self.failures

    async def step(self) -> None:
        wanted = await self._wanted()
        if self.lease is not None and not self.lease.alive:
            logger.warning("lease %x lost (%s): announcing again", self.lease.id, self.lease.lost_reason)
            self.lease = None
        if not wanted:
            if self.lease is not None:
                await self.withdraw(f"the server failed {self._failed} checks in a row")
            return
        try:
            if self.lease is None:
                self.lease = await self.client.lease(self.ttl)
                await self.client.put(self.key, self.value, lease=self.lease.id)
                logger.info("announced %s (lease %x, ttl %d s): %s", self.key, self.lease.id, self.ttl,
                            self.value.decode())
                return
            kv = await self.client.get(self.key)
            if kv is None or kv.lease != self.lease.id or kv.value != self.value:
                await self.client.put(self.key, self.value, lease=self.lease.id)
                logger.warning("%s was gone or changed: announced again", self.key)
        except EtcdError as exc:
            logger.warning("etcd: %s; trying again in %g s", exc, self.interval)

    async def withdraw(self, why: str) -> None:
        lease, self.lease = self.lease, None
        if lease is not None:
            await lease.revoke()
            logger.info("withdrew %s (%s)", self.key, why)

    async def run(self, stop: asyncio.Event) -> None:
        try:
            while not stop.is_set():
                await self.step()
                try:
                    await asyncio.wait_for(stop.wait(), self.interval)
                except TimeoutError:
                    pass
        finally:
            await self.withdraw("stopped")


class ServerCheck:
    def __init__(self, session: aiohttp.ClientSession, url: str, path: str, api_key: str | None,
                 timeout: float) -> None:
        self.session = session
        self.url = url
        self.path = path
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = aiohttp.ClientTimeout(total=timeout)

    async def answers(self) -> bool:
        try:
            async with self.session.get(self.url + self.path, headers=self.headers, timeout=self.timeout) as resp:
                await resp.read()
                return resp.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m router.cluster.announce",
                                description="Announce one worker to pd-router through etcd, under a lease.")
    p.add_argument("--etcd-endpoints", nargs="+", required=True, metavar="URL", help="etcd client URLs")
    p.add_argument("--cluster-name", default="pd-router",
                   help="the router's cluster name: keys under /pd-router/NAME/v1/discovery/ (default: pd-router)")
    p.add_argument("--url", required=True, help="the server's URL, as the router reaches it")
    p.add_argument("--role", "--worker-type", dest="role", choices=("prefill", "decode"),
                   help="default: the server's live role, read by the router")
    p.add_argument("--bootstrap-port", help="a prefill's bootstrap port, or 'none'; default: the server's own")
    p.add_argument("--ttl-secs", type=int, default=10, help="the lease: how long the key outlives this process "
                                                            "(default: 10)")
    p.add_argument("--check-path", default="/model_info", help="announce while GET URL+PATH answers 200 "
                                                               "(default: /model_info)")
    p.add_argument("--no-check", action="store_true", help="announce at once, whatever the server answers")
    p.add_argument("--check-interval-secs", type=float, default=2.0, help="default: 2")
    p.add_argument("--check-failures", type=int, default=3,
                   help="withdraw after this many failed checks in a row (default: 3)")
    p.add_argument("--worker-api-key", default=os.environ.get("PD_ROUTER_WORKER_API_KEY"),
                   help="the key the server requires (env PD_ROUTER_WORKER_API_KEY)")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    return p


def listing_from(args: argparse.Namespace) -> Listing:
    entry: dict = {"url": args.url}
    if args.role:
        entry["worker_type"] = args.role
    if args.bootstrap_port is not None:
        port = args.bootstrap_port
        entry["bootstrap_port"] = None if port.lower() in ("none", "null") else int(port) if port.isdigit() else port
    return parse_listing(entry, "announce")


async def announce(args: argparse.Namespace, listing: Listing) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    async with EtcdClient(args.etcd_endpoints, timeout=min(5.0, args.ttl_secs / 2)) as client, \
            aiohttp.ClientSession() as session:
        check = None if args.no_check else ServerCheck(session, listing.url, args.check_path, args.worker_api_key,
                                                         timeout=max(1.0, args.check_interval_secs))
        announcer = Announcer(client, args.cluster_name, listing, ttl=args.ttl_secs, check=check,
                              interval=args.check_interval_secs, failures=max(1, args.check_failures))
        await announcer.run(stop)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        listing = listing_from(args)
    except ListingError as exc:
        parser.error("; ".join(exc.problems))
    if not 2 <= args.ttl_secs <= 3600:
        parser.error("--ttl-secs must be in 2..3600")
    if not args.check_interval_secs > 0:
        parser.error("--check-interval-secs must be positive")
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(announce(args, listing))
    return 0


if __name__ == "__main__":
    sys.exit(main())
