"""An agent's typed stats as a small node reports them, for the tests of what is built from
them (the KVCacheNode status, the event stream's address in it)."""

from __future__ import annotations

from kvtier.api.stats import (
    AgentStats,
    HostStats,
    PolicyStats,
    StoreSkips,
    TierCounts,
    TierStats,
)

STATS = AgentStats(
    name="gpu-1",
    host=HostStats(
        capacity_bytes=8 << 20,
        used_bytes=3 << 20,
        slot_bytes=1 << 20,
        slots=8,
        free_slots=5,
        resting_slots=0,
        staging_slots=4,
        free_staging_slots=4,
        chunks=3,
        leases=0,
        pinned_slots=0,
        lookups=10,
        hits=6,
        evictions=0,
        store_skipped=StoreSkips(),
        leases_expired=0,
        leases_reclaimed=0,
        corrupt=0,
        index_published=3,
        index_collisions=0,
        namespaces={"llama-3-8b-aa": 2, "qwen-bb": 1},
        policy=PolicyStats(policy="lru", resident=3),
    ),
    tiers=[
        TierStats(
            name="shared-fs",
            kind="filesystem",
            capacity_bytes=1000,
            used_bytes=100,
            chunks=1,
            queued=0,
            healthy=True,
            counts=TierCounts(hits=2, misses=2),
        )
    ],
    peers=[],
    clients=1,
)
