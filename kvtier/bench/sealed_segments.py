"""A store with one copy, the client's, that the kernel keeps from changing after it: sealed
memfd segments, measured against memcpy in the same run (`kvtier bench host` runs it).

The host tier's store copies twice (the client into staging, the agent into the pool),
because the pool is the agent's to write. Here the agent makes a segment (`memfd_create`
with sealing allowed) and faults its pages in ahead, off the store path and charged to
itself (zeroing them); it hands the descriptor to the client over a unix socket
(SCM_RIGHTS); the client maps it, copies its rows in, unmaps it and says so; the agent then
seals it (F_SEAL_WRITE, SHRINK, GROW: no process can write, shrink or grow it again) and
checks its size, which the client could have cut before the seal. The kernel refuses the
seal (EBUSY) while any process still maps the segment writable, so a client that kept its
mapping has its store dropped, never published half-written. Measured per round, from the
descriptor sent to the seal in place (and from the segment's making, which a stream of
stores pays too, off its path), with segments of 4 KiB pages (shmem) and, where the machine
has free 2 MiB huge pages, of those (`MFD_HUGETLB | MFD_HUGE_2MB`; on Kubernetes the
`hugepages-2Mi` resource): a fresh segment costs the client one page-table entry per page
when it maps it, which 2 MiB pages cut 512-fold.

What it is not yet: a chunk stored so lives in a segment the agent holds, not in the pool
file, so a restart loses it unless something outside the agent keeps the descriptors, other
clients need the descriptor to read it, and memory comes back a whole segment at a time.
"""

from __future__ import annotations

import errno
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
HUGE_PAGES = Path("/sys/kernel/mm/hugepages/hugepages-2048kB")
SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
REPLY_SECONDS = 60.0  # a client that says nothing for this long failed


def huge_pages_free() -> int:
    """2 MiB huge pages free and not reserved on this machine (0 where it has none)."""
    try:
        free = int((HUGE_PAGES / "free_hugepages").read_text())
        return free - int((HUGE_PAGES / "resv_hugepages").read_text())
    except (OSError, ValueError):
        return 0


def shmem_huge_pages() -> str:
    """The kernel's setting for huge pages in shmem, which memfds of "4 KiB pages" follow."""
    try:
        path = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
        return next(w.strip("[]") for w in path.read_text().split() if w.startswith("["))
    except (OSError, StopIteration):
        return "unknown"


def new_segment(nbytes: int, huge: bool) -> int:
    """The agent's side, off the store path: a sealable memfd with its pages in memory and
    zeroed (shmem's `fallocate` leaves that to the first fault, so they are faulted here;
    hugetlbfs's zeroes them itself)."""
    flags = os.MFD_ALLOW_SEALING | (os.MFD_HUGETLB | os.MFD_HUGE_2MB if huge else 0)
    fd = os.memfd_create("kvtier-segment", flags)
    try:
        os.ftruncate(fd, nbytes)
        os.posix_fallocate(fd, 0, nbytes)
        if not huge:
            mmap.mmap(fd, nbytes, mmap.MAP_SHARED | mmap.MAP_POPULATE, mmap.PROT_READ).close()
    except OSError:
        os.close(fd)
        raise
    return fd


def seal(fd: int, nbytes: int) -> bool:
    """Seal a segment against every write and resize; False where a process still maps it
    writable (EBUSY) or it is not `nbytes` long any more (cut before the seal: mapped at
    its length, it would kill the reader with SIGBUS). Other errors are raised."""
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except OSError as exc:
        if exc.errno != errno.EBUSY:
            raise
        return False
    return os.fstat(fd).st_size == nbytes


def writable_after_seal(fd: int, nbytes: int) -> bool:
    """Whether anything can still write or resize a sealed segment."""
    try:
        mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE).close()
        return True
    except PermissionError:
        pass
    shorter = max(0, nbytes - HUGE_PAGE)  # a length hugetlbfs takes too
    for attempt in (lambda: os.pwrite(fd, b"x", 0), lambda: os.ftruncate(fd, shorter)):
        try:
            attempt()
            return True
        except OSError:  # EPERM sealed; EINVAL for pwrite on hugetlbfs, which has no write()
            pass
    return False


def read_back(fd: int, nbytes: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """A sealed segment's bytes, copied out. A private mapping: kernels before 6.7 refuse a
    shared one, even read-only, of a write-sealed memfd."""
    view = mmap.mmap(fd, nbytes, mmap.MAP_PRIVATE, mmap.PROT_READ)
    try:
        return np.frombuffer(view, np.uint8).copy()
    finally:
        view.close()


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
        if msg in (b"stop", b""):
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


def _ask(sock: socket.socket, message: bytes, fds: list[int]) -> None:
    socket.send_fds(sock, [message], fds)
    if sock.recv(16) != b"done":
        raise RuntimeError(f"the client process failed at {message.decode()!r}")


def measure(row: int, rows: int, rounds: int, huge: bool) -> dict[str, Any]:
    """Stores of `rows` rows of `row` bytes into sealed segments, against memcpy of the same
    rows in the client's process, alternating round by round. The first round's segment is
    read back and compared with the client's rows, and tried for writes after its seal."""
    nbytes = row * rows
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    ours.settimeout(REPLY_SECONDS)
    client = subprocess.Popen(
        [sys.executable, "-m", __name__, str(theirs.fileno()), str(row), str(rows)],
        pass_fds=[theirs.fileno()],
    )
    theirs.close()
    base: list[float] = []
    sealed: list[float] = []
    whole: list[float] = []
    try:
        for r in range(rounds):
            t = time.perf_counter()
            _ask(ours, b"base", [])
            base.append(nbytes / (time.perf_counter() - t) / 1e9)
            made = time.perf_counter()
            fd = new_segment(nbytes, huge)
            try:
                t = time.perf_counter()
                _ask(ours, b"seg", [fd])
                if not seal(fd, nbytes):
                    raise RuntimeError("a segment the client had unmapped could not be sealed")
                done = time.perf_counter()
                sealed.append(nbytes / (done - t) / 1e9)
                whole.append(nbytes / (done - made) / 1e9)
                if r == 0:
                    # the client's rows, made alike
                    if not np.array_equal(read_back(fd, nbytes), shared_buffer(nbytes)):
                        raise RuntimeError("a sealed segment does not hold the client's rows")
                    if writable_after_seal(fd, nbytes):
                        raise RuntimeError("a sealed segment could still be written")
            finally:
                os.close(fd)
        refused = _seal_refused_while_mapped(ours, nbytes, huge)
        socket.send_fds(ours, [b"stop"], [])
        client.wait(REPLY_SECONDS)
    finally:
        ours.close()
        if client.poll() is None:
            client.kill()
            client.wait()
    if client.returncode != 0:
        raise RuntimeError(f"the client process exited with {client.returncode}")
    memcpy, store, with_making = (statistics.median(x) for x in (base, sealed, whole))
    return {
        "pages": "2 MiB" if huge else "4 KiB",
        "row_bytes": row,
        "rows": rows,
        "sealed_store_gbps": store,
        "memcpy_gbps": memcpy,
        "ratio": store / memcpy,
        # the agent's making of the segment (its pages zeroed) included
        "with_allocation_gbps": with_making,
        "ratio_with_allocation": with_making / memcpy,
        "seal_refused_while_mapped": refused,
    }


def _seal_refused_while_mapped(sock: socket.socket, nbytes: int, huge: bool) -> bool:
    """A client that keeps its writable mapping: the seal must be refused."""
    fd = new_segment(nbytes, huge)
    try:
        _ask(sock, b"keep", [fd])
        return not seal(fd, nbytes)
    finally:
        os.close(fd)


def run(quick: bool, rows_of: tuple[int, ...] = (MiB, 32 * MiB)) -> dict[str, Any]:
    """Each row size with 4 KiB pages, and with 2 MiB pages where enough are free (batches
    of 64 MiB, as the host tier's store cases; rows of 32 MiB: two a batch)."""
    batch, rounds = 64 * MiB, (8 if quick else 30)
    cases = [measure(row, batch // row, rounds, huge=False) for row in rows_of]
    # one segment at a time, and the private mapping its bytes are read back through,
    # for which hugetlbfs reserves pages of its own
    wanted = 2 * batch // HUGE_PAGE
    free = huge_pages_free()
    huge: str | None = None
    if free < wanted:
        huge = f"{free} free, {wanted} needed (vm.nr_hugepages)"
    else:
        try:
            cases += [measure(row, batch // row, rounds, huge=True) for row in rows_of]
        except OSError as exc:  # free on the node, beyond this cgroup's hugetlb limit
            huge = f"could not allocate them: {exc}"
    return {
        "cases": cases,
        "huge_pages_free": free,
        "huge_pages_needed": wanted,
        "huge_pages_not_measured": huge,
        "shmem_enabled": shmem_huge_pages(),
    }


if __name__ == "__main__":
    _client(socket.socket(fileno=int(sys.argv[1])), int(sys.argv[2]), int(sys.argv[3]))
