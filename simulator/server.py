"""What the worker's route modules (control, info, loads, metrics, openai, roles, simapi, formats) see of the
server they serve: a protocol that `worker.Worker` implements, so that they name no module that imports them
(the worker builds its app from them)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from aiohttp import web

    from .config import WorkerConfig
    from .engine import Engine
    from .faults import FaultInjector
    from .inputs import GenerateCall


class Server(Protocol):
    config: WorkerConfig
    engine: Engine
    faults: FaultInjector
    launch_bootstrap_port: int | None  # the bootstrap port it was started with (as /server_info reports it)
    listener: Any  # its bootstrap.BootstrapListener while one runs, else None
    role_switcher: Any  # roles.RoleSwitcher, once the role routes are added
    trace_headers: Any  # the W3C trace context of the newest generation calls (a deque of dicts)

    @property
    def port(self) -> int | None: ...

    @property
    def url(self) -> str: ...

    @property
    def bootstrap_port(self) -> int | None: ...

    async def open_listener(self, port: int, *, registered: bool) -> int: ...

    async def close_listener(self) -> None: ...

    def count(self, route: str) -> None: ...

    async def serve(self, request: web.Request, call: GenerateCall, route: str, fmt: Any) -> web.StreamResponse: ...
