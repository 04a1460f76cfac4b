"""A simulated SGLang worker (no GPU): SGLang 0.5.23's endpoints, answer shapes and PD bootstrap protocol.

    from simulator import Fleet, expected_generation
    async with Fleet(prefill=2, decode=2) as fleet: ...

See ``fleet.py`` (start workers), ``worker.py`` (one worker), ``tokens.py`` (expected outputs).
Names are imported lazily so ``python -m simulator.fleet`` does not import itself twice.
"""

from importlib import import_module
from typing import Any

_EXPORTS = {
    "Fleet": "fleet", "WorkerHandle": "fleet", "Worker": "worker", "WorkerConfig": "config", "Timing": "config",
    "Faults": "faults", "expected_generation": "tokens", "Generation": "tokens", "encode": "tokens",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(name)
    return getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
