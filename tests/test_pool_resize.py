"""The pool resized in place (kvtier/agent/host/resize.py): what a new host.capacity does to
the pool file a restarted agent finds. Growing keeps every chunk; shrinking moves the chunks
of the slots that go into free slots that stay, keeps what fits, and cuts the file's tail
only when told (`trim`), since clients of the earlier agent may still map it; a compaction
stopped half-way and run again moves nothing twice; another slot size makes a new pool."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from kvtier.agent.chunk import ChunkHeader, SlotState, checksum
from kvtier.agent.host.resize import Opened, open_pool
from kvtier.api.pool_layout import PoolGeometry
from kvtier.shm.pool import POOL_MODE, PoolMap, create, trim

PAYLOAD = 8192


def _seal(path: Path, geometry: PoolGeometry, slots: list[int]) -> None:
    pool = PoolMap(path, geometry, populate=False)
    for slot in slots:
        data = np.full(PAYLOAD, slot, np.uint8)
        pool.payload(slot)[:] = data
        header = ChunkHeader("ns", b"key-%d" % slot, PAYLOAD, checksum(data.data)).pack()
        pool.header(slot)[: len(header)] = np.frombuffer(header, np.uint8)
    pool.close()


def _chunks(pool: PoolMap) -> dict[bytes, int]:
    """Each sealed, verified chunk's key and the byte its payload is made of."""
    found = {}
    for slot in range(pool.geometry.slot_count):
        header = ChunkHeader.unpack(pool.header(slot).data)
        if header is None or header.state != SlotState.SEALED:
            continue
        payload = pool.payload(slot)
        assert header.verify(payload.data), f"slot {slot} holds a damaged chunk"
        assert header.key not in found, f"{header.key!r} twice"
        found[header.key] = int(payload[0])
    return found


def _pool(tmp_path: Path, slots: int, sealed: list[int]) -> Path:
    path = tmp_path / "t.pool"
    create(path, PoolGeometry(PAYLOAD, slots), POOL_MODE)
    _seal(path, PoolGeometry(PAYLOAD, slots), sealed)
    return path


def test_shrinking_moves_the_chunks_of_the_slots_that_go(tmp_path: Path) -> None:
    path = _pool(tmp_path, 16, [2, 9, 12, 15])
    small = PoolGeometry(PAYLOAD, 8)
    pool, how = open_pool(path, small, populate=False)
    assert how is Opened.SHRUNK
    assert _chunks(pool) == {b"key-2": 2, b"key-9": 9, b"key-12": 12, b"key-15": 15}
    pool.close()
    assert path.stat().st_size == PoolGeometry(PAYLOAD, 16).file_bytes  # tail kept for now
    trim(path, small)
    assert path.stat().st_size == small.file_bytes
    pool, how = open_pool(path, small, populate=False)  # the next restart: as it is
    assert how is Opened.REUSED and len(_chunks(pool)) == 4
    pool.close()


def test_shrinking_below_what_is_held_keeps_what_fits(tmp_path: Path) -> None:
    path = _pool(tmp_path, 16, [0, 5, 10, 11, 14])
    pool, _ = open_pool(path, PoolGeometry(PAYLOAD, 3), populate=False)
    held = _chunks(pool)
    assert len(held) == 3 and all(value == int(key[4:]) for key, value in held.items())
    pool.close()


def test_a_compaction_run_again_moves_nothing_twice(tmp_path: Path) -> None:
    """A shrink stopped before its superblock was written (the agent killed) is done again
    from the start; the chunks moved the first time are not moved a second time."""
    path = _pool(tmp_path, 16, [12, 13, 14, 15])
    from kvtier.agent.host import resize as pool_resize

    pool_resize._compact(path, PoolGeometry(PAYLOAD, 16), 8)  # moved, superblock still old
    pool, how = open_pool(path, PoolGeometry(PAYLOAD, 8), populate=False)
    assert how is Opened.SHRUNK
    assert sorted(_chunks(pool)) == [b"key-12", b"key-13", b"key-14", b"key-15"]
    pool.close()


def test_growing_keeps_every_chunk_and_adds_free_slots(tmp_path: Path) -> None:
    path = _pool(tmp_path, 8, [1, 7])
    pool, how = open_pool(path, PoolGeometry(PAYLOAD, 32), populate=False)
    assert how is Opened.GROWN and _chunks(pool) == {b"key-1": 1, b"key-7": 7}
    assert path.stat().st_size == PoolGeometry(PAYLOAD, 32).file_bytes
    pool.close()


def test_another_slot_size_makes_a_new_pool(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """And says so, with what was dropped: a new host.chunkBytes empties a warm pool,
    which the log showed only as a cold start."""
    path = _pool(tmp_path, 8, [1])
    with caplog.at_level(logging.WARNING, logger="kvtier.shm.pool"):
        pool, how = open_pool(path, PoolGeometry(2 * PAYLOAD, 8), populate=False)
    assert how is Opened.CREATED and _chunks(pool) == {}
    (said,) = [r.getMessage() for r in caplog.records]
    assert "host.chunkBytes" in said and f"8 slots of {PAYLOAD} bytes" in said
    assert not path.with_name(path.name + ".new").exists()
    pool.close()
    assert path.stat().st_size == PoolGeometry(2 * PAYLOAD, 8).file_bytes
