"""Which backend a tier entry names, and what a backend working with other agents is given."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtier.agent.tiers.base import SecondaryTier
from kvtier.api.config import TierConfig

if TYPE_CHECKING:
    from kvtier.agent.host.tier import HostTier
    from kvtier.agent.report.registry import Registry


@dataclass(frozen=True)
class TierContext:
    """What a tier that works with other agents needs of this one: the pool it lends from,
    the registry its members are listed in, and how often reports are published (which
    sets when a silent member counts as gone)."""

    host: HostTier
    registry: Registry | None
    report_interval: float


def build_tier(config: TierConfig, context: TierContext) -> SecondaryTier:
    """Construct the backend a tier entry names; each backend's module (boto3, ZMQ and NIXL
    for peers) is imported only when a tier uses it."""
    if config.filesystem is not None:
        from kvtier.agent.tiers.filesystem import FilesystemTier

        return FilesystemTier(config.name, config.filesystem)
    if config.object_store is not None:
        from kvtier.agent.tiers.objectstore import ObjectStoreTier

        return ObjectStoreTier(config.name, config.object_store)
    assert config.peer is not None  # the config model requires exactly one kind
    from kvtier.agent.tiers.peer.tier import build_peer_tier

    return build_peer_tier(config.name, config.peer, context)
