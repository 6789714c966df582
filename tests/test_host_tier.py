"""The host tier in this process, without an agent: a chunk found damaged is dropped (at
once, though a reader still pins it), and checking chunks again neither holds the tier's
lock over the checksums nor drops a chunk that took a checked slot meanwhile."""

from __future__ import annotations

import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvtier.agent.chunk import checksum
from kvtier.agent.host.index import Entry, Grant
from kvtier.agent.host.tier import HostTier
from kvtier.agent.report.metrics import AgentMetrics
from kvtier.api.config import HostTierConfig
from kvtier.shm.pool import (
    HELD_PIECE,
    SUM_CRC32,
    SUM_LANES,
    copy_held,
    copy_summed,
    staging_path,
)
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


def test_a_damaged_chunk_still_pinned_leaves_lookups_at_once_and_its_slot_at_the_last_unpin(
    tier: HostTier,
) -> None:
    """A peer's lease and a queued write-back (pinned, as the tier chain pins what it
    queues) still hold chunk 0 when it is found damaged: it is served to nobody from then
    on and the write-back is told it is gone, but its slot goes to no other chunk while a
    reader may still be copying it."""
    queued: list[Entry] = []

    def queue_write_back(entry: Entry) -> None:
        tier.pin_locked(entry)
        queued.append(entry)

    tier.subscribe(queue_write_back, lambda entries: None)
    slots = [store(tier, i) for i in range(SLOTS)]
    lent = tier.begin_load("peer", NS, [key(0)])
    damage(tier, slots[0])
    assert tier.reverify(NS, [key(0)]) == 1
    assert held(tier, 0, 1) == [False, True]
    assert tier.held_header(queued[0]) is None
    assert tier.held_header(queued[1]) is not None
    assert tier.stats().free_slots == 0
    tier.end_load(lent.lease, "peer")
    assert tier.stats().free_slots == 0  # the write-back still pins it
    for entry in queued:
        tier.unpin(entry)
    assert tier.stats().free_slots == 1
    assert tier.allocate("c", NS, [key(9)], ROW).slots == slots[:1]  # taken, nothing evicted
    assert held(tier, 1, 2, 3) == [True, True, True]


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


def _sized(scratch: Path, slots: int) -> HostTierConfig:
    capacity = slots * (ROW + 4096) + 4096
    return HostTierConfig(capacity=capacity, chunk_bytes=ROW, pool_dir=scratch, prefault=False)


def test_a_staging_slot_lent_before_a_restart_rests_a_lease_past_its_deadline(
    scratch: Path,
) -> None:
    """An agent killed just after lending a staging slot: its writer, descheduled past its
    lease, still copies into it. The next agent lends that slot only a lease's length past
    the old lease's deadline (as a lease that expires under a living agent rests), so the
    late bytes never land in a slot another store was given, even one that commits without
    sums; by then the slot is free again. (The times reclaim is told are made up: the
    lease is long, so the test holds however slowly it runs.)"""
    lease = 30.0
    path = scratch / "pool"
    before = HostTier(_sized(scratch, SLOTS), path, AgentMetrics(), lease_seconds=lease, boot=1)
    late = before.allocate("c", NS, [key(5)], ROW).staging[0]
    after = HostTier(_sized(scratch, SLOTS), path, AgentMetrics(), lease_seconds=lease, boot=2)
    try:
        started = time.monotonic()
        staging = after.stats().staging_slots
        assert after.stats().free_staging_slots == staging - 1
        after.reclaim(started + 1.5 * lease, [])  # one lease from the restart is over
        assert after.stats().free_staging_slots == staging - 1
        grant = after.allocate("c", NS, [key(1)], ROW)
        assert late not in grant.staging
        after.staging.payload(grant.staging[0], ROW)[:] = row(1, ROW)
        before.staging.payload(late, ROW)[:] = row(5, ROW)  # the late writer, at last
        after.commit(grant.lease, "c")
        assert np.array_equal(after.pool.payload(grant.slots[0], ROW), row(1, ROW))
        after.reclaim(started + 2 * lease + 1, [])
        assert after.stats().free_staging_slots == staging
    finally:
        after.close()
        before.close()


def test_a_shrunk_pool_keeps_its_tails_while_staging_slots_lent_before_rest(
    scratch: Path,
) -> None:
    """A restart with a smaller capacity cuts the pool's and the staging area's tails only
    once every staging slot the earlier agent had lent is done resting, even where all of
    them are in the staging area's cut tail (lent to nobody again): a writer still copying
    into a cut tail would die of SIGBUS, taking its engine with it."""
    lease = 30.0
    path, staged = scratch / "pool", staging_path(scratch / "pool")
    before = HostTier(_sized(scratch, 2 * SLOTS), path, AgentMetrics(), lease_seconds=lease)
    head = before.allocate("c", NS, [key(0), key(1)], ROW)
    tail = before.allocate("c", NS, [key(2), key(3)], ROW)
    before.abort(head.lease, "c")  # only the tail's slots are still lent
    after = HostTier(_sized(scratch, SLOTS), path, AgentMetrics(), lease_seconds=lease)
    try:
        assert min(tail.staging) >= after.stats().staging_slots  # all in the cut tail
        sizes = (after.geometry.file_bytes, after.staging.geometry.file_bytes)
        started = time.monotonic()
        after.reclaim(started + 1.5 * lease, [])
        assert path.stat().st_size > sizes[0] and staged.stat().st_size > sizes[1]
        assert after.stats().free_staging_slots == after.stats().staging_slots
        after.reclaim(started + 2 * lease + 1, [])
        assert (path.stat().st_size, staged.stat().st_size) == sizes
    finally:
        after.close()
        before.close()


def test_a_commit_publishes_only_what_matches_the_clients_checksums(tier: HostTier) -> None:
    """The client's staging sum of each row it staged comes with the commit: a staged
    chunk whose bytes changed before the agent copied it is dropped and counted, the others
    of the same lease are published; a commit with the wrong number of sums is refused."""
    grant = tier.allocate("c", NS, [key(0), key(1)], ROW)
    made = [
        copy_summed(tier.staging.payload(staged, ROW), row(i, ROW), of_source=True)
        for i, staged in enumerate(grant.staging)
    ]
    tier.staging.payload(grant.staging[0], ROW)[7] ^= 0x01  # another writer, after the client
    tier.commit(grant.lease, "c", made)
    assert held(tier, 0, 1) == [False, True]
    assert tier.stats().corrupt == 1

    grant = tier.allocate("c", NS, [key(2)], ROW)
    tier.staging.payload(grant.staging[0], ROW)[:] = row(2, ROW)
    with pytest.raises(ValueError, match="1 chunks its lease staged"):
        tier.commit(grant.lease, "c", made)
    assert held(tier, 2) == [False]
    assert tier.stats().free_staging_slots == tier.stats().staging_slots  # none kept


def test_a_commit_checks_each_sum_by_the_kind_it_names(tier: HostTier) -> None:
    """A client that found the GIL contended CRC-sums its rows and says so per sum: each is
    checked by its own kind (a CRC sum read as a lane sum would drop the chunk), a change
    after the client's CRC is caught the same way, and kinds that do not match the sums
    are refused, the lease's staging slots given back."""

    def staged(ids: list[int], kinds: bytes, tamper: int | None = None) -> None:
        grant = tier.allocate("c", NS, [key(i) for i in ids], ROW)
        made = [
            copy_summed(tier.staging.payload(at, ROW), row(i, ROW), of_source=True, kind=kind)
            for i, at, kind in zip(ids, grant.staging, kinds, strict=True)
        ]
        if tamper is not None:  # another writer, after the client
            tier.staging.payload(grant.staging[tamper], ROW)[5] ^= 0x10
        tier.commit(grant.lease, "c", made, kinds)

    staged([0, 1], bytes([SUM_CRC32, SUM_LANES]))
    staged([2, 3], bytes([SUM_CRC32, SUM_CRC32]), tamper=1)
    assert held(tier, 0, 1, 2, 3) == [True, True, True, False]
    assert tier.stats().corrupt == 1

    for bad in (bytes([SUM_CRC32]) * 2, bytes([7]), None):
        grant = tier.allocate("c", NS, [key(4)], ROW)
        made = [copy_summed(tier.staging.payload(grant.staging[0], ROW), row(4, ROW))]
        with pytest.raises(ValueError, match="sum kinds"):
            if bad is None:  # kinds without sums
                tier.commit(grant.lease, "c", None, bytes([SUM_CRC32]))
            else:
                tier.commit(grant.lease, "c", made, bad)
        assert held(tier, 4) == [False]
    assert tier.stats().free_staging_slots == tier.stats().staging_slots


@pytest.mark.parametrize("kind", [SUM_LANES, SUM_CRC32])
@pytest.mark.parametrize("nbytes", [1, 63, 64, 4096 + 9, 256 << 10, 1 << 20, (256 << 10) * 3 + 100])
def test_the_staging_sum_changes_with_a_byte_a_moved_part_or_blocks_in_another_order(
    nbytes: int, kind: int
) -> None:
    """What a client's sum must catch, of either kind: any one byte changed (tail bytes
    too), a part of a block swapped with another, blocks swapped; the copy it makes is the
    source's. The agent's sum of its copy (numpy's copy, a CRC a block at a time) is the
    client's (a copy under the GIL, a CRC of 5 KiB at a time), and a CRC sum is zlib's."""
    rng = np.random.default_rng(nbytes)
    src = rng.integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    base = copy_summed(dst, src, of_source=True, kind=kind)
    assert np.array_equal(dst, src)
    assert copy_summed(np.empty_like(src), dst, copy=np.copyto, kind=kind) == base
    if kind == SUM_CRC32:
        assert base == zlib.crc32(src.data)
    for at in {0, nbytes // 2, nbytes - 1}:
        changed = src.copy()
        changed[at] ^= 0x80
        assert copy_summed(np.empty_like(src), changed, kind=kind) != base, at
    moves = []
    if nbytes >= 64:
        part = nbytes // 64 * 8  # a block's parts are 8 consecutive eighths of it
        moves.append((0, part, part))
    if nbytes > 2 * (256 << 10):
        moves.append((0, 256 << 10, 256 << 10))
    for a, b, n in moves:
        moved = src.copy()
        moved[a : a + n], moved[b : b + n] = src[b : b + n], src[a : a + n]
        assert copy_summed(np.empty_like(src), moved, kind=kind) != base, (a, b)


@pytest.mark.parametrize("nbytes", [0, 1, HELD_PIECE - 1, HELD_PIECE, 2 * HELD_PIECE + 7])
def test_a_copy_under_the_gil_is_whole_in_pieces_and_refuses_another_size(nbytes: int) -> None:
    src = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.zeros_like(src)
    copy_held(dst, src)
    assert np.array_equal(dst, src)
    with pytest.raises(ValueError):
        copy_held(np.zeros(nbytes + 1, np.uint8), src)
    if nbytes % 2 == 0:  # rows of any shape, as numpy's copy took them
        square = np.zeros((2, nbytes // 2), np.uint8)
        copy_held(square, src)
        assert np.array_equal(square.reshape(-1), src)
