"""What stands in for a hostile process of the tier: it finds sealed chunks by their slot
headers and tries to alter their bytes in the pool file, as a pod of the tier would (not
root, the tier's group as a supplementary group). The pool is the agent's to write and its
group's to read, so it alters nothing. Run as a module by the engine tests, whose vLLM
environment lacks what the agent's chunk format needs (xxhash):
`python -m tests.pool_access POOL NAMESPACE` tries every other chunk and prints how many it
altered."""

from __future__ import annotations

import mmap
import os
import sys
from pathlib import Path

import numpy as np

from kvtier.agent.chunk import ChunkHeader
from kvtier.shm.pool import PoolMap, staging_path

NOBODY = 65534


def sealed_slots(pool_path: Path, namespace: str) -> dict[bytes, int]:
    """The slot of each sealed chunk of `namespace`, read from the pool's slot headers."""
    pool = PoolMap.open(pool_path, populate=False, writable=False)
    try:
        found = {}
        for slot in range(pool.geometry.slot_count):
            header = ChunkHeader.unpack(pool.header(slot).tobytes())
            if header is not None and header.namespace == namespace:
                found[header.key] = slot
        return found
    finally:
        pool.close()


def become_tier_member(pool_path: Path) -> None:
    """Drop root as a pod of the tier runs: another uid, the pool's group supplementary."""
    gid = pool_path.stat().st_gid
    os.setgroups([gid])
    os.setgid(NOBODY)
    os.setuid(NOBODY)


def alter_slot(pool_path: Path, slot: int) -> bool:
    """Flip 4 KiB of a slot's bytes, by every way a file's group member has: open it for
    writing, or map it writable through a read-only descriptor. Whether it worked."""
    try:
        pool = PoolMap.open(pool_path, populate=False)
    except PermissionError:
        pass
    else:
        try:
            payload = pool.payload(slot, 4096)
            payload[:] = np.bitwise_xor(payload, 0xFF)
            return True
        finally:
            pool.close()
    try:
        fd = os.open(pool_path, os.O_RDONLY)
    except PermissionError:
        return False
    try:
        mmap.mmap(fd, 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except PermissionError:
        return False
    finally:
        os.close(fd)
    return True


def scribble_staging(pool_path: Path) -> int:
    """Fill every staging slot with garbage (a tier member may write there): what was
    already sealed must not change. Returns how many slots were written."""
    try:
        staging = PoolMap.open(staging_path(pool_path), populate=False)
    except PermissionError:
        return 0
    try:
        for slot in range(staging.geometry.slot_count):
            staging.payload(slot)[:] = 0xA5
        return staging.geometry.slot_count
    finally:
        staging.close()


if __name__ == "__main__":
    path, namespace = Path(sys.argv[1]), sys.argv[2]
    targets = sorted(sealed_slots(path, namespace).values())[::2]
    if os.geteuid() == 0:
        become_tier_member(path)
    scribble_staging(path)
    print(sum(alter_slot(path, slot) for slot in targets))
