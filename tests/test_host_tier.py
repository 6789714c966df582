"""The host tier in this process, without an agent: a chunk found damaged is dropped, and
checking chunks again neither holds the tier's lock over the checksums nor drops a chunk
that took a checked slot meanwhile."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvtier.agent.chunk import checksum
from kvtier.agent.host.index import Grant
from kvtier.agent.host.tier import HostTier
from kvtier.agent.report.metrics import AgentMetrics
from kvtier.api.config import HostTierConfig
from kvtier.shm.table import digests
from tests.conftest import ROW
from tests.helpers import NS, key, row

SLOTS = 4


@pytest.fixture
def tier(scratch: Path) -> Iterator[HostTier]:
    config = HostTierConfig(
        capacity=SLOTS * (ROW + 4096) + 4096, chunk_bytes=ROW, pool_dir=scratch, prefault=False
    )
    host = HostTier(config, scratch / "pool", AgentMetrics(), lease_seconds=30.0, boot=1)
    assert host.geometry.slot_count == SLOTS
    yield host
    host.close()


def store(tier: HostTier, i: int) -> int:
    """Store chunk `i` as a client does (into its staging slot, then commit); its slot."""
    grant = tier.allocate("c", NS, [key(i)], ROW)
    assert grant.slots[0] >= 0
    tier.staging.payload(grant.staging[0], ROW)[:] = row(i, ROW)
    tier.commit(grant.lease, "c")
    return grant.slots[0]


def held(tier: HostTier, *ids: int) -> list[bool]:
    keys = [key(i) for i in ids]
    return tier.lookup(NS, keys, digests(NS, keys))[0]


def damage(tier: HostTier, slot: int) -> None:
    payload = tier.pool.payload(slot, ROW)
    payload[0] = np.uint8(payload[0] ^ 0xFF)


def test_a_chunk_that_fails_its_checksum_again_is_dropped(tier: HostTier) -> None:
    slots = [store(tier, i) for i in range(2)]
    damage(tier, slots[0])
    assert tier.reverify(NS, [key(0), key(1), key(7)]) == 1
    assert held(tier, 0, 1) == [False, True]
    assert tier.stats().corrupt == 1


def test_checksums_run_without_the_lock_and_spare_a_slot_taken_meanwhile(
    tier: HostTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    slots = [store(tier, i) for i in range(SLOTS)]  # the pool full: a store evicts chunk 0
    damage(tier, slots[0])
    seen: list[str] = []
    grants: list[Grant] = []

    def with_others_meanwhile(data: memoryview | bytes) -> int:
        """A lookup and a store arrive while chunk 0 is being checked: they get the lock,
        and the store takes chunk 0's slot (it commits once the check is over)."""
        if not tier._lock.acquire(blocking=False):
            seen.append("the lock was held")
            return checksum(data)
        tier._lock.release()
        seen.append(f"lookup {held(tier, 1)}")
        grants.append(tier.allocate("c", NS, [key(9)], ROW))
        seen.append(f"store into slot {grants[0].slots}")
        return checksum(data)

    monkeypatch.setattr("kvtier.agent.host.tier.checksum", with_others_meanwhile)
    assert tier.reverify(NS, [key(0)]) == 0
    assert seen == ["lookup [True]", f"store into slot {slots[:1]}"]
    # The store that took the slot is not disturbed: committed, its chunk is served.
    grant = grants[0]
    tier.staging.payload(grant.staging[0], ROW)[:] = row(9, ROW)
    tier.commit(grant.lease, "c")
    assert held(tier, 9, 0) == [True, False]
    assert tier.stats().corrupt == 0
