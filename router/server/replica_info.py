"""`GET /admin/replica`: which router process answered, and its place among the replicas of its host.

Behind one address (a port shared with SO_REUSEPORT, a Service, a balancer) each connection reaches one
replica; this names it: its id, pid, its index under a `--replicas N` supervisor, and the connections its
listening socket accepted (how the kernel spread them).
"""

from __future__ import annotations

import os
import secrets
import socket
import time
from dataclasses import dataclass, field

from aiohttp import web

from router.server.serving import EagerAcceptSite
from router.server.supervisor import ReplicaPlace


def new_replica_id() -> str:
    """Unique per process: the host, the pid and a random part (a restarted replica is a new one)."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


@dataclass(slots=True)
class ReplicaInfo:
    id: str = field(default_factory=new_replica_id)
    place: ReplicaPlace | None = None
    pid: int = field(default_factory=os.getpid)
    started_at: float = field(default_factory=time.time)
    site: EagerAcceptSite | None = None  # set once it listens

    def state(self) -> dict:
        return {
            "id": self.id,
            "pid": self.pid,
            "index": self.place.index if self.place else 0,
            "replicas_on_host": self.place.count if self.place else 1,
            "supervisor_pid": self.place.supervisor_pid if self.place else None,
            "started_at": self.started_at,
            "accepted_connections": self.site.accepted_total if self.site is not None else 0,
        }


REPLICA = web.AppKey("replica", ReplicaInfo)


async def get_replica(request: web.Request) -> web.Response:
    return web.json_response(request.app[REPLICA].state())


def setup(app: web.Application) -> None:
    app.router.add_get("/admin/replica", get_replica)
