"""Eviction policies for the host tier, one per file, chosen by name in the config."""

from __future__ import annotations

from kvtier.agent.host.policy.adaptive import AdaptivePolicy
from kvtier.agent.host.policy.arc import ARCPolicy
from kvtier.agent.host.policy.base import ChunkId, EvictionPolicy
from kvtier.agent.host.policy.lru import LRUPolicy
from kvtier.agent.host.policy.prefix import PrefixPolicy

POLICIES: dict[str, type[EvictionPolicy]] = {
    "lru": LRUPolicy,
    "arc": ARCPolicy,
    "prefix": PrefixPolicy,
    "adaptive": AdaptivePolicy,
}


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    try:
        return POLICIES[name](capacity)
    except KeyError:
        raise ValueError(
            f"unknown eviction policy {name!r}; use one of {sorted(POLICIES)}"
        ) from None


__all__ = [
    "POLICIES",
    "ARCPolicy",
    "AdaptivePolicy",
    "ChunkId",
    "EvictionPolicy",
    "LRUPolicy",
    "PrefixPolicy",
    "make_policy",
]
