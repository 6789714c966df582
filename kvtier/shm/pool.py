"""The shared-memory pool file: its geometry, its superblock and views of its slots.

Agent and clients map the same file, so the layout here is a contract between processes
(and between agent versions across a warm restart). Slot payloads are page-aligned so copies
run at memcpy speed; each slot's first page holds its chunk header (see `chunk.py`) and, in
its last 8 bytes, the slot's generation: the agent stamps a new one whenever it hands the slot
to another chunk, so a reader that checks the stamp after copying knows whether the bytes it
copied still belonged to the chunk it was granted.
This module imports only the standard library and numpy: the vLLM plug-in uses it.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import numpy.typing as npt

from kvtier.api.pool_layout import (
    POOL_VERSION,
    SLOT_HEADER_BYTES,
    STAMP_OFFSET,
    SUPERBLOCK,
    SUPERBLOCK_BYTES,
    PoolGeometry,
)
from kvtier.shm.files import new_file

Bytes = npt.NDArray[np.uint8]


class PoolMap:
    """A shared mapping of the pool file with numpy views of its slots.

    `populate` maps every page up front (MAP_POPULATE): a multi-MiB copy into a freshly
    mapped region otherwise spends as long in page faults as in copying. The file stays open
    so `intact` can tell, before a copy, whether the file still backs the whole mapping: a
    copy from a truncated file would end the process with SIGBUS.
    """

    def __init__(
        self, path: Path, geometry: PoolGeometry, populate: bool = True, writable: bool = True
    ) -> None:
        self.path = path
        self.geometry = geometry
        self.writable = writable
        self._fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
        try:
            flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            self._mmap = mmap.mmap(self._fd, geometry.file_bytes, flags=flags, prot=prot)
            self.inode = os.fstat(self._fd).st_ino
        except BaseException:
            os.close(self._fd)
            raise
        self.array = np.frombuffer(self._mmap, dtype=np.uint8)
        # Every slot's generation, as one strided view over the header pages.
        self._stamps: npt.NDArray[np.uint64] = np.ndarray(
            (geometry.slot_count,),
            dtype="<u8",
            buffer=self._mmap,
            offset=geometry.header_offset(0) + STAMP_OFFSET,
            strides=(geometry.stride,),
        )

    @classmethod
    def open(cls, path: Path, populate: bool = True, writable: bool = True) -> PoolMap:
        """Map an existing pool, reading its geometry from the superblock (client side:
        read-only for the pool, writable for the staging area)."""
        with open(path, "rb") as f:
            geometry = PoolGeometry.unpack(f.read(SUPERBLOCK.size))
        if geometry is None:
            raise ValueError(f"{path} is not a kvtier pool of format {POOL_VERSION}")
        return cls(path, geometry, populate, writable)

    @property
    def fd(self) -> int:
        """The open file behind the mapping (what a client checks the owner of)."""
        return self._fd

    def payload(self, slot: int, nbytes: int | None = None) -> Bytes:
        start = self.geometry.payload_offset(slot)
        n = self.geometry.payload_bytes if nbytes is None else nbytes
        return self.array[start : start + n]

    def header(self, slot: int) -> Bytes:
        start = self.geometry.header_offset(slot)
        return self.array[start : start + SLOT_HEADER_BYTES]

    def generation(self, slot: int) -> int:
        return int(self._stamps[slot])

    def generations(self) -> npt.NDArray[np.uint64]:
        """Every slot's generation, as a copy."""
        return self._stamps.copy()

    def set_generation(self, slot: int, generation: int) -> None:
        self._stamps[slot] = generation

    def intact(self) -> bool:
        """Whether the file still backs every mapped byte (nobody truncated it)."""
        try:
            return os.fstat(self._fd).st_size >= self.geometry.file_bytes
        except OSError:
            return False

    def close(self) -> None:
        del self.array, self._stamps
        # A caller may still hold a view; the mapping then goes away with the last view.
        with contextlib.suppress(BufferError):
            self._mmap.close()
        with contextlib.suppress(OSError):
            os.close(self._fd)


# The pool is the agent's to write, its group's to read: a client maps it read-only, so no
# client can alter a sealed chunk (bytes to store go through the staging area). Staging is
# group-writable; what a client writes there is copied into the pool, and sealed, by the
# agent at commit.
POOL_MODE = 0o640
STAGING_MODE = 0o660


def staging_path(pool_path: Path) -> Path:
    """The staging area beside the pool at `pool_path` (clients derive it the same way)."""
    return pool_path.with_name(pool_path.name + ".staging")


def superblock_of(path: Path) -> PoolGeometry | None:
    """The geometry the file at `path` says it has, or None (no file, not a pool)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(SUPERBLOCK.size)
    except OSError:
        return None
    return PoolGeometry.unpack(raw.ljust(SUPERBLOCK.size, b"\0"))


def reusable(path: Path, geometry: PoolGeometry) -> bool:
    """Whether `path` holds a pool of exactly this geometry (a warm restart keeps it). A
    file longer than its geometry is one shrunk but not yet trimmed."""
    try:
        size = path.stat().st_size
    except OSError:
        return False
    return superblock_of(path) == geometry and size >= geometry.file_bytes


def resizable(path: Path, geometry: PoolGeometry) -> bool:
    """Whether `path` holds a pool that can become one of `geometry` in place: the same slot
    size, another slot count (the tier's capacity changed)."""
    existing = superblock_of(path)
    return existing is not None and existing.payload_bytes == geometry.payload_bytes


def set_size(path: Path, geometry: PoolGeometry, mode: int) -> None:
    """Give the file at `path` `geometry`'s superblock and every page it needs, in place:
    grown by allocating the new pages only (they read as zeros: free slots). A file longer
    than that keeps its tail until `trim` (a client of the earlier agent may still be copying
    there: cut under it, the copy would end the client with SIGBUS). A resize stopped at any
    point leaves a file that `reusable` or `resizable` takes up again: never a second copy
    beside it, which a volume sized for one file has no room for."""
    fd = os.open(path, os.O_RDWR)
    try:
        os.fchmod(fd, mode)
        os.posix_fallocate(fd, 0, geometry.file_bytes)
        os.pwrite(fd, geometry.pack(), 0)
    finally:
        os.close(fd)


def trim(path: Path, geometry: PoolGeometry) -> None:
    """Cut the file at `path` to `geometry`'s size, once no grant of an earlier agent can be
    in use (its leases have run out): the room a shrink frees goes back to the volume."""
    if path.stat().st_size > geometry.file_bytes:
        os.truncate(path, geometry.file_bytes)


def create(path: Path, geometry: PoolGeometry, mode: int) -> None:
    """A fresh file of `geometry` at `path`, whatever was there: the old file is removed
    first, so the volume needs room for one of them, not both."""
    path.unlink(missing_ok=True)
    os.replace(new_file(path, geometry.file_bytes, mode, geometry.pack()), path)


def lent_stamps(path: Path, geometry: PoolGeometry) -> npt.NDArray[np.uint64]:
    """The stamps of every slot the staging file at `path` still backs, a shrunk file's
    untrimmed tail included, where `open_staging` would reuse it for `geometry`: an earlier
    agent's clients may still write any of those slots. Empty where it would not."""
    if not resizable(path, geometry):
        return np.zeros(0, np.uint64)
    backed = max((path.stat().st_size - SUPERBLOCK_BYTES) // geometry.stride, 0)
    old = PoolMap(path, PoolGeometry(geometry.payload_bytes, backed), False, False)
    try:
        return old.generations()
    finally:
        old.close()


def open_staging(path: Path, geometry: PoolGeometry, populate: bool) -> PoolMap:
    """The staging area, sized in place: its bytes never outlive the agent process that
    lends them, so an earlier one is reused as room, not as content, and its slots' stamps
    say which ones that agent had lent (see HostTier)."""
    if resizable(path, geometry):
        set_size(path, geometry, STAGING_MODE)
    else:  # none yet, or slots of another size: its stamps would be read at the wrong stride
        create(path, geometry, STAGING_MODE)
    return PoolMap(path, geometry, populate)


HELD_PIECE = 1 << 20  # bytes copied under the GIL at a time; threads may switch between pieces


def copy_held(dst: Bytes, src: Bytes) -> None:
    """Copy `src` into `dst` (C-contiguous, of one size in bytes) holding the GIL.

    numpy lets go of the GIL for a copy of this size and must take it back afterwards. In
    vLLM's scheduler process the engine's thread runs Python without a pause while a request
    waits for its KV, so taking the GIL back waits out that thread's switch interval (5 ms):
    a load of 128 rows of 128 KiB took 130 to 300 ms there, one wait per row, where the
    copies alone take 2 ms. A memoryview assignment is a plain memcpy under the GIL, made
    in pieces of `HELD_PIECE` (about 0.1 ms each) between which the interpreter switches
    threads as it does for any thread running Python: a row of many MiB never holds up the
    engine's thread for longer than its switch interval."""
    if dst.nbytes != src.nbytes:
        raise ValueError(f"cannot copy {src.nbytes} bytes into {dst.nbytes}")
    if not src.nbytes:
        return
    into, out_of = dst.data.cast("B"), src.data.cast("B")  # any shape, C-contiguous
    for start in range(0, src.nbytes, HELD_PIECE):
        into[start : start + HELD_PIECE] = out_of[start : start + HELD_PIECE]


COPY_BLOCK = 256 << 10  # copied, then summed while still in cache
_LANES = 8  # a block's sum is 8 sums of its 8 consecutive parts: a moved part changes it
_MIX = np.uint64(0x9E3779B97F4A7C15)  # each block's turn: blocks in another order differ
_FOLD = np.array([(0x9E3779B97F4A7C15 * (2 * i + 1)) % (1 << 64) for i in range(_LANES)], "<u8")


# What a staging sum is (Commit.kinds, one byte per sum): the lane sum of copy_summed, or
# the row's CRC-32, which a client can compute holding the GIL.
SUM_LANES, SUM_CRC32 = 0, 1
CRC_PIECE = 5 << 10  # zlib lets go of the GIL above 5 KiB; a CRC of this much keeps it


def copy_summed(
    dst: Bytes,
    src: Bytes,
    of_source: bool = False,
    each_block: Callable[[Bytes], object] | None = None,
    copy: Callable[[Bytes, Bytes], object] = copy_held,
    kind: int = SUM_LANES,
) -> int:
    """Copy `src` into `dst` and return the staging sum of one of them (of the source when
    `of_source`), each block summed right after it is copied, from cache; `each_block` is
    called with each copied block of `dst` (the agent hashes its copy there).

    A client sums each row it stages from its own row, the agent sums its copy in the pool:
    bytes that changed in the staging slot in between give two different sums. The sum adds
    the row's 64-bit words (wrapping) by block and by part of a block, at several times
    memcpy's speed with numpy alone (vLLM's images have no fast hash, and a CRC runs at a
    fraction of memcpy): any change but one that rearranges words within a part, or
    one made to cancel out, changes it. It guards against accidents and blind writes, not
    against a writer that crafts its bytes (see docs/security.md).

    The blocks are copied with `copy`: under the GIL by default (`copy_held`, what a client
    in vLLM's scheduler process needs); the agent's copiers, which run side by side on its
    cores, pass numpy's copy, which lets go of it. numpy's sum of a block lets go of the GIL
    either way, so beside a busy engine thread a client's store waits to take it back once
    per block (20 ms a MiB on this project's VM, against 0.05 ms alone; a load, which sums
    nothing, does not). Hence the other `kind`, SUM_CRC32: the row's CRC-32, which zlib
    computes holding the GIL in pieces of CRC_PIECE where the copy holds it (a client: 5 GB/s
    alone, half that beside a busy thread) and letting go of it a block at a time otherwise
    (the agent's copiers, which no Python thread holds up). A client sums by lanes until a
    row finds the GIL contended (`AgentClient.stage`)."""
    summed = src if of_source else dst
    blocks = _copied_blocks(dst, src, summed, each_block, copy)
    if kind == SUM_CRC32:
        crc, piece = 0, CRC_PIECE if copy is copy_held else COPY_BLOCK
        for block in blocks:
            view = block.data.cast("B")
            for at in range(0, len(view), piece):
                crc = zlib.crc32(view[at : at + piece], crc)
        return crc
    state = np.zeros(_LANES, np.uint64)
    for block in blocks:
        state *= _MIX
        state += _lane_sums(block)
    return int(np.add.reduce(state * _FOLD))


def _copied_blocks(
    dst: Bytes,
    src: Bytes,
    summed: Bytes,
    each_block: Callable[[Bytes], object] | None,
    copy: Callable[[Bytes, Bytes], object],
) -> Iterator[Bytes]:
    """`src` copied into `dst` a block at a time, each block of `summed` handed out right
    after its copy (to be summed while in cache), then `each_block` called with the copy."""
    for start in range(0, src.nbytes, COPY_BLOCK):
        end = start + COPY_BLOCK
        copy(dst[start:end], src[start:end])
        yield summed[start:end]
        if each_block is not None:
            each_block(dst[start:end])


def _lane_sums(block: Bytes) -> npt.NDArray[np.uint64]:
    whole = block.nbytes - block.nbytes % (8 * _LANES)
    lanes: npt.NDArray[np.uint64] = np.add.reduce(
        block[:whole].view("<u8").reshape(_LANES, -1), axis=1
    )
    if whole < block.nbytes:  # a tail shorter than 8 words, zero-padded
        tail = np.zeros(8 * _LANES, np.uint8)
        tail[: block.nbytes - whole] = block[whole:]
        lanes += tail.view("<u8")
    return lanes
