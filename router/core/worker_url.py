"""A worker's URL: checked once, in one canonical form that is the worker's identity, its credentials apart.

Every way a worker gets in (the command line, `POST /workers`, `/add_worker`, `/register`, a discovery
file, etcd discovery, the cluster's records) goes through `parse_worker_url`, so one server has one record
however its URL was written: surrounding whitespace is dropped, scheme and host are lower-cased, an IPv6
address is written compressed and in brackets, a trailing `/` is dropped, the port is always written. What
cannot be a worker's address is refused with the reason: whitespace or control characters inside, a scheme
other than http/https, no host or a host with characters no name has, no port, port 0 or one over 65535, a
path, query or fragment.

Credentials (`http://user:pass@host:port`) are not part of the identity and never shown: `WorkerUrl.url` is
the URL without them (what `GET /workers`, logs, metrics and every answer show), `userinfo` what the control
plane still sends to reach the server (HTTP Basic, as aiohttp sent it from the URL before).
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from router.core.redact import redact_text

_HOST_NAME = re.compile(r"[a-z0-9_]([a-z0-9_.-]*[a-z0-9_])?\.?")
_UNSAFE = re.compile(r"[\s\x00-\x1f\x7f]")


class BadWorkerUrl(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class WorkerUrl:
    url: str  # scheme://host:port, no credentials: the identity, and what is shown
    scheme: str
    host: str  # as a socket takes it (no brackets)
    port: int
    userinfo: str | None = None  # "user:password" as given (percent-encoded), never shown

    @property
    def with_credentials(self) -> str:
        """The URL to hand on to another registration (it parses back to this)."""
        if self.userinfo is None:
            return self.url
        return f"{self.scheme}://{self.userinfo}@{self.url.split('://', 1)[1]}"


def shown(value: object) -> str:
    """A refused value as it may be quoted back (credentials in it redacted)."""
    return redact_text(repr(value)) if isinstance(value, str) else repr(value)


def parse_worker_url(value: object) -> WorkerUrl:
    """The canonical form of a worker URL; BadWorkerUrl saying why it cannot be one."""
    if not isinstance(value, str) or not value.strip():
        raise BadWorkerUrl("worker url must be a non-empty string")
    text = value.strip()
    if _UNSAFE.search(text):
        raise BadWorkerUrl(f"invalid worker url {shown(value)}: whitespace or control characters inside")
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError as exc:
        raise BadWorkerUrl(f"invalid worker url {shown(value)}: {exc}") from None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        raise BadWorkerUrl(f"invalid worker url {shown(value)}: scheme must be http or https")
    if not parts.hostname:
        raise BadWorkerUrl(f"invalid worker url {shown(value)}: no host")
    if port is None:
        raise BadWorkerUrl(f"invalid worker url {shown(value)}: no port")
    if not 1 <= port <= 65535:
        raise BadWorkerUrl(f"invalid worker url {shown(value)}: port must be in 1..65535, got {port}")
    if parts.query or parts.fragment or parts.path not in ("", "/") or text.endswith(("?", "#")):
        raise BadWorkerUrl(f"invalid worker url {shown(value)}: must be scheme://host:port only")
    host = parts.hostname  # lower-cased by urlsplit
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        if ":" in host or not _HOST_NAME.fullmatch(host):
            raise BadWorkerUrl(f"invalid worker url {shown(value)}: {host!r} is not a host name or address") \
                from None
        written = host
    else:
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        host = str(address)
        written = f"[{host}]" if address.version == 6 else host
    userinfo = parts.netloc.rpartition("@")[0] if "@" in parts.netloc else None
    return WorkerUrl(f"{scheme}://{written}:{port}", scheme, host, port, userinfo or None)


def worker_url_problem(value: object) -> str | None:
    """Why `value` cannot be a worker URL, or None."""
    try:
        parse_worker_url(value)
    except BadWorkerUrl as exc:
        return str(exc)
    return None


def identity(value: str) -> str:
    """The key a worker is known by for a URL as a caller wrote it (itself when it is no worker URL)."""
    try:
        return parse_worker_url(value).url
    except BadWorkerUrl:
        return value.strip().rstrip("/")
