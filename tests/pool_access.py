"""What stands in for a hostile process of the tier: it finds sealed chunks by their slot
headers and alters their bytes in the pool file. Run as a module by the engine tests, whose
vLLM environment lacks what the agent's chunk format needs (xxhash):
`python -m tests.pool_access POOL NAMESPACE` alters every other chunk and prints how many."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from kvtier.agent.chunk import ChunkHeader
from kvtier.agent.pool import PoolMap


def sealed_slots(pool_path: Path, namespace: str) -> dict[bytes, int]:
    """The slot of each sealed chunk of `namespace`, read from the pool's slot headers."""
    pool = PoolMap.open(pool_path, populate=False)
    try:
        found = {}
        for slot in range(pool.geometry.slot_count):
            header = ChunkHeader.unpack(pool.header(slot).tobytes())
            if header is not None and header.namespace == namespace:
                found[header.key] = slot
        return found
    finally:
        pool.close()


def alter_slot(pool_path: Path, slot: int) -> None:
    """Flip 4 KiB of a slot's bytes."""
    pool = PoolMap.open(pool_path, populate=False)
    try:
        payload = pool.payload(slot, 4096)
        payload[:] = np.bitwise_xor(payload, 0xFF)
    finally:
        pool.close()


if __name__ == "__main__":
    path, namespace = Path(sys.argv[1]), sys.argv[2]
    altered = sorted(sealed_slots(path, namespace).values())[::2]
    for slot in altered:
        alter_slot(path, slot)
    print(len(altered))
