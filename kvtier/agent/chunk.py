"""The chunk header: what makes a stored chunk self-describing and verifiable.

Every copy of a chunk outside an engine (a pool slot now, files and objects on secondary
tiers) carries this header, so a restarted agent can rebuild its index from the bytes alone
and a torn or corrupted copy is recognised as a miss instead of being served.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

import xxhash

from kvtier.api.pool_layout import MAX_KEY_BYTES, MAX_NAMESPACE_BYTES, SLOT_HEADER_BYTES

CHUNK_MAGIC = b"KVTC"
CHUNK_VERSION = 1
_FIXED = struct.Struct("<4sHBxQQHH")  # magic, version, state, length, checksum, ns len, key len
HEADER_BYTES = SLOT_HEADER_BYTES


class SlotState(enum.IntEnum):
    """A pool slot's lifecycle, as its header records it and as the agent's index keeps it
    (the agent makes a chunk readable where it writes the SEALED header, under one lock).
    Eviction changes only the index: the slot's header keeps its last sealed chunk, which a
    restarted agent may adopt again, until the slot is handed to another chunk."""

    FREE = 0  # holds no chunk
    WRITING = 1  # handed to a chunk being written: never read
    SEALED = 2  # bytes complete and checksum written: readable, safe to re-index after a restart


def checksum(data: memoryview | bytes) -> int:
    """xxh3-64 releases the GIL and runs several times faster than memcpy, so it never
    becomes the bottleneck of a copy path."""
    return xxhash.xxh3_64_intdigest(data)


@dataclass(frozen=True)
class ChunkHeader:
    namespace: str
    key: bytes
    length: int
    checksum: int
    state: SlotState = SlotState.SEALED

    def pack(self) -> bytes:
        ns = self.namespace.encode()
        if len(ns) > MAX_NAMESPACE_BYTES or len(self.key) > MAX_KEY_BYTES:
            raise ValueError("namespace or key too long for a chunk header")
        fixed = _FIXED.pack(
            CHUNK_MAGIC,
            CHUNK_VERSION,
            self.state,
            self.length,
            self.checksum,
            len(ns),
            len(self.key),
        )
        return fixed + ns + self.key

    @classmethod
    def unpack(cls, raw: bytes | memoryview) -> ChunkHeader | None:
        """Parse a header; None when the bytes are not a header of this format."""
        if len(raw) < _FIXED.size:
            return None
        magic, version, state, length, digest, ns_len, key_len = _FIXED.unpack_from(raw)
        if magic != CHUNK_MAGIC or version != CHUNK_VERSION:
            return None
        if ns_len > MAX_NAMESPACE_BYTES or key_len > MAX_KEY_BYTES:
            return None
        end = _FIXED.size + ns_len + key_len
        if len(raw) < end:
            return None
        try:
            namespace = bytes(raw[_FIXED.size : _FIXED.size + ns_len]).decode()
            return cls(
                namespace, bytes(raw[_FIXED.size + ns_len : end]), length, digest, SlotState(state)
            )
        except ValueError:
            return None

    def page(self) -> bytes:
        """The header padded to a full page: the first page of a chunk file or object, so the
        payload that follows stays page-aligned (O_DIRECT, readinto a pool slot)."""
        return self.pack().ljust(HEADER_BYTES, b"\0")

    def verify(self, payload: memoryview | bytes) -> bool:
        return (
            self.state == SlotState.SEALED
            and len(payload) >= self.length
            and checksum(memoryview(payload)[: self.length]) == self.checksum
        )
