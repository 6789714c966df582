"""Opening the pool at start: kept as it is, grown or shrunk in place, or made anew.

The tier's volume holds the pool, its staging area and its index, and little more: a CSI
volume keeps every file across agent restarts and is exactly as large as the plugin made it,
so a second pool beside the first never fits. A restart therefore reuses the pool file; a
new `host.capacity` (same chunk size) resizes it in place, and shrinking first moves the
sealed chunks of the slots that go into free slots that stay, so what fits is kept; the file's
tail is cut only once the earlier agent's grants have run out (`pool.trim`, from the host
tier). Only another chunk size makes a new pool, after the old one is removed.
"""

from __future__ import annotations

import logging
from enum import Enum
from pathlib import Path

import numpy as np

from kvtier.agent.chunk import ChunkHeader, SlotState
from kvtier.api.pool_layout import PoolGeometry
from kvtier.shm.pool import (
    POOL_MODE,
    PoolMap,
    create,
    resizable,
    reusable,
    set_size,
    superblock_of,
)

log = logging.getLogger("kvtier.shm.pool")
_FREE = ChunkHeader("", b"", 0, 0, SlotState.FREE).pack()


class Opened(Enum):
    REUSED = "reused"
    GROWN = "grown"
    SHRUNK = "shrunk"
    CREATED = "created"

    @property
    def warm(self) -> bool:
        """Whether the pool holds chunks of an earlier agent (to be re-indexed)."""
        return self is not Opened.CREATED


def _movable(header: ChunkHeader | None) -> bool:
    return header is not None and header.state == SlotState.SEALED


def _takes_a_chunk(header: ChunkHeader | None) -> bool:
    """A slot that may receive a moved chunk: free or unreadable, never one being written
    (an earlier agent's writer may still be copying into it)."""
    return header is None or header.state == SlotState.FREE


def _compact(path: Path, old: PoolGeometry, slots: int) -> tuple[int, int]:
    """Move the sealed chunks of slots `slots`.. into free slots below `slots`, whole (header,
    payload and generation stamp together); returns (moved, dropped). Chunks are checked
    later, by the re-index, like every other chunk of a reused pool."""
    pool = PoolMap(path, old, populate=False)
    try:
        free = [s for s in range(slots) if _takes_a_chunk(ChunkHeader.unpack(pool.header(s).data))]
        free.reverse()
        moved = dropped = 0
        for slot in range(slots, old.slot_count):
            if not _movable(ChunkHeader.unpack(pool.header(slot).data)):
                continue
            if not free:
                dropped += 1
                continue
            to = free.pop()
            start, target = old.header_offset(slot), old.header_offset(to)
            pool.array[target : target + old.stride] = pool.array[start : start + old.stride]
            # The source freed, so a compaction stopped and run again moves it only once.
            pool.array[start : start + len(_FREE)] = np.frombuffer(_FREE, np.uint8)
            moved += 1
        return moved, dropped
    finally:
        pool.close()


def open_pool(path: Path, geometry: PoolGeometry, populate: bool) -> tuple[PoolMap, Opened]:
    """The pool at `path` with `geometry`, and how it was opened."""
    if reusable(path, geometry):
        set_size(path, geometry, POOL_MODE)  # an older agent's mode reset
        how = Opened.REUSED
    elif resizable(path, geometry):
        old = superblock_of(path)
        assert old is not None
        if geometry.slot_count < old.slot_count:
            moved, dropped = _compact(path, old, geometry.slot_count)
            how = Opened.SHRUNK
        else:
            moved = dropped = 0
            how = Opened.GROWN
        set_size(path, geometry, POOL_MODE)
        log.info(
            "pool %s %s in place from %d to %d slots (%d chunks moved, %d dropped)",
            path,
            how.value,
            old.slot_count,
            geometry.slot_count,
            moved,
            dropped,
        )
    else:
        old = superblock_of(path) if path.exists() else None
        if old is not None and old.payload_bytes != geometry.payload_bytes:
            # Chunks of another size cannot be read back as these: the earlier pool goes.
            log.warning(
                "pool %s made anew for chunks of %d bytes (host.chunkBytes); the earlier "
                "pool's %d slots of %d bytes are dropped, nothing of them is served",
                path,
                geometry.payload_bytes,
                old.slot_count,
                old.payload_bytes,
            )
        create(path, geometry, POOL_MODE)
        how = Opened.CREATED
    return PoolMap(path, geometry, populate), how
