"""Secondary tiers behind the host pool, one module per backend."""

from __future__ import annotations

from kvtier.agent.config import TierConfig
from kvtier.agent.tiers.base import CorruptChunk, SecondaryTier, TierUsage


def build_tier(config: TierConfig) -> SecondaryTier:
    """Construct the backend a tier entry names (imports boto3 only when S3 is used)."""
    if config.filesystem is not None:
        from kvtier.agent.tiers.filesystem import FilesystemTier

        return FilesystemTier(config.name, config.filesystem)
    if config.object_store is None:
        raise ValueError(f"tier {config.name}: a peer tier is built by the agent")
    from kvtier.agent.tiers.objectstore import ObjectStoreTier

    return ObjectStoreTier(config.name, config.object_store)


__all__ = ["CorruptChunk", "SecondaryTier", "TierUsage", "build_tier"]
