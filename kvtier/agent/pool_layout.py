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
POOL_MAGIC = b"KVTPOOL1"
POOL_VERSION = 2  # 2: slot generations
STAMP_OFFSET = SLOT_HEADER_BYTES - 8
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
