"""What the etcd client returns and raises, and the JSON shapes of etcd's v3 gateway.

The gateway speaks protobuf's JSON mapping: keys and values are base64, 64-bit integers are strings, and a
field at its default value (0, false, empty) is left out, so every reader here defaults it.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Literal


class EtcdError(Exception):
    """Any failure of an etcd call."""


class EtcdUnavailable(EtcdError):
    """No endpoint answered in time (refused, timed out, no leader): nothing was applied."""


class EtcdOutcomeUnknown(EtcdUnavailable):
    """A write was sent but its answer was lost: it may or may not have been applied. Read back to know."""


class EtcdTxnFailed(EtcdError):
    """A conditional write's comparison did not hold; `current` is the key as it stood (None: absent)."""

    def __init__(self, message: str, current: KeyValue | None, revision: int):
        super().__init__(message)
        self.current = current
        self.revision = revision


class EtcdCompacted(EtcdError):
    """The revision asked for (a watch's resume point, a read's revision) was compacted away: reload.
    `compact_revision` is the oldest revision left (0 when etcd did not say: a read)."""

    def __init__(self, message: str, compact_revision: int):
        super().__init__(message)
        self.compact_revision = compact_revision


class EtcdLeaseNotFound(EtcdError):
    """The lease expired or was revoked."""


class EtcdRequestError(EtcdError):
    """etcd refused the request itself (bad argument, too large, ...): retrying will not help."""

    def __init__(self, message: str, code: int, status: int):
        super().__init__(message)
        self.code = code
        self.status = status


# gRPC status codes the gateway reports in its error body
GRPC_NOT_FOUND = 5
GRPC_OUT_OF_RANGE = 11
GRPC_UNAVAILABLE = 14


def error_from_gateway(status: int, body: dict) -> EtcdError:
    """The exception for a gateway error answer (`{"error", "code", "message"}`)."""
    message = str(body.get("message") or body.get("error") or f"HTTP {status}")
    code = int(body.get("code") or 0)
    if "compacted" in message:
        return EtcdCompacted(message, compact_revision=0)
    if code == GRPC_NOT_FOUND and "lease" in message:
        return EtcdLeaseNotFound(message)
    if code == GRPC_UNAVAILABLE or status == 503:
        return EtcdUnavailable(message)
    return EtcdRequestError(message, code, status)


def b64(data: str | bytes) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode("ascii")


def unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


def prefix_end(prefix: str | bytes) -> bytes:
    """The range end that makes [prefix, end) every key starting with prefix (b"\\0": all keys)."""
    raw = bytearray(prefix.encode() if isinstance(prefix, str) else prefix)
    while raw and raw[-1] == 0xFF:
        raw.pop()
    if not raw:
        return b"\0"
    raw[-1] += 1
    return bytes(raw)


@dataclass(frozen=True, slots=True)
class KeyValue:
    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int = 0

    @classmethod
    def from_json(cls, kv: dict) -> KeyValue:
        return cls(key=unb64(kv.get("key")).decode(), value=unb64(kv.get("value")),
                   create_revision=int(kv.get("create_revision", 0)), mod_revision=int(kv.get("mod_revision", 0)),
                   version=int(kv.get("version", 0)), lease=int(kv.get("lease", 0)))


def header_revision(answer: dict) -> int:
    return int(answer.get("header", {}).get("revision", 0))


@dataclass(frozen=True, slots=True)
class RangeResult:
    """Keys in key order, and the store revision they were read at (watch from revision + 1)."""
    kvs: list[KeyValue]
    revision: int
    count: int
    more: bool

    @classmethod
    def from_json(cls, answer: dict, revision: int | None = None) -> RangeResult:
        return cls(kvs=[KeyValue.from_json(kv) for kv in answer.get("kvs", ())],
                   revision=header_revision(answer) if revision is None else revision,
                   count=int(answer.get("count", 0)), more=bool(answer.get("more", False)))


@dataclass(frozen=True, slots=True)
class PutResult:
    revision: int
    prev: KeyValue | None = None


@dataclass(frozen=True, slots=True)
class DeleteResult:
    deleted: int
    revision: int
    prev: list[KeyValue] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class TxnResult:
    """`responses` are the ops of the branch that ran, in order: RangeResult, PutResult or DeleteResult."""
    succeeded: bool
    revision: int
    responses: list[RangeResult | PutResult | DeleteResult]


@dataclass(frozen=True, slots=True)
class LeaseInfo:
    id: int
    ttl: int  # seconds left; -1 when the lease does not exist (expired or revoked)
    granted_ttl: int
    keys: list[str]


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """One change: for a delete, value is b"" and mod_revision is the revision of the deletion."""
    type: Literal["put", "delete"]
    key: str
    value: bytes
    mod_revision: int
    create_revision: int
    version: int
    lease: int

    @classmethod
    def from_json(cls, event: dict) -> WatchEvent:
        kv = event.get("kv", {})
        return cls(type="delete" if event.get("type") == "DELETE" else "put", key=unb64(kv.get("key")).decode(),
                   value=unb64(kv.get("value")), mod_revision=int(kv.get("mod_revision", 0)),
                   create_revision=int(kv.get("create_revision", 0)), version=int(kv.get("version", 0)),
                   lease=int(kv.get("lease", 0)))


_TARGETS = {"create_revision": "CREATE", "mod_revision": "MOD", "version": "VERSION", "value": "VALUE",
            "lease": "LEASE"}
_RESULTS = {"==": "EQUAL", "!=": "NOT_EQUAL", "<": "LESS", ">": "GREATER"}


@dataclass(frozen=True, slots=True)
class Compare:
    """One condition of a transaction: `Compare.absent(key)`, `Compare.mod_revision(key, "==", rev)`, ..."""
    key: str | bytes
    target: str  # create_revision, mod_revision, version, value, lease
    op: str  # ==, !=, <, >
    operand: int | str | bytes

    @classmethod
    def absent(cls, key: str | bytes) -> Compare:
        return cls(key, "create_revision", "==", 0)

    @classmethod
    def exists(cls, key: str | bytes) -> Compare:
        return cls(key, "create_revision", ">", 0)

    @classmethod
    def create_revision(cls, key: str | bytes, op: str, revision: int) -> Compare:
        return cls(key, "create_revision", op, revision)

    @classmethod
    def mod_revision(cls, key: str | bytes, op: str, revision: int) -> Compare:
        return cls(key, "mod_revision", op, revision)

    @classmethod
    def version(cls, key: str | bytes, op: str, version: int) -> Compare:
        return cls(key, "version", op, version)

    @classmethod
    def value(cls, key: str | bytes, op: str, value: str | bytes) -> Compare:
        return cls(key, "value", op, value)

    @classmethod
    def lease(cls, key: str | bytes, op: str, lease_id: int) -> Compare:
        return cls(key, "lease", op, lease_id)

    def to_json(self) -> dict:
        if self.target not in _TARGETS or self.op not in _RESULTS:
            raise ValueError(f"unknown comparison {self.target} {self.op}")
        operand = b64(self.operand) if self.target == "value" else str(int(self.operand))
        return {"key": b64(self.key), "target": _TARGETS[self.target], "result": _RESULTS[self.op],
                self.target: operand}


@dataclass(frozen=True, slots=True)
class Op:
    """One operation of a transaction branch: `Op.put(key, value, lease=id)`, `Op.get(key)`, `Op.delete(key)`."""
    kind: Literal["put", "range", "delete"]
    request: dict

    @classmethod
    def put(cls, key: str | bytes, value: str | bytes, *, lease: int = 0, prev_kv: bool = False) -> Op:
        return cls("put", put_request(key, value, lease=lease, prev_kv=prev_kv))

    @classmethod
    def get(cls, key: str | bytes) -> Op:
        return cls("range", {"key": b64(key)})

    @classmethod
    def get_prefix(cls, prefix: str | bytes) -> Op:
        return cls("range", {"key": b64(prefix), "range_end": b64(prefix_end(prefix))})

    @classmethod
    def delete(cls, key: str | bytes, *, prev_kv: bool = False) -> Op:
        return cls("delete", {"key": b64(key), "prev_kv": prev_kv})

    @classmethod
    def delete_prefix(cls, prefix: str | bytes, *, prev_kv: bool = False) -> Op:
        return cls("delete", {"key": b64(prefix), "range_end": b64(prefix_end(prefix)), "prev_kv": prev_kv})

    def to_json(self) -> dict:
        return {{"put": "request_put", "range": "request_range", "delete": "request_delete_range"}[self.kind]:
                self.request}


def put_request(key: str | bytes, value: str | bytes, *, lease: int = 0, prev_kv: bool = False) -> dict:
    request = {"key": b64(key), "value": b64(value)}
    if lease:
        request["lease"] = str(lease)
    if prev_kv:
        request["prev_kv"] = True
    return request


def put_result(answer: dict, revision: int | None = None) -> PutResult:
    prev = answer.get("prev_kv")
    return PutResult(revision=header_revision(answer) if revision is None else revision,
                     prev=KeyValue.from_json(prev) if prev else None)


def delete_result(answer: dict, revision: int | None = None) -> DeleteResult:
    return DeleteResult(deleted=int(answer.get("deleted", 0)),
                        revision=header_revision(answer) if revision is None else revision,
                        prev=[KeyValue.from_json(kv) for kv in answer.get("prev_kvs", ())])


def txn_result(answer: dict) -> TxnResult:
    revision = header_revision(answer)
    responses: list[RangeResult | PutResult | DeleteResult] = []
    for response in answer.get("responses", ()):
        if "response_range" in response:
            responses.append(RangeResult.from_json(response["response_range"], revision))
        elif "response_put" in response:
            responses.append(put_result(response["response_put"], revision))
        elif "response_delete_range" in response:
            responses.append(delete_result(response["response_delete_range"], revision))
    return TxnResult(succeeded=bool(answer.get("succeeded", False)), revision=revision, responses=responses)
