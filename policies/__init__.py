"""Worker selection policies, registered by name."""

from __future__ import annotations

import random
from typing import Callable

from .base import LegOutcome, Policy, RequestInfo, ServerLoad, effective_load
from .bucket import BucketPolicy
from .cache_aware import CacheAwarePolicy
from .consistent_hashing import ConsistentHashingPolicy
from .least_load import LeastLoadPolicy
from .load import LeastInflightPolicy, PowerOfTwoPolicy
from .manual import ManualPolicy
from .params import PolicyParams
from .prefix_hash import PrefixHashPolicy
from .simple import PassthroughPolicy, RandomPolicy, RoundRobinPolicy
from .sticky import RoutingKeyOverride

# name -> build(params, rng) -> Policy
_FACTORIES: dict[str, Callable[..., Policy]] = {
    cls.name: cls.build
    for cls in (RandomPolicy, RoundRobinPolicy, LeastInflightPolicy, PowerOfTwoPolicy, CacheAwarePolicy,
                LeastLoadPolicy, PrefixHashPolicy, ConsistentHashingPolicy, ManualPolicy, BucketPolicy,
                PassthroughPolicy)
}


def register_policy(name: str, factory: Callable[..., Policy]) -> None:
    """`factory(params, rng)` makes a policy."""
    _FACTORIES[name] = factory


def available_policies() -> set[str]:
    return set(_FACTORIES)


def make_policy(name: str, params: PolicyParams | None = None, *, rng: random.Random | None = None) -> Policy:
    try:
        factory = _FACTORIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(sorted(_FACTORIES))}") from None
    params = params or PolicyParams()
    policy = factory(params, rng)
    if params.routing_key_override:  # --routing-key-override: sticky by routing key in front of it
        return RoutingKeyOverride(policy, params, rng)
    return policy


__all__ = ["LegOutcome", "Policy", "PolicyParams", "RequestInfo", "ServerLoad", "available_policies",
           "effective_load", "make_policy", "register_policy"]
