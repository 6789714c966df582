"""A store with one copy, the client's, that the kernel keeps from changing after it: sealed
memfd segments, measured against memcpy in the same run (`kvtier bench host` runs it).

The host tier's store copies twice (the client into staging, the agent into the pool),
because the pool is the agent's to write. Here the agent makes a segment (`memfd_create`
with sealing allowed) and allocates its pages ahead, off the store path and charged to
itself; it hands the descriptor to the client over a unix socket (SCM_RIGHTS); the client
maps it, copies its rows in, unmaps it and says so; the agent then seals it (F_SEAL_WRITE:
no process can write it again, by `write`, a mapping or `fallocate`). The kernel refuses
the seal while any process still maps the segment writable, so a client that kept its
mapping has its store dropped, never published half-written. Measured per round, from the
descriptor sent to the seal in place (and from the segment's allocation, which zeroes its
pages: a stream of stores pays that too, off its path), with segments of 4 KiB pages
(shmem) and, where the machine has free huge pages, of 2 MiB pages (`MFD_HUGETLB`; on
Kubernetes the `hugepages-2Mi` resource): a fresh segment costs the client one page-table
entry per page when it maps it, about 0.6 µs per 4 KiB on the VM it was measured on, which
2 MiB pages cut 512-fold.

What it is not yet: a chunk stored so lives in a segment the agent holds, not in the pool
file, so a restart loses it unless something outside the agent keeps the descriptors, other
clients need the descriptor to read it, and memory comes back a whole segment at a time.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.bench.baseline import shared_buffer

MiB = 1 << 20
HUGE_PAGE = 2 * MiB
SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def huge_pages_free() -> int:
    """Free 2 MiB huge pages on this machine (0 where the kernel reports none)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("HugePages_Free:"):
            return int(line.split()[1])
    return 0


def new_segment(nbytes: int, huge: bool) -> int:
    """The agent's side, off the store path: a sealable memfd with its pages allocated."""
    fd = os.memfd_create("kvtier-segment", os.MFD_ALLOW_SEALING | (os.MFD_HUGETLB if huge else 0))
    try:
        os.ftruncate(fd, nbytes)
        os.posix_fallocate(fd, 0, nbytes)
    except OSError:
        os.close(fd)
        raise
    return fd


def seal(fd: int) -> bool:
    """Seal a segment against every write; False where a writable mapping still exists."""
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except OSError:
        return False
    return True


def writable_after_seal(fd: int, nbytes: int) -> bool:
    """Whether anything can still write a sealed segment (a mapping or `pwrite`)."""
    try:
        mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE).close()
        return True
    except PermissionError:
        pass
    try:
        os.pwrite(fd, b"x", 0)
        return True
    except OSError:  # EPERM sealed; EINVAL on hugetlbfs, which has no write()
        return False


def _client(sock: socket.socket, row: int, rows: int) -> None:
    """The client's process: copy its rows into the segment it is sent ("seg"), or into a
    populated buffer of its own ("base", the memcpy baseline); "keep" copies and leaves the
    segment mapped, as a client that keeps writing would."""
    nbytes = row * rows
    src = shared_buffer(nbytes)
    views = [src[r * row : (r + 1) * row] for r in range(rows)]
    own = shared_buffer(nbytes)
    kept: list[mmap.mmap] = []
    while True:
        msg, fds, _, _ = socket.recv_fds(sock, 16, 1)
        if msg == b"stop":
            return
        if msg == b"base":
            for r, view in enumerate(views):
                own[r * row : (r + 1) * row] = view
        else:
            m = mmap.mmap(
                fds[0],
                nbytes,
                mmap.MAP_SHARED | mmap.MAP_POPULATE,
                mmap.PROT_READ | mmap.PROT_WRITE,
            )
            os.close(fds[0])
            dst = np.frombuffer(m, np.uint8)
            for r, view in enumerate(views):
                dst[r * row : (r + 1) * row] = view
            del dst
            if msg == b"keep":
                kept.append(m)
            else:
                m.close()
        sock.send(b"done")


def measure(row: int, rows: int, rounds: int, huge: bool) -> dict[str, Any]:
    """Stores of `rows` rows of `row` bytes into sealed segments, against memcpy of the same
    rows in the client's process, alternating round by round."""
    nbytes = row * rows
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    client = subprocess.Popen(
        [sys.executable, "-m", __name__, str(theirs.fileno()), str(row), str(rows)],
        pass_fds=[theirs.fileno()],
    )
    theirs.close()
    base, sealed, whole, checked = [], [], [], False
    try:
        for _ in range(rounds):
            t = time.perf_counter()
            socket.send_fds(ours, [b"base"], [])
            ours.recv(16)
            base.append(nbytes / (time.perf_counter() - t) / 1e9)
            made = time.perf_counter()
            fd = new_segment(nbytes, huge)
            try:
                t = time.perf_counter()
                socket.send_fds(ours, [b"seg"], [fd])
                ours.recv(16)
                if not seal(fd):
                    raise RuntimeError("a segment the client had unmapped could not be sealed")
                done = time.perf_counter()
                sealed.append(nbytes / (done - t) / 1e9)
                whole.append(nbytes / (done - made) / 1e9)
                if not checked:
                    view = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ)
                    got = np.frombuffer(view, np.uint8)
                    expected = shared_buffer(nbytes)  # the client's rows, made alike
                    checked = bool(np.array_equal(got, expected))
                    del got
                    view.close()
                    if writable_after_seal(fd, nbytes):
                        raise RuntimeError("a sealed segment could still be written")
            finally:
                os.close(fd)
        refused = _seal_refused_while_mapped(ours, nbytes, huge)
        socket.send_fds(ours, [b"stop"], [])
    finally:
        ours.close()
        client.wait(30)
    memcpy, store = statistics.median(base), statistics.median(sealed)
    return {
        "pages": "2 MiB" if huge else "4 KiB",
        "row_bytes": row,
        "rows": rows,
        "sealed_store_gbps": store,
        "memcpy_gbps": memcpy,
        "ratio": store / memcpy,
        # the agent's allocation (zeroing the pages) included: what a stream of stores pays
        "with_allocation_gbps": statistics.median(whole),
        "ratio_with_allocation": statistics.median(whole) / memcpy,
        "bytes_match": checked,
        "seal_refused_while_mapped": refused,
    }


def _seal_refused_while_mapped(sock: socket.socket, nbytes: int, huge: bool) -> bool:
    """A client that keeps its writable mapping: the seal must be refused."""
    fd = new_segment(nbytes, huge)
    try:
        socket.send_fds(sock, [b"keep"], [fd])
        sock.recv(16)
        return not seal(fd)
    finally:
        os.close(fd)


def run(quick: bool, rows_of: tuple[int, ...] = (MiB, 32 * MiB)) -> dict[str, Any]:
    """Each row size with 4 KiB pages, and with 2 MiB pages where enough are free (batches
    of 64 MiB, as the host tier's store cases; rows of 32 MiB: two a batch)."""
    batch, rounds = 64 * MiB, (8 if quick else 30)
    cases = [measure(row, batch // row, rounds, huge=False) for row in rows_of]
    # rounds of one segment each, plus the one a client keeps mapped
    wanted = 2 * batch // HUGE_PAGE
    free = huge_pages_free()
    if free >= wanted:
        cases += [measure(row, batch // row, rounds, huge=True) for row in rows_of]
    return {
        "cases": cases,
        "huge_pages_free": free,
        "huge_pages_needed": wanted,
    }


if __name__ == "__main__":
    _client(socket.socket(fileno=int(sys.argv[1])), int(sys.argv[2]), int(sys.argv[3]))
