"""Worker selection policies, registered by name."""

from __future__ import annotations

from typing import Callable

from .base import Outcome, Policy, RequestInfo
from .load import LeastInflightPolicy, PowerOfTwoPolicy
from .simple import RandomPolicy, RoundRobinPolicy

_FACTORIES: dict[str, Callable[..., Policy]] = {
    RandomPolicy.name: RandomPolicy,
    RoundRobinPolicy.name: RoundRobinPolicy,
    LeastInflightPolicy.name: LeastInflightPolicy,
    PowerOfTwoPolicy.name: PowerOfTwoPolicy,
}


def register_policy(name: str, factory: Callable[..., Policy]) -> None:
    _FACTORIES[name] = factory


def available_policies() -> set[str]:
    return set(_FACTORIES)


def make_policy(name: str, **options) -> Policy:
    try:
        factory = _FACTORIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(sorted(_FACTORIES))}") from None
    return factory(**options)


__all__ = ["Outcome", "Policy", "RequestInfo", "available_policies", "make_policy", "register_policy"]
