"""Helpers for the simulator tests: a PD client that does what a router does (waiting: tests.helpers.wait_for); and
the simulated workers router tests run in front of (`SimulatedWorker`, the `sim_workers` fixture)."""

from __future__ import annotations

import asyncio
import collections
import random
from typing import Any

import aiohttp
import orjson

from simulator.fleet import Fleet, WorkerHandle
from simulator.journal import Journal
from simulator.worker import Worker

# short PD deadlines so failure paths finish in well under a second
FAST = dict(health_check_s=0.0, bootstrap_retries=3, bootstrap_retry_interval_s=0.02, deferred_release_s=0.0,
            disconnect_check_s=0.02)


def pd_body(body: dict, prefill: WorkerHandle, *, room: Any = None, port: Any = "prefill",
            host: str = "127.0.0.1") -> dict:
    out = dict(body)
    out["bootstrap_host"] = host
    out["bootstrap_port"] = prefill.bootstrap_port if port == "prefill" else port
    out["bootstrap_room"] = random.getrandbits(62) if room is None else room
    return out


async def post(session: aiohttp.ClientSession, url: str, body: Any, **kw: Any) -> tuple[int, Any]:
    """POST ``body`` as JSON (``None``: no body at all); the status and the parsed answer."""
    data = None if body is None else orjson.dumps(body)
    headers = None if body is None else {"Content-Type": "application/json"}
    async with session.post(url, data=data, headers=headers, **kw) as r:
        raw = await r.read()
        if r.content_type == "text/event-stream":
            return r.status, parse_sse(raw)
        try:
            return r.status, orjson.loads(raw)
        except orjson.JSONDecodeError:
            return r.status, raw.decode()


async def get(session: aiohttp.ClientSession, url: str) -> tuple[int, Any]:
    async with session.get(url) as r:
        raw = await r.read()
        try:
            return r.status, orjson.loads(raw)
        except orjson.JSONDecodeError:
            return r.status, raw.decode()


def parse_sse(raw: bytes) -> list:
    events = []
    for line in raw.split(b"\n"):
        if line.startswith(b"data: "):
            payload = line[6:]
            events.append("[DONE]" if payload == b"[DONE]" else orjson.loads(payload))
    return events


async def pd_generate(session: aiohttp.ClientSession, fleet: Fleet, body: dict, *, p: int = 0, d: int = 0,
                      path: str = "/generate", room: Any = None) -> tuple[tuple[int, Any], tuple[int, Any]]:
    """Send one PD request the way a router does: same body (with bootstrap fields) to P and D at once."""
    full = pd_body(body, fleet.prefill[p], room=room)
    return await asyncio.gather(post(session, fleet.prefill[p].url + path, full),
                                post(session, fleet.decode[d].url + path, full))


def rids_in(state: dict, *phases: str) -> list[str]:
    by_phase = state["rids_by_phase"]
    return [rid for phase in (phases or by_phase.keys()) for rid in by_phase.get(phase, [])]


SWITCH_PATHS = ("/pd_role_switch", "/convert_pd_role")  # 0.5.23's, and the convert API's (simulator/roles.py)


class SimulatedWorker:
    """One in-process simulated worker of the `sim_workers` fixture (tests/conftest.py): its address and live role,
    what it received (its Journal) and its faults, under the names router tests read."""

    def __init__(self, handle: WorkerHandle) -> None:
        assert handle.worker is not None and handle.worker.journal is not None, "an in-process worker that records"
        self.worker: Worker = handle.worker
        self.journal: Journal = handle.worker.journal

    @property
    def url(self) -> str:
        return self.worker.url

    @property
    def bootstrap_port(self) -> int | None:
        return self.worker.bootstrap_port

    @property
    def role(self) -> str:
        return self.worker.role

    @property
    def requests(self) -> list[tuple[str, Any]]:
        return self.journal.requests

    @property
    def aborts(self) -> list[Any]:
        return self.journal.aborts

    @property
    def calls(self) -> collections.Counter[str]:
        """Requests received, by path."""
        return self.journal.calls

    @property
    def authorizations(self) -> list[tuple[str, str | None]]:
        return self.journal.authorizations

    @property
    def queries(self) -> list[tuple[str, dict]]:
        return self.journal.queries

    @property
    def in_handler(self) -> int:
        """Generation calls it is serving now."""
        return self.worker.engine.inflight_calls

    @property
    def health_calls(self) -> int:
        return self.journal.calls["/health"]

    @property
    def health_in_flight(self) -> int:
        return self.journal.in_flight["/health"]

    @property
    def health_script(self) -> list[int]:
        """What is left of the health_script fault."""
        return self.worker.faults.faults.health_script

    @property
    def weight_version(self) -> str:
        return self.worker.engine.weight_version

    @weight_version.setter
    def weight_version(self, version: str) -> None:
        """The weights it serves from now on, as SGLang's /update_weight_version sets them (simulator/control.py)."""
        self.worker.engine.set_weight_version(version)
        self.worker.engine.model_version = version

    @property
    def switch_paths(self) -> list[str]:
        """The role-switch route of each switch call, in order."""
        return [path for path, _ in self.journal.posted if path in SWITCH_PATHS]

    @property
    def switch_calls(self) -> list[Any]:
        return [body for path, body in self.journal.posted if path in SWITCH_PATHS]

    def bodies(self, path: str = "/generate") -> list[Any]:
        return self.journal.bodies(path)

    async def stop(self) -> None:
        """The server goes away (its fleet's teardown finds it stopped)."""
        await self.worker.stop()

    def set_faults(self, **changes: Any) -> None:
        """Merge fault fields (simulator/faults.py), as ``POST /_sim/faults`` does."""
        self.worker.set_faults(changes)
