"""Raw baselines that kvtier's paths are compared with, measured in the same run."""

from __future__ import annotations

import mmap
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import xxhash

from kvtier.shm.pool import Bytes


def shared_buffer(nbytes: int) -> Bytes:
    """A populated shared anonymous mapping: what an engine's pinned host buffer looks like
    to the copy path (mapped, resident, no page faults on first touch)."""
    flags = mmap.MAP_SHARED | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE
    buf = np.frombuffer(mmap.mmap(-1, nbytes, flags=flags), dtype=np.uint8)
    buf[:] = (np.arange(nbytes, dtype=np.uint32) * 2654435761 >> 13).astype(np.uint8)
    return buf


def tmpfs_buffer(nbytes: int) -> Bytes:
    """A populated mapping of a file on /dev/shm, like the agent's pool."""
    fd, path = tempfile.mkstemp(prefix="kvtier-bench-", dir="/dev/shm")
    try:
        os.ftruncate(fd, nbytes)
        m = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
    finally:
        os.close(fd)
        os.unlink(path)
    return np.frombuffer(m, dtype=np.uint8)


@dataclass(frozen=True)
class Throughput:
    bytes: int
    seconds: float

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9


def run_threads(workers: list[Callable[[], int]], duration: float) -> Throughput:
    """Run each worker (one call moves the returned number of bytes) on its own thread for
    `duration` seconds, all starting together; returns the aggregate throughput."""
    barrier = threading.Barrier(len(workers) + 1)
    moved = [0] * len(workers)
    stop_at = [0.0]

    def loop(i: int, work: Callable[[], int]) -> None:
        barrier.wait()
        total = 0
        while time.perf_counter() < stop_at[0]:
            total += work()
        moved[i] = total

    threads = [threading.Thread(target=loop, args=(i, w)) for i, w in enumerate(workers)]
    for t in threads:
        t.start()
    start = time.perf_counter()
    stop_at[0] = start + duration
    barrier.wait()
    for t in threads:
        t.join()
    return Throughput(sum(moved), time.perf_counter() - start)


@contextmanager
def python_spinning() -> Iterator[None]:
    """A thread running Python without a pause for the duration, as vLLM's engine thread
    does in the scheduler process while a request waits for its KV: a copy there that lets
    go of the GIL waits out the interpreter's switch interval to take it back."""
    stop = threading.Event()

    def spin() -> None:
        turns = 0
        while not stop.is_set():
            turns += 1

    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def memcpy_rows(
    src: Bytes, dst: Bytes, row_bytes: int, rows: int, checksum: bool = False
) -> Callable[[], int]:
    """A worker copying `rows` rows of `row_bytes` per call, one copy per row, between the
    two buffers. The larger buffer is walked round-robin, as a store walks pool slots, so
    the baseline does not profit from a cache the measured path cannot use. With `checksum`
    each copied row is then hashed as a verified store must (the agent's sealer does this)."""
    small, large = (src, dst) if src.nbytes <= dst.nbytes else (dst, src)
    windows = large.nbytes // small.nbytes
    position = [0]

    def work() -> int:
        base = (position[0] % windows) * small.nbytes
        position[0] += 1
        for r in range(rows):
            a = small[r * row_bytes : (r + 1) * row_bytes]
            b = large[base + r * row_bytes : base + (r + 1) * row_bytes]
            if small is src:
                np.copyto(b, a)
            else:
                np.copyto(a, b)
            if checksum:
                xxhash.xxh3_64_intdigest((b if small is src else a).data)
        return rows * row_bytes

    return work
