"""SMG's discovery rows (`GET /v1/rl/workers`) for the router's workers, and the keys a selector matches.

A row has the fields of `smg.rl.Worker` (SMG 1.13.0's `RlWorkerEntry`). What pd-router knows differs from
SMG in three places, each documented in docs/guides/rl/smg-client.md:
- `worker_type` and `role` are the worker's P/D role (`prefill`, `decode`); pd-router has no free labels.
- `weight_version` is the version the router last saw the server serve (kept current by the weight flows),
  not the value recorded at registration.
- `health` maps the router's state and health onto SMG's words; `labels.state` keeps the router's own.
The model and the parallel sizes come from the server's `/server_info`, read once per worker and kept until
the worker leaves (they are launch arguments: they do not change while the server runs).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from aiohttp import web

from router.control.upstream import Upstream
from router.core.registry import Registry, Worker, WorkerState

PROTOCOL_VERSION = 1
ENGINE = "sglang"
FACTS_TIMEOUT = 2.0
# SMG's static capability row for SGLang (what its pause, update and abort routes accept).
SGLANG_CAPABILITIES = {
    "source": "static",
    "pause_modes": ["abort", "retract", "in_place"],
    "update_from": ["disk", "tensor", "distributed"],
    "abort": True,
    "flush_cache": True,
    "sleep_wake": True,
    "reports_weight_version": True,
}
BUSY = (WorkerState.DRAINING, WorkerState.ABORTING, WorkerState.CONVERTING, WorkerState.VERIFYING)


@dataclass(frozen=True, slots=True)
class LaunchFacts:
    """What a server was launched with, from its `/server_info`."""

    model_id: str | None = None
    tp_size: int | None = None
    dp_size: int | None = None
    pp_size: int | None = None

    @classmethod
    def of(cls, info: object) -> "LaunchFacts":
        if not isinstance(info, dict):
            return cls()
        model = info.get("served_model_name") or info.get("model_path")
        return cls(model if isinstance(model, str) else None,
                   _size(info.get("tp_size")), _size(info.get("dp_size")), _size(info.get("pp_size")))


def _size(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


class LaunchFactsCache:
    """Launch facts per worker id, read when first needed; forgotten when the worker leaves."""

    def __init__(self, registry: Registry, upstream: Upstream) -> None:
        self.upstream = upstream
        self._facts: dict[str, LaunchFacts] = {}
        registry.subscribe(self._on_registry_event)

    def _on_registry_event(self, event: str, worker: Worker, details: dict) -> None:
        if event == "removed":
            self._facts.pop(worker.id, None)

    async def of(self, workers: list[Worker]) -> dict[str, LaunchFacts]:
        """Facts of each worker; those not known yet are read now (at once, bounded), unreachable ones stay
        unknown and are asked again next time."""
        missing = [w for w in workers if w.id not in self._facts and w.state is not WorkerState.PENDING]
        if missing:
            replies = await asyncio.gather(*(self.upstream.server_info(w.url, timeout=FACTS_TIMEOUT)
                                             for w in missing))
            for worker, reply in zip(missing, replies):
                if reply.ok:
                    self._facts[worker.id] = LaunchFacts.of(reply.data)
        return {w.id: self._facts.get(w.id, LaunchFacts()) for w in workers}


def health_of(worker: Worker) -> str:
    """SMG's health words: pending, ready, not_ready, failed, draining."""
    if worker.state is WorkerState.PENDING:
        return "pending"
    if worker.state is WorkerState.FAILED:
        return "failed"
    if worker.state in BUSY:
        return "draining"
    return "ready" if worker.routable else "not_ready"


def labels_of(worker: Worker, facts: LaunchFacts) -> dict[str, str]:
    """The worker's labels as SMG would report them (strings only), plus the router's own state."""
    labels = {"role": worker.role.value, "state": worker.state.value, "routable": str(worker.routable).lower()}
    optional = {"weight_version": worker.weight_version, "version": worker.server_version,
                "model_path": facts.model_id, "tp_size": facts.tp_size, "dp_size": facts.dp_size,
                "pp_size": facts.pp_size, "bootstrap_port": worker.bootstrap_port}
    labels.update({name: str(value) for name, value in optional.items() if value is not None})
    return labels


def selector_keys(worker: Worker, facts: LaunchFacts) -> dict[str, str]:
    """What a selector matches: the labels, overridden by the keys SMG derives from its registry."""
    keys = labels_of(worker, facts)
    keys.update({"id": worker.id, "url": worker.url, "base_url": worker.url, "engine": ENGINE,
                 "worker_type": worker.role.value, "connection_mode": "http", "health": health_of(worker)})
    if facts.model_id is not None:
        keys["model"] = facts.model_id
    return keys


def row_of(worker: Worker, facts: LaunchFacts) -> dict:
    return {
        "id": worker.id,
        "url": worker.url,
        "base_url": worker.url,
        "engine": ENGINE,
        "engine_version": worker.server_version,
        "model_id": facts.model_id,
        "worker_type": worker.role.value,
        "connection_mode": "http",
        "tp_size": facts.tp_size,
        "dp_size": facts.dp_size,
        "pp_size": facts.pp_size,
        "dp_ranks": 1,
        "role": worker.role.value,
        "health": health_of(worker),
        "weight_version": worker.weight_version,
        "control_url": worker.url,
        "labels": labels_of(worker, facts),
        "capabilities": dict(SGLANG_CAPABILITIES),
        # pd-router's own, beside SMG's fields (the client ignores fields it does not know)
        "state": worker.state.value,
        "routable": worker.routable,
    }


def sorted_by_url(workers: list[Worker]) -> list[Worker]:
    """SMG lists rows by base_url."""
    return sorted(workers, key=lambda w: w.url)


FACTS = web.AppKey("rl_launch_facts", LaunchFactsCache)
