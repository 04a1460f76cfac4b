"""An asyncio etcd v3 client over etcd's JSON gateway (`/v3/...`), on aiohttp: no gRPC, no new dependency.

Calls go to one endpoint at a time and move to the next when it fails; every call has a deadline (the
client's `timeout` unless given), shared by its attempts. A read is retried on the next endpoint after any
failure. A write is retried only when it surely was not applied (the connection was refused, or etcd said
it has no leader); when its answer is lost after it was sent, the call raises `EtcdOutcomeUnknown` and the
caller reads the key back (a transaction that may have won must not be retried blindly).

    async with EtcdClient(["http://127.0.0.1:2379"]) as etcd:
        await etcd.put("/pdr/prod/x", b"1")
        lease = await etcd.lease(ttl=5)                       # granted and kept alive
        await etcd.create("/pdr/prod/owner", b"me", lease=lease.id)   # EtcdTxnFailed if someone holds it
        snapshot = await etcd.get_prefix("/pdr/prod/")
        async for event in etcd.watch_prefix("/pdr/prod/", start_revision=snapshot.revision + 1): ...
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import aiohttp
import orjson

from router.cluster.etcd_lease import LeaseKeeper
from router.cluster.etcd_types import (
    Compare,
    DeleteResult,
    EtcdLeaseNotFound,
    EtcdOutcomeUnknown,
    EtcdRequestError,
    EtcdTxnFailed,
    EtcdUnavailable,
    KeyValue,
    LeaseInfo,
    Op,
    PutResult,
    RangeResult,
    TxnResult,
    b64,
    delete_result,
    error_from_gateway,
    header_revision,
    prefix_end,
    put_request,
    put_result,
    txn_result,
    unb64,
)
from router.cluster.etcd_watch import Watch

logger = logging.getLogger(__name__)

JSON_HEADERS = {"Content-Type": "application/json"}
# etcd answers these before proposing anything: a write refused this way was surely not applied
_NOT_APPLIED = ("no leader", "too many requests", "not capable")
# a connection that could not be made: the request was not sent (aiohttp < 3.10 has no such class)
_NOT_CONNECTED = (aiohttp.ClientConnectorError,
                  getattr(aiohttp, "ConnectionTimeoutError", aiohttp.ClientConnectorError))


class EtcdClient:
    def __init__(self, endpoints: Sequence[str] | str, *, timeout: float = 5.0, connect_timeout: float = 1.0,
                 session: aiohttp.ClientSession | None = None):
        endpoints = [endpoints] if isinstance(endpoints, str) else list(endpoints)
        if not endpoints:
            raise ValueError("at least one etcd endpoint is needed")
        self.endpoints = [endpoint.rstrip("/") for endpoint in endpoints]
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self._session = session
        self._own_session = session is None
        self._preferred = 0  # the endpoint that answered last: tried first
        self._children: set[Watch | LeaseKeeper] = set()
        self._closed = False

    async def __aenter__(self) -> EtcdClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        """Stop every watch and lease keeper of this client (leases are left to expire), close the session."""
        self._closed = True
        for child in list(self._children):
            await child.close()
        if self._own_session and self._session is not None:
            await self._session.close()
        self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._closed:
            raise RuntimeError("the etcd client is closed")
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=64, ttl_dns_cache=300)
            self._session = aiohttp.ClientSession(connector=connector)
        return self._session

    def endpoint_order(self) -> list[str]:
        """Endpoints starting with the one that answered last."""
        count = len(self.endpoints)
        return [self.endpoints[(self._preferred + step) % count] for step in range(count)]

    def prefer(self, endpoint: str) -> None:
        self._preferred = self.endpoints.index(endpoint)

    async def call(self, path: str, body: dict, *, write: bool, timeout: float | None = None) -> dict:
        """POST a gateway request to the first endpoint that answers; the decoded answer or an EtcdError."""
        budget = self.timeout if timeout is None else timeout
        loop = asyncio.get_running_loop()
        deadline = loop.time() + budget
        data = orjson.dumps(body)
        failures: list[str] = []
        order = self.endpoint_order()
        for attempt, endpoint in enumerate(order):
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            per_try = remaining / (len(order) - attempt)
            limits = aiohttp.ClientTimeout(total=per_try, sock_connect=min(self.connect_timeout, per_try))
            try:
                async with self.session.post(endpoint + path, data=data, headers=JSON_HEADERS,
                                             timeout=limits) as response:
                    status = response.status
                    raw = await response.read()
            except _NOT_CONNECTED as exc:
                failures.append(f"{endpoint}: {_describe(exc)}")  # no connection: nothing was sent
                continue
            except (aiohttp.ClientError, TimeoutError) as exc:
                if write:
                    raise EtcdOutcomeUnknown(f"{path} at {endpoint}: the answer was lost ({_describe(exc)})") from exc
                failures.append(f"{endpoint}: {_describe(exc)}")
                continue
            try:
                answer = orjson.loads(raw) if raw else {}
            except orjson.JSONDecodeError:
                if status == 200:
                    raise EtcdRequestError(f"{endpoint}{path} answered no JSON: is it etcd?", 0, status) from None
                answer = {"message": raw[:200].decode(errors="replace")}
            if status == 200:
                self._preferred = self.endpoints.index(endpoint)
                return answer
            error = error_from_gateway(status, answer)
            if not isinstance(error, EtcdUnavailable):
                raise error
            if write and not any(reason in str(error) for reason in _NOT_APPLIED):
                raise EtcdOutcomeUnknown(f"{path} at {endpoint}: {error}") from error
            failures.append(f"{endpoint}: {error}")
        if len(failures) < len(order):
            failures.append(f"no time left of the call's {budget:g} s")
        raise EtcdUnavailable(f"no etcd endpoint answered {path}: " + "; ".join(failures))

    # ---- keys

    async def get(self, key: str | bytes, *, revision: int = 0, timeout: float | None = None) -> KeyValue | None:
        result = await self._range({"key": b64(key)}, revision, timeout)
        return result.kvs[0] if result.kvs else None

    async def get_prefix(self, prefix: str | bytes, *, revision: int = 0, limit: int = 0, keys_only: bool = False,
                         timeout: float | None = None) -> RangeResult:
        """Every key under prefix (key order), read at one revision: `result.revision` is where to watch from."""
        request = {"key": b64(prefix), "range_end": b64(prefix_end(prefix))}
        if limit:
            request["limit"] = str(limit)
        if keys_only:
            request["keys_only"] = True
        return await self._range(request, revision, timeout)

    async def _range(self, request: dict, revision: int, timeout: float | None) -> RangeResult:
        if revision:
            request["revision"] = str(revision)
        return RangeResult.from_json(await self.call("/v3/kv/range", request, write=False, timeout=timeout))

    async def put(self, key: str | bytes, value: str | bytes, *, lease: int = 0, prev_kv: bool = False,
                  timeout: float | None = None) -> PutResult:
        answer = await self.call("/v3/kv/put", put_request(key, value, lease=lease, prev_kv=prev_kv), write=True,
                                 timeout=timeout)
        return put_result(answer)

    async def delete(self, key: str | bytes, *, prev_kv: bool = False, timeout: float | None = None) -> DeleteResult:
        return await self._delete({"key": b64(key), "prev_kv": prev_kv}, timeout)

    async def delete_prefix(self, prefix: str | bytes, *, prev_kv: bool = False,
                            timeout: float | None = None) -> DeleteResult:
        return await self._delete({"key": b64(prefix), "range_end": b64(prefix_end(prefix)), "prev_kv": prev_kv},
                                  timeout)

    async def _delete(self, request: dict, timeout: float | None) -> DeleteResult:
        return delete_result(await self.call("/v3/kv/deleterange", request, write=True, timeout=timeout))

    async def txn(self, compare: Sequence[Compare], success: Sequence[Op] = (), failure: Sequence[Op] = (), *,
                  timeout: float | None = None) -> TxnResult:
        """If every comparison holds, run success, else failure, atomically. A failed comparison is not an error."""
        body = {"compare": [c.to_json() for c in compare], "success": [op.to_json() for op in success],
                "failure": [op.to_json() for op in failure]}
        return txn_result(await self.call("/v3/kv/txn", body, write=True, timeout=timeout))

    async def _conditional(self, key: str | bytes, compare: Compare, success: Op, what: str,
                           timeout: float | None) -> int:
        result = await self.txn([compare], [success], [Op.get(key)], timeout=timeout)
        if result.succeeded:
            return result.revision
        current = result.responses[0].kvs if result.responses else []
        raise EtcdTxnFailed(f"{what} {key!r}: the comparison failed", current[0] if current else None,
                            result.revision)

    async def create(self, key: str | bytes, value: str | bytes, *, lease: int = 0,
                     timeout: float | None = None) -> int:
        """Put key only if it does not exist: its revision, or EtcdTxnFailed with the holder (`exc.current`)."""
        return await self._conditional(key, Compare.absent(key), Op.put(key, value, lease=lease), "create", timeout)

    async def replace(self, key: str | bytes, value: str | bytes, *, mod_revision: int, lease: int = 0,
                      timeout: float | None = None) -> int:
        """Put key only if it is still at mod_revision (compare-and-swap): the new revision, or EtcdTxnFailed."""
        return await self._conditional(key, Compare.mod_revision(key, "==", mod_revision),
                                       Op.put(key, value, lease=lease), "replace", timeout)

    async def delete_if(self, key: str | bytes, *, mod_revision: int, timeout: float | None = None) -> int:
        """Delete key only if it is still at mod_revision: the revision of the delete, or EtcdTxnFailed."""
        return await self._conditional(key, Compare.mod_revision(key, "==", mod_revision), Op.delete(key), "delete",
                                       timeout)

    async def compact(self, revision: int, *, physical: bool = False, timeout: float | None = None) -> None:
        """Forget the history before revision (watches and reads from before it get EtcdCompacted)."""
        await self.call("/v3/kv/compaction", {"revision": str(revision), "physical": physical}, write=True,
                        timeout=timeout)

    # ---- leases

    async def grant_lease(self, ttl: int, *, lease_id: int = 0, timeout: float | None = None) -> int:
        """A new lease of ttl seconds (not kept alive: see `lease()`); its id."""
        body = {"TTL": str(int(ttl))}
        if lease_id:
            body["ID"] = str(lease_id)
        answer = await self.call("/v3/lease/grant", body, write=True, timeout=timeout)
        if answer.get("error"):
            raise EtcdUnavailable(f"lease grant refused: {answer['error']}")
        return int(answer["ID"])

    async def revoke_lease(self, lease_id: int, *, timeout: float | None = None) -> None:
        """End a lease now and delete its keys; EtcdLeaseNotFound if it already ended."""
        await self.call("/v3/lease/revoke", {"ID": str(lease_id)}, write=True, timeout=timeout)

    async def keep_alive_once(self, lease_id: int, *, timeout: float | None = None) -> int:
        """Renew a lease to its full TTL: the TTL granted, or EtcdLeaseNotFound if it already ended."""
        answer = await self.call("/v3/lease/keepalive", {"ID": str(lease_id)}, write=False, timeout=timeout)
        ttl = int(answer.get("result", {}).get("TTL", 0))
        if ttl <= 0:
            raise EtcdLeaseNotFound(f"lease {lease_id:x} has expired or was revoked")
        return ttl

    async def lease_info(self, lease_id: int, *, keys: bool = False, timeout: float | None = None) -> LeaseInfo:
        answer = await self.call("/v3/lease/timetolive", {"ID": str(lease_id), "keys": keys}, write=False,
                                 timeout=timeout)
        return LeaseInfo(id=lease_id, ttl=int(answer.get("TTL", 0)), granted_ttl=int(answer.get("grantedTTL", 0)),
                         keys=[unb64(key).decode() for key in answer.get("keys", ())])

    async def leases(self, *, timeout: float | None = None) -> list[int]:
        answer = await self.call("/v3/lease/leases", {}, write=False, timeout=timeout)
        return [int(lease["ID"]) for lease in answer.get("leases", ())]

    async def lease(self, ttl: int, *, interval: float | None = None, timeout: float | None = None) -> LeaseKeeper:
        """Grant a lease and keep it alive in the background until `revoke()` or `close()`; see LeaseKeeper."""
        loop = asyncio.get_running_loop()
        asked_at = loop.time()
        lease_id = await self.grant_lease(ttl, timeout=timeout)
        return self.keep_alive(lease_id, ttl, interval=interval, since=asked_at)

    def keep_alive(self, lease_id: int, ttl: int, *, interval: float | None = None,
                   since: float | None = None) -> LeaseKeeper:
        """Keep an existing lease alive in the background (renewed every ttl/3 unless interval is given)."""
        keeper = LeaseKeeper(self, lease_id, ttl, interval=interval, since=since)
        self._children.add(keeper)
        return keeper

    # ---- watches and status

    def watch(self, key: str | bytes, *, start_revision: int = 0, prefix: bool = False,
              probe_interval: float = 5.0) -> Watch:
        """Events on key (or every key under it when prefix) from start_revision (0: from now), in revision
        order, resumed after a disconnect from the revision after the last event delivered."""
        raw = key.encode() if isinstance(key, str) else key
        watch = Watch(self, raw, prefix_end(raw) if prefix else None, start_revision=start_revision,
                      probe_interval=probe_interval)
        self._children.add(watch)
        return watch

    def watch_prefix(self, prefix: str | bytes, *, start_revision: int = 0, probe_interval: float = 5.0) -> Watch:
        return self.watch(prefix, start_revision=start_revision, prefix=True, probe_interval=probe_interval)

    def forget(self, child: Watch | LeaseKeeper) -> None:
        self._children.discard(child)

    async def status(self, *, timeout: float | None = None) -> dict:
        """etcd's maintenance status of the endpoint that answers (version, leader, revision, db size...)."""
        answer = await self.call("/v3/maintenance/status", {}, write=False, timeout=timeout)
        answer["revision"] = header_revision(answer)
        return answer

    async def healthy(self, endpoint: str, *, timeout: float = 2.0) -> bool:
        """Whether one endpoint answers its /health with a leader (the probe of an idle watch)."""
        try:
            async with self.session.get(endpoint + "/health", timeout=aiohttp.ClientTimeout(total=timeout)) as reply:
                return reply.status == 200 and (await reply.json(content_type=None)).get("health") == "true"
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return False


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
