"""A pd-router is never a worker: how a router knows an address is itself, or another pd-router.

- Itself by address: a worker URL whose port is the router's own `--port` and whose host is an address the
  router listens on: with `--host 0.0.0.0` (or `::`, or empty) any address of this machine (loopback, every
  interface's, the unspecified address itself), else the addresses `--host` names. `--replicas N` share the
  port, so this covers every replica of the host. Whether an address is this machine's is asked of the kernel
  (a socket bound to it), not guessed.
- Any pd-router by what it answers: every call a router makes to a server carries `X-PD-Router-Hop`, and a
  pd-router answers a call that carries it, whatever the route, with a 400 whose body holds `pd_router` (its
  instance); its `/server_info` and `/model_info` answers hold it too. SGLang 0.5.23 never answers a field
  named `pd_router` (`/server_info` is its `ServerArgs`, `internal_states` and `version`; `/model_info` its
  model facts), nor does the simulator.
- Fan-outs cannot recurse: a router receiving a call from another router's fan-out (the hop header) does
  nothing with it, so an abort, flush, pause or info call reaches at most one router beyond its origin.
"""

from __future__ import annotations

import ipaddress
import secrets
import socket

from aiohttp import web

from router.core.errors import json_response

HOP_HEADER = "X-PD-Router-Hop"
MARKER_FIELD = "pd_router"
INSTANCE = secrets.token_hex(8)  # this process (each replica of --replicas N is its own)
HOP_LINE = f"{HOP_HEADER}: {INSTANCE}\r\n".encode()  # the legs' wire form


def marker() -> dict:
    return {"instance": INSTANCE}


def hop_refusal(request: web.BaseRequest) -> web.Response:
    """The answer to a call from another pd-router's fan-out or legs: nothing done, and this router named."""
    origin = request.headers.get(HOP_HEADER, "")
    who = "this router itself" if origin == INSTANCE else f"pd-router {origin[:32]!r}"
    return json_response({"error": {"message": f"{request.method} {request.path} came from {who} (a call to a "
                                               f"worker): a pd-router is not a worker, and acts on no call of "
                                               f"another's fan-out", "type": "pd_router_loop", "code": 400},
                          MARKER_FIELD: marker()}, status=400)


def router_instance_of(data: object) -> str | None:
    """The instance a pd-router's answer names (`pd_router`), or None: a SGLang server's (or no) answer."""
    if isinstance(data, dict):
        mark = data.get(MARKER_FIELD)
        if isinstance(mark, dict):
            instance = mark.get("instance")
            return instance if isinstance(instance, str) and instance else "unknown"
    return None


def router_description(instance: str) -> str:
    return "this router itself" if instance == INSTANCE else f"another pd-router (instance {instance})"


def _unspecified(host: str | None) -> bool:
    return not host or host in ("0.0.0.0", "::", "[::]")


def is_local_address(address: str) -> bool:
    """Whether `address` is one of this machine's (the kernel lets a socket bind to it)."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    if ip.is_unspecified or ip.is_loopback:
        return True
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((str(ip), 0))
        return True
    except OSError:
        return False


def _normal(address: str) -> str:
    ip = ipaddress.ip_address(address.strip("[]"))
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip)


def is_own_address(addresses: list[str], port: int, listen_host: str | None, listen_port: int,
                   listen_addresses: list[str] | None = None) -> bool:
    """Whether a worker at one of `addresses` (resolved IPs of its host) on `port` would be this router.
    `listen_addresses`: what `listen_host` resolves to, when it is a name."""
    if port != listen_port:
        return False
    try:
        wanted = {_normal(a) for a in addresses}
    except ValueError:
        return False
    if _unspecified(listen_host):
        return any(is_local_address(a) for a in wanted)
    try:
        listening = {_normal(listen_host)}
    except ValueError:
        listening = {_normal(a) for a in (listen_addresses or [])}
    if "localhost" == (listen_host or "").lower():
        listening |= {"127.0.0.1", "::1"}
    # A connection to the unspecified address reaches the loopback one.
    if any(ipaddress.ip_address(a).is_unspecified for a in wanted):
        wanted |= {"127.0.0.1", "::1"}
    return bool(wanted & listening)


def literal_addresses(host: str) -> list[str] | None:
    """The addresses a host stands for without asking DNS (an IP, `localhost`), or None for a name."""
    if host.lower() == "localhost":
        return ["127.0.0.1", "::1"]
    try:
        return [str(ipaddress.ip_address(host.strip("[]")))]
    except ValueError:
        return None
