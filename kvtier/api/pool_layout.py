"""The pool file's layout: page, header and slot sizes, the superblock, and how many slots a
capacity holds. Standard library only, so the config model (which the operator imports) can
size a pool without loading numpy; `pool.py` maps the file this describes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

PAGE = 4096
SUPERBLOCK_BYTES = PAGE
SLOT_HEADER_BYTES = PAGE
# The longest namespace and key a slot's header (and so the agent's protocol) carries.
MAX_NAMESPACE_BYTES = 256
MAX_KEY_BYTES = 1024
POOL_MAGIC = b"KVTPOOL1"
POOL_VERSION = 2  # 2: slot generations
STAMP_OFFSET = SLOT_HEADER_BYTES - 8
# The KVCacheTier's default `host.chunkSize` (crds/kvcachetier.yaml): what the operator
# configures agents with, and the CSI plugin sizes their volumes for, when the spec is silent.
DEFAULT_CHUNK_SIZE = "2Mi"
SUPERBLOCK = struct.Struct("<8sIIQQ")  # magic, version, header bytes, payload bytes, slots


def slot_payload_bytes(chunk_bytes: int) -> int:
    return -(-chunk_bytes // PAGE) * PAGE


def pool_slot_count(capacity: int, chunk_bytes: int) -> int:
    stride = SLOT_HEADER_BYTES + slot_payload_bytes(chunk_bytes)
    return max(0, (capacity - SUPERBLOCK_BYTES) // stride)


@dataclass(frozen=True)
class PoolGeometry:
    payload_bytes: int
    slot_count: int

    @property
    def stride(self) -> int:
        return SLOT_HEADER_BYTES + self.payload_bytes

    @property
    def file_bytes(self) -> int:
        return SUPERBLOCK_BYTES + self.slot_count * self.stride

    def header_offset(self, slot: int) -> int:
        return SUPERBLOCK_BYTES + slot * self.stride

    def payload_offset(self, slot: int) -> int:
        return self.header_offset(slot) + SLOT_HEADER_BYTES

    def pack(self) -> bytes:
        return SUPERBLOCK.pack(
            POOL_MAGIC, POOL_VERSION, SLOT_HEADER_BYTES, self.payload_bytes, self.slot_count
        )

    @classmethod
    def unpack(cls, raw: bytes) -> PoolGeometry | None:
        magic, version, header, payload, slots = SUPERBLOCK.unpack_from(raw)
        if magic != POOL_MAGIC or version != POOL_VERSION or header != SLOT_HEADER_BYTES:
            return None
        return cls(payload_bytes=payload, slot_count=slots)


# --- the files beside the pool, on the same filesystem ------------------------------------

STAGING_BYTES = 64 << 20  # the staging area: stores in flight at once, node-wide
INDEX_SPARE = 1024  # index positions past the last home: probes run into them, never wrap


def staging_slots(slot_count: int, payload_bytes: int) -> int:
    """Slots of the staging area: STAGING_BYTES, at least two and at most half the pool (a
    small pool's stores are small); a store round stages at most half of them, and each
    round costs two round trips, so fewer would slow stores of many chunks."""
    return max(2, min(max(1, slot_count // 2), STAGING_BYTES // payload_bytes))


def index_capacity(slot_count: int) -> int:
    """Positions of the published index: a power of two at least twice the slots."""
    return max(16, 1 << max(0, 2 * slot_count - 1).bit_length())


def index_array_bytes(positions: int) -> int:
    return -(-positions * 8 // PAGE) * PAGE


def index_file_bytes(capacity: int) -> int:
    """The published index's file: a header page and three arrays of 8-byte entries."""
    return PAGE + 3 * index_array_bytes(capacity + INDEX_SPARE)


def pool_geometry(capacity: int, chunk_bytes: int) -> PoolGeometry:
    """The pool a host tier of `capacity` bytes with chunks of `chunk_bytes` has."""
    return PoolGeometry(slot_payload_bytes(chunk_bytes), pool_slot_count(capacity, chunk_bytes))


def staging_geometry(pool: PoolGeometry) -> PoolGeometry:
    """The staging area beside a pool: slots of the pool's payload size."""
    return PoolGeometry(pool.payload_bytes, staging_slots(pool.slot_count, pool.payload_bytes))


def tier_files_bytes(geometry: PoolGeometry) -> int:
    """The pool, its staging area and its published index: what the pool's filesystem (the
    tier's volume) must hold."""
    index = index_file_bytes(index_capacity(geometry.slot_count))
    return geometry.file_bytes + staging_geometry(geometry).file_bytes + index


# The agent's socket, its pool's lock and the clients' lock files (a page each at most): a
# margin, no data.
RUN_DIR_BYTES = 1 << 20


def tier_volume_bytes(geometry: PoolGeometry) -> int:
    """The size of the tier's volume (made by the CSI plugin): the tier's files, the index
    once more, since an agent publishes its index beside the one it retires (readers of the
    earlier agent may still map that one), and the run directory. Pool and staging area are
    resized in place (`pool_resize.py`), so no second copy of them is ever made."""
    index = index_file_bytes(index_capacity(geometry.slot_count))
    return tier_files_bytes(geometry) + index + RUN_DIR_BYTES
