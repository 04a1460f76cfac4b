"""Who may call admin routes (by source network) and where registered workers may point (by host or network).

Both lists are empty by default: everything is allowed, as with mini_lb. `--admin-allow-cidrs` holds networks
(`10.0.0.0/8`, `127.0.0.1`, `::1`); `--worker-allow` holds networks, host names (`worker-0.sglang`) and domain
suffixes (`.svc.cluster.local` or `*.svc.cluster.local`). A worker URL whose host is a name that no name entry
covers is resolved, and every address it resolves to must be in an allowed network (a name that resolves
elsewhere later, DNS rebinding, is out of this check's reach: allow names you control).
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import socket
from dataclasses import dataclass
from typing import Awaitable, Callable, Iterable

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address
# (host, port) -> the addresses it resolves to
Resolve = Callable[[str, int], Awaitable[list[str]]]

_HOST_NAME = re.compile(r"^(?:\*?\.)?[a-z0-9](?:[a-z0-9-]*[a-z0-9])?(?:\.[a-z0-9](?:[a-z0-9-]*[a-z0-9])?)*\.?$")


def parse_network(entry: str) -> Network | None:
    try:
        return ipaddress.ip_network(entry.strip(), strict=False)
    except ValueError:
        return None


def is_host_pattern(entry: str) -> bool:
    """A host name or a domain suffix (`.lab`, `*.lab`), as `--worker-allow` takes them (RouterConfig checks
    its entries with this and `parse_network`)."""
    return _HOST_NAME.match(entry.strip().lower().rstrip(".")) is not None


def _address(text: str | None) -> Address | None:
    try:
        address = ipaddress.ip_address((text or "").strip("[]").split("%", 1)[0])
    except ValueError:
        return None
    mapped = getattr(address, "ipv4_mapped", None)  # a dual-stack socket shows IPv4 peers as ::ffff:a.b.c.d
    return mapped or address


@dataclass(frozen=True, slots=True)
class CallerAllowList:
    networks: tuple[Network, ...] = ()

    @classmethod
    def parse(cls, entries: Iterable[str]) -> "CallerAllowList":
        return cls(tuple(n for n in map(parse_network, entries) if n is not None))

    @property
    def restricts(self) -> bool:
        return bool(self.networks)

    def allows(self, peer: str | None) -> bool:
        """`peer`: the caller's address as the socket reports it (None for a Unix socket: refused)."""
        if not self.networks:
            return True
        address = _address(peer)
        return address is not None and any(address in network for network in self.networks)


@dataclass(frozen=True, slots=True)
class WorkerAllowList:
    networks: tuple[Network, ...] = ()
    hosts: frozenset[str] = frozenset()
    suffixes: tuple[str, ...] = ()  # ".example.org": any name under it

    @classmethod
    def parse(cls, entries: Iterable[str]) -> "WorkerAllowList":
        networks, hosts, suffixes = [], set(), []
        for entry in entries:
            if (network := parse_network(entry)) is not None:
                networks.append(network)
            elif is_host_pattern(entry):
                name = entry.strip().lower().rstrip(".")
                if name.startswith(("*.", ".")):
                    suffixes.append("." + name.lstrip("*."))
                else:
                    hosts.add(name)
        return cls(tuple(networks), frozenset(hosts), tuple(suffixes))

    @property
    def restricts(self) -> bool:
        return bool(self.networks or self.hosts or self.suffixes)

    async def refusal(self, host: str, port: int, resolve: Resolve) -> str | None:
        """Why a worker at host:port may not be registered, or None when it may."""
        if not self.restricts:
            return None
        name = host.strip("[]").lower().rstrip(".")
        if (address := _address(name)) is not None:
            return None if self._in_networks(address) else f"{host} is in no network --worker-allow names"
        if name in self.hosts or name.endswith(self.suffixes):
            return None
        if not self.networks:
            return f"{host} is no host or domain that --worker-allow names"
        try:
            resolved = [_address(a) for a in await resolve(name, port)]
        except OSError as exc:
            return f"{host} could not be resolved to check it against --worker-allow: {exc}"
        outside = sorted(str(a) for a in resolved if a is None or not self._in_networks(a))
        if not resolved or outside:
            return f"{host} resolves to {', '.join(outside) or 'nothing'}, in no network --worker-allow names"
        return None

    def _in_networks(self, address: Address) -> bool:
        return any(address in network for network in self.networks)


async def resolve(host: str, port: int) -> list[str]:
    """The addresses the event loop's resolver (the one the router's connections use) gives for host:port."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({info[4][0] for info in infos})
