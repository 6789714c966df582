"""The host index published in shared memory, so clients answer lookups in their own process.

A lookup that crosses the agent's socket costs a round trip (about 100 µs on a node) and
queues behind every other client's requests; vLLM's scheduler asks every step. The agent
therefore mirrors "which chunk is in which slot" into a file beside the pool (`<pool>.index`)
that clients map read-only: an open-addressing table from a 64-bit digest of (namespace, key)
to (slot, generation). The agent is its only writer; clients read it without locks.

Layout (little-endian u64 throughout, each array page-aligned):

    header page: magic, version, window, capacity, positions, boot, moves, retired, entries
    meta[positions]    per position: slot << 32 | seq (seq odd while the agent writes it)
    digest[positions]  0 = empty
    gen[positions]     the slot's generation while it holds that chunk (see pool.py)

Why this shape:
- Linear probing without wrap-around: a digest's home is `digest & (capacity - 1)` and its
  probe runs forward into `window` spare positions past the end, so a client reads a key's
  whole probe window as one row of a strided view (one gather per batch, no modulo).
- Capacity is the power of two at least twice the pool's slots, so the load stays at most
  1/2 (short probes, an empty position almost always inside the first window) and the table
  costs at most 4 x 24 = 96 bytes per chunk the pool can hold.
- A per-position seqlock (the seq half of `meta`): the agent makes seq odd, writes digest and
  generation, then writes the new slot with seq even. A reader that reads meta, digest, gen,
  meta and sees the same even meta twice read one consistent entry. The agent's stores and
  the readers' loads happen in program order on x86 (TSO), which this relies on; numpy's
  gathers are separate passes, so each is ordered after the one before.
- Deletion shifts later entries of the cluster back (no tombstones, so probes never grow with
  churn). A shift can move a key past a reader mid-probe, so shifts are bracketed by the
  table-wide `moves` seqlock and a reader re-probes its misses when `moves` changed.
- A hit is only a hint: the digest may collide and the entry may be evicted right after it
  was read. Whoever uses the slot validates it by the slot's header (namespace, key,
  generation) when leasing it, so a stale or colliding entry is at worst a miss.
- A new agent process marks the table it replaces `retired` before publishing its own, so a
  client notices a restart without asking; `boot` names the process that writes the table.
- The agent holds an exclusive flock on its table for as long as it runs (the kernel drops
  it when the process dies, SIGKILL included); a client's shared try-lock fails while it is
  held, so one syscall tells a client whether anyone still keeps the table true. A dead
  agent's table is not trusted: its chunks could not be leased anyway.

This module imports only the standard library, numpy and msgspec (which vLLM has): the vLLM
plug-in uses it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import mmap
import os
import struct
import time
from collections.abc import Sequence
from pathlib import Path

import msgspec
import numpy as np
import numpy.typing as npt

from kvtier.api.pool_layout import (
    INDEX_SPARE,
    MAX_KEY_BYTES,
    PAGE,
    index_array_bytes,
    index_capacity,
    index_file_bytes,
)
from kvtier.shm.files import new_file

MAGIC = b"KVTSHIX1"
VERSION = 1
WINDOW = 16  # positions read per key per probe round
_HEADER = struct.Struct("<8sIIQQQ")  # magic, version, window, capacity, positions, boot
MOVES_OFFSET = 64  # u64: odd while the agent shifts entries
RETIRED_OFFSET = 72  # u64: nonzero once a newer agent process replaced this table
ENTRIES_OFFSET = 80  # u64: entries published (informational)
_MOVES_WORD = MOVES_OFFSET // 8
_RETIRED_WORD = RETIRED_OFFSET // 8
_MASK = (1 << 64) - 1
_K_LEN = 0x9E3779B97F4A7C15
_K_WORD = 0xC2B2AE3D27D4EB4F
_F1 = 0xFF51AFD7ED558CCD
_F2 = 0xC4CEB9FE1A85EC53
U64 = npt.NDArray[np.uint64]


def index_path(pool_path: Path) -> Path:
    """Where the table of the pool at `pool_path` lives (clients derive it the same way)."""
    return pool_path.with_name(pool_path.name + ".index")


# --- digests ------------------------------------------------------------------------------


_seeds: dict[str, int] = {}


def namespace_seed(namespace: str) -> int:
    seed = _seeds.get(namespace)
    if seed is None:
        raw = hashlib.blake2b(namespace.encode(), digest_size=8, person=b"kvtier-index").digest()
        seed = _seeds[namespace] = int.from_bytes(raw, "little")
        if len(_seeds) > 4096:  # namespaces are few; a hostile stream of them is not kept
            _seeds.clear()
    return seed


_WORDS = MAX_KEY_BYTES // 8
_A = [((_K_WORD + 2 * j * _K_LEN) | 1) & _MASK for j in range(_WORDS)]
_B = [((_F1 + 2 * j * _F2) | 1) & _MASK for j in range(_WORDS)]
_A_NP = np.array(_A, np.uint64)
_B_NP = np.array(_B, np.uint64)


def digest(namespace: str, key: bytes) -> int:
    """The 64-bit digest of one key (never 0, which marks an empty position). The same
    function as `digests`, in plain integers: the plug-in's per-key lookups use it.

    Each 8-byte word is mixed on its own with constants of its position and the results
    are combined by xor, then finished with murmur3's fmix64: a whole batch is then a few
    numpy operations over a (keys x words) matrix, not a few per word.
    """
    if len(key) > 8 * _WORDS:
        raise ValueError("key too long for the index digest")
    h = namespace_seed(namespace) ^ ((len(key) * _K_LEN) & _MASK)
    padded = key + b"\0" * (-len(key) % 8)
    for j, (word,) in enumerate(struct.iter_unpack("<Q", padded)):
        t = (word * _A[j]) & _MASK
        t ^= t >> 29
        h ^= (t * _B[j]) & _MASK
    return _fmix(h) or 1


def _fmix(h: int) -> int:
    h ^= h >> 33
    h = (h * _F1) & _MASK
    h ^= h >> 33
    h = (h * _F2) & _MASK
    return h ^ (h >> 33)


def digests(namespace: str, keys: Sequence[bytes]) -> U64:
    """The digests of many keys at once, vectorised (keys of equal length in one pass)."""
    n = len(keys)
    out = np.empty(n, np.uint64)
    if n == 0:
        return out
    seed = namespace_seed(namespace)
    length = len(keys[0])
    packed = _packed(keys, length)
    if packed is not None:
        out[:] = _digest_equal(seed, n, length, *packed)
        return out
    lengths = np.array(list(map(len, keys)), np.int64)
    for size in np.unique(lengths).tolist():
        where = np.flatnonzero(lengths == size)
        group = b"".join([keys[i] for i in where.tolist()])
        out[where] = _digest_equal(seed, len(where), int(size), group, 0, int(size))
    return out


_ENCODE = msgspec.msgpack.Encoder().encode
_BIN8 = 0xC4  # msgpack's tag of a byte string of at most 255 bytes, its length next


def _packed(keys: Sequence[bytes], length: int) -> tuple[bytes, int, int] | None:
    """The keys laid end to end as (buffer, offset of the first key, stride) when every one
    is a byte string of `length` bytes (1 to 255), else None.

    msgpack lays a list of byte strings out as an array header (1, 3 or 5 bytes by the
    count) and, per key, the tag `_BIN8`, its length and its bytes: one C call, where
    testing each key's length in Python costs more than the digests themselves. The first
    key's tag lies right after the header; each tag that says `length` puts the next tag
    `length + 2` bytes further, so a buffer of exactly the count's size whose tags all say
    `length` holds keys of that length only (a key of another length, or of another type,
    moves or changes a tag).
    """
    if not 0 < length < 256:
        return None
    try:
        buf = _ENCODE(keys)
    except (TypeError, msgspec.EncodeError):
        return None
    n = len(keys)
    head = 1 if n < 16 else 3 if n < 1 << 16 else 5
    stride = length + 2
    if len(buf) != head + n * stride:
        return None
    tags: npt.NDArray[np.uint16] = np.ndarray((n,), "<u2", buf, head, (stride,))
    if not (tags == (_BIN8 | length << 8)).all():
        return None
    return buf, head + 2, stride


def _digest_equal(seed: int, n: int, length: int, buf: bytes, offset: int, stride: int) -> U64:
    """The digests of `n` keys of `length` bytes each, key i at `offset + i * stride`."""
    words = -(-length // 8)
    if words > _WORDS:
        raise ValueError("key too long for the index digest")
    # (words x keys), so each operation's inner loop runs over the keys, not over a few
    # words; each word of every key is read as one strided (unaligned) view of the keys
    t = np.empty((words, n), np.uint64)
    for j in range(length // 8):
        t[j] = np.ndarray((n,), "<u8", buf, offset + 8 * j, (stride,))
    tail = length % 8
    if tail and length > 8:
        # the key's last 8 bytes, shifted so its tail bytes stand alone (zero-padded)
        last: U64 = np.ndarray((n,), "<u8", buf, offset + length - 8, (stride,))
        np.right_shift(last, np.uint64(8 * (8 - tail)), out=t[-1])
    elif tail:
        raw = np.zeros((n, 8), np.uint8)
        raw[:, :length] = np.ndarray((n, length), np.uint8, buf, offset, (stride, 1))
        t[-1] = raw.view("<u8")[:, 0]
    t *= _A_NP[:words, None]
    t ^= t >> np.uint64(29)
    t *= _B_NP[:words, None]
    h = t[0] ^ np.uint64(seed ^ ((length * _K_LEN) & _MASK))
    for j in range(1, words):
        h ^= t[j]
    s33 = np.uint64(33)
    h ^= h >> s33
    h *= np.uint64(_F1)
    h ^= h >> s33
    h *= np.uint64(_F2)
    h ^= h >> s33
    h[h == 0] = 1
    out: U64 = h
    return out


# --- the file -----------------------------------------------------------------------------


class _Mapped:
    """A mapping of a table file and views of its arrays."""

    def __init__(self, path: Path, writable: bool) -> None:
        fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
        try:
            with open(path, "rb") as f:
                magic, version, window, capacity, positions, boot = _HEADER.unpack(
                    f.read(_HEADER.size)
                )
            if magic != MAGIC or version != VERSION or window != WINDOW:
                raise ValueError(f"{path} is not a kvtier index of format {VERSION}")
            if positions != capacity + INDEX_SPARE or capacity & (capacity - 1):
                raise ValueError(f"{path} has an inconsistent geometry")
            size = index_file_bytes(capacity)
            if os.fstat(fd).st_size < size:
                raise ValueError(f"{path} is shorter than its geometry")
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            self.mmap = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=prot)
        finally:
            os.close(fd)
        self.path = path
        self.capacity: int = capacity
        self.positions: int = positions
        self.boot: int = boot
        step = index_array_bytes(positions)
        self.header: U64 = np.ndarray((PAGE // 8,), "<u8", self.mmap, 0)
        self.meta: U64 = np.ndarray((positions,), "<u8", self.mmap, PAGE)
        self.digest: U64 = np.ndarray((positions,), "<u8", self.mmap, PAGE + step)
        self.gen: U64 = np.ndarray((positions,), "<u8", self.mmap, PAGE + 2 * step)

    def close(self) -> None:
        del self.header, self.meta, self.digest, self.gen
        with contextlib.suppress(BufferError):  # a caller's view keeps it until released
            self.mmap.close()


def retire(path: Path) -> None:
    """Mark the table at `path` (an earlier agent process's) as replaced."""
    with contextlib.suppress(OSError, ValueError):
        old = _Mapped(path, writable=True)
        old.header[RETIRED_OFFSET // 8] = 1
        old.close()


class TableWriter:
    """The agent's side: publish and withdraw entries (called with the index lock held).

    Scalar reads and writes go through memoryview casts, several times cheaper than numpy
    scalars for one position at a time. Each digest is published for one chunk at most: a
    second chunk whose digest collides is not published (a lookup answered by a client
    misses it; the agent still serves it), so withdrawing one never withdraws the other.
    """

    def __init__(self, path: Path, slot_count: int, boot: int, mode: int = 0o640) -> None:
        capacity = index_capacity(slot_count)
        retire(path)
        header = _HEADER.pack(MAGIC, VERSION, WINDOW, capacity, capacity + INDEX_SPARE, boot)
        tmp = new_file(path, index_file_bytes(capacity), mode, header)
        lock_fd = os.open(tmp, os.O_RDONLY)
        fcntl.flock(lock_fd, fcntl.LOCK_EX)  # held until this process ends
        os.replace(tmp, path)
        self._map = _Mapped(path, writable=True)
        self._lock_fd = lock_fd
        self.path = path
        self.capacity = capacity = self._map.capacity
        self.entries = 0
        self.collisions = 0  # chunks not published because their digest was taken
        self._mask = capacity - 1
        self._limit = capacity + INDEX_SPARE
        words = memoryview(self._map.mmap).cast("Q")
        step = index_array_bytes(capacity + INDEX_SPARE) // 8
        base = PAGE // 8
        self._header = words[:base]
        self._meta = words[base : base + step]
        self._digest = words[base + step : base + 2 * step]
        self._gen = words[base + 2 * step : base + 3 * step]

    def close(self) -> None:
        self._header.release()
        self._meta.release()
        self._digest.release()
        self._gen.release()
        self._map.close()
        os.close(self._lock_fd)  # drops the flock: readers stop trusting the table

    def _find(self, d: int) -> int:
        """The position holding digest `d`, or -1."""
        pos = d & self._mask
        while pos < self._limit:
            seen = int(self._digest[pos])
            if seen == d:
                return pos
            if seen == 0:
                return -1
            pos += 1
        return -1

    def put(self, d: int, slot: int, generation: int) -> bool:
        """Publish digest -> (slot, generation); False when the digest is taken or its
        probe ran out of spare positions (the chunk is then answered by the agent only)."""
        pos = d & self._mask
        while pos < self._limit:
            seen = self._digest[pos]
            if seen == d:
                self.collisions += 1
                return False
            if seen == 0:
                break
            pos += 1
        else:
            self.collisions += 1
            return False
        self._write(pos, d, slot, generation)
        self.entries += 1
        self._header[ENTRIES_OFFSET // 8] = self.entries
        return True

    def remove(self, d: int) -> None:
        """Withdraw digest `d`, shifting the rest of its cluster back over the hole."""
        hole = self._find(d)
        if hole < 0:
            return
        moves = MOVES_OFFSET // 8
        shifting = False
        pos = hole + 1
        while pos < self._limit:
            seen = self._digest[pos]
            if seen == 0:
                break
            if (seen & self._mask) <= hole:
                if not shifting:
                    self._header[moves] += 1  # odd: entries are moving
                    shifting = True
                self._write(hole, seen, self._meta[pos] >> 32, self._gen[pos])
                hole = pos
            pos += 1
        self._write(hole, 0, 0, 0)
        if shifting:
            self._header[moves] += 1
        self.entries -= 1
        self._header[ENTRIES_OFFSET // 8] = self.entries

    def _write(self, pos: int, d: int, slot: int, generation: int) -> None:
        seq = (self._meta[pos] & 0xFFFFFFFF) + 1
        self._meta[pos] = (self._meta[pos] & ~0xFFFFFFFF & _MASK) | (seq & 0xFFFFFFFF)
        self._digest[pos] = d
        self._gen[pos] = generation
        self._meta[pos] = (slot << 32) | ((seq + 1) & 0xFFFFFFFF)


def _any_rows(flags: npt.NDArray[np.bool_]) -> npt.NDArray[np.bool_]:
    words = flags.view(np.uint64)
    out: npt.NDArray[np.bool_] = words[:, 0] != 0
    for j in range(1, words.shape[1]):
        out |= words[:, j] != 0
    return out


class TableReader:
    """A client's read-only view of the table."""

    def __init__(self, path: Path) -> None:
        self._map = _Mapped(path, writable=False)
        self._fd = os.open(path, os.O_RDONLY)
        self._alive = True
        self._alive_at = -1e9
        self.path = path
        self.boot = self._map.boot
        self.capacity = self._map.capacity
        self._mask = np.uint64(self.capacity - 1)
        m = self._map
        self._last = m.positions - WINDOW
        # Every position's probe window as one row: no copy, rows overlap.
        self._windows = np.lib.stride_tricks.as_strided(
            m.digest, (m.positions - WINDOW + 1, WINDOW), (8, 8), writeable=False
        )
        self._words = memoryview(m.mmap).cast("Q")
        step = index_array_bytes(m.positions) // 8
        self._meta_at = PAGE // 8
        self._digest_at = self._meta_at + step
        self._gen_at = self._meta_at + 2 * step
        self._int_mask = self.capacity - 1
        self._positions = m.positions
        self._meta_words = self._words[self._meta_at : self._meta_at + m.positions]
        self._digest_words = self._words[self._digest_at : self._digest_at + m.positions]

    @property
    def retired(self) -> bool:
        return bool(self._words[_RETIRED_WORD])

    def usable_within(self, seconds: float) -> bool:
        """Not `retired`, and `alive_within(seconds)` (inlined): what a per-key caller tests."""
        if self._words[_RETIRED_WORD]:
            return False
        now = time.monotonic()
        if now - self._alive_at > seconds:
            self._alive = self.alive()
            self._alive_at = now
        return self._alive

    def alive_within(self, seconds: float) -> bool:
        """`alive`, tested at most once per `seconds` (a per-key caller asks thousands of
        times a step; a dead agent is noticed that much later)."""
        now = time.monotonic()
        if now - self._alive_at > seconds:
            self._alive = self.alive()
            self._alive_at = now
        return self._alive

    def alive(self) -> bool:
        """Whether the agent that writes this table still runs (it holds its flock)."""
        try:
            fcntl.flock(self._fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        except OSError:
            return False
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        return False

    @property
    def fd(self) -> int:
        """The open file behind the mapping (what a client checks the owner of)."""
        return self._fd

    def close(self) -> None:
        """Unmap when no view is left; another thread may still be probing, so the views
        stay valid until this reader is dropped."""
        with contextlib.suppress(BufferError):
            self._map.mmap.close()
        with contextlib.suppress(OSError):
            os.close(self._fd)

    def _moves(self) -> int:
        return int(self._words[MOVES_OFFSET // 8])

    def entries(self) -> tuple[U64, npt.NDArray[np.int64], U64]:
        """Every entry read whole (digests, slots, generations): for checks of a table as
        a dead agent left it, and for tests."""
        m = self._map
        meta1 = m.meta.copy()
        seen = m.digest.copy()
        gens = m.gen.copy()
        meta2 = m.meta.copy()
        whole = (meta1 == meta2) & ((meta1 & np.uint64(1)) == 0) & (seen != 0)
        return seen[whole], (meta2[whole] >> np.uint64(32)).astype(np.int64), gens[whole]

    def find(self, ds: U64) -> tuple[npt.NDArray[np.int64], U64]:
        """Slots and generations of digests `ds`: slot -1 where the table holds none.

        Each key's home position is read first, under its seqlock: at a load of at most 1/2
        most keys are settled there (their digest, or an empty home: no key lies past an
        empty position of its cluster), for a few gathers of one position per key. The
        others read their probe windows: one gather reads every such key's window, and the
        positions that hold a wanted digest are read under their seqlocks. Keys whose window
        neither holds their digest nor ends their cluster read the next window (the same one
        again where entries moved meanwhile: they may have moved back into it), a few rounds
        at most; the rare key still unresolved then (caught mid-write, or missed while
        entries moved) is probed again on its own (`find_one`).
        """
        base = (ds & self._mask).astype(np.intp)
        slots, gens, again = self._probe_home(ds, base)
        if again.any():  # else the common case: every key settled at its home
            self._probe_rest(ds, base, np.flatnonzero(again), slots, gens)
        return slots, gens

    def held(self, ds: U64) -> npt.NDArray[np.bool_]:
        """Whether the table holds each of digests `ds` (`find`'s slot is not -1), for a
        lookup: its homes are read without their generations, a few numpy calls fewer."""
        base = (ds & self._mask).astype(np.intp)
        m = self._map
        moves = self._moves()
        meta1 = m.meta[base]
        seen = m.digest[base]
        meta2 = m.meta[base]
        good: npt.NDArray[np.bool_] = (meta1 == meta2) & ((meta1 & np.uint64(1)) == 0)
        good &= seen == ds
        after = self._moves()
        again = ~good & (seen != 0) if after == moves and not after & 1 else ~good
        if not again.any():
            return good
        slots = np.where(good, 0, -1)
        self._probe_rest(ds, base, np.flatnonzero(again), slots, np.zeros(len(ds), np.uint64))
        held: npt.NDArray[np.bool_] = slots >= 0
        return held

    def _probe_rest(
        self,
        ds: U64,
        base: npt.NDArray[np.intp],
        todo: npt.NDArray[np.intp],
        slots: npt.NDArray[np.int64],
        gens: U64,
    ) -> None:
        """`find` for the keys `todo` its home round left open, into `slots` and `gens`."""
        base = base[todo]
        for _ in range(3):
            got, gen, again, still = self._probe(ds[todo], base)
            slots[todo], gens[todo] = got, gen
            todo, base = todo[again], base[again]
            if not len(todo):
                return
            if still:  # else entries moved meanwhile, maybe back into this window: again
                base = np.minimum(base + WINDOW, self._last)
        for i in todo.tolist():
            slots[i], gens[i] = self.find_one(int(ds[i]))

    def _read(
        self, want: U64, pos: npt.NDArray[np.intp]
    ) -> tuple[npt.NDArray[np.int64], U64, U64, npt.NDArray[np.bool_], bool]:
        """The entries at `pos` read under their seqlocks: (slots, generations, the digests
        seen, which held `want` read whole, whether no entry moved meanwhile)."""
        m = self._map
        moves = self._moves()
        meta1 = m.meta[pos]
        seen = m.digest[pos]
        gens = m.gen[pos]
        meta2 = m.meta[pos]
        good = (meta1 == meta2) & ((meta1 & np.uint64(1)) == 0) & (seen == want)
        slots = np.where(good, (meta2 >> np.uint64(32)).astype(np.int64), -1)
        gens[~good] = 0
        after = self._moves()
        return slots, gens, seen, good, after == moves and not after & 1

    def _probe_home(
        self, want: U64, base: npt.NDArray[np.intp]
    ) -> tuple[npt.NDArray[np.int64], U64, npt.NDArray[np.bool_]]:
        """Each key's home position: (slots, generations, which keys need their window)."""
        slots, gens, seen, good, still = self._read(want, base)
        if not still:
            return slots, gens, ~good
        return slots, gens, ~good & (seen != 0)

    def _probe(
        self, want: U64, base: npt.NDArray[np.intp]
    ) -> tuple[npt.NDArray[np.int64], U64, npt.NDArray[np.bool_], bool]:
        """One probe round of whole windows: (slots, generations, which keys need another
        round, whether no entry moved meanwhile)."""
        rows = self._windows[base]
        match = rows == want[:, None]
        slots, gens, _, good, still = self._read(want, base + match.argmax(axis=1))
        if not still:
            return slots, gens, ~good, False
        # Not read whole although its digest is there (caught mid-write), or no empty
        # position ends its cluster within the window (the key may lie further). Boolean
        # rows are tested 8 at a time as u64 words: numpy's any() is several times slower.
        found = _any_rows(match)
        ended = _any_rows(rows == 0)
        return slots, gens, ~good & (found | ~ended), True

    def holds(self, d: int) -> bool:
        """Whether the table holds digest `d`: `find_one`'s slot is not -1. Its first probe
        inlined, with the fewest reads (no generation), for the per-key callers; a probe
        caught mid-write or while entries moved is left to `find_one`."""
        digest_words, meta_words = self._digest_words, self._meta_words
        moves = self._words[_MOVES_WORD]
        pos = d & self._int_mask
        limit = self._positions
        while pos < limit:
            seen = digest_words[pos]
            if seen == d:
                meta1 = meta_words[pos]
                again = digest_words[pos]
                if meta1 == meta_words[pos] and not meta1 & 1 and again == d:
                    return True
                break
            if seen == 0:
                after = self._words[_MOVES_WORD]
                if after == moves and not after & 1:
                    return False
                break
            pos += 1
        else:
            return False
        return self.find_one(d)[0] >= 0

    def holds_live(self, d: int) -> bool | None:
        """`holds`, or None once a newer agent process retired this table: the test a
        per-key caller that keeps this reader between its liveness checks makes (one read
        of the header), so a restart is noticed at the next key."""
        if self._words[_RETIRED_WORD]:
            return None
        return self.holds(d)

    def find_one(self, d: int, rounds: int = 4) -> tuple[int, int]:
        """`find` for one digest, in plain integers (the plug-in asks per key)."""
        w = self._words
        mask = self.capacity - 1
        limit = self._map.positions
        meta_at, digest_at, gen_at = self._meta_at, self._digest_at, self._gen_at
        for _ in range(rounds):
            moves = int(w[MOVES_OFFSET // 8])
            pos = d & mask
            while pos < limit:
                seen = w[digest_at + pos]
                if seen == d:
                    meta1 = w[meta_at + pos]
                    gen = w[gen_at + pos]
                    again = w[digest_at + pos]
                    meta2 = w[meta_at + pos]
                    if meta1 == meta2 and not meta1 & 1 and again == d:
                        return meta2 >> 32, gen
                    break  # caught mid-write: read again
                if seen == 0:
                    after = int(w[MOVES_OFFSET // 8])
                    if after == moves and not after & 1:
                        return -1, 0
                    break
                pos += 1
            else:
                return -1, 0
        return -1, 0
