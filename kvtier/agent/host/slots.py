"""The host index's storage by slot (see index.py for the layout and why): the key field
each slot keeps, a batch of keys as the index compares them, the map from 64-bit digests to
slots, the stack of free slots and the slots resting before their next use. Bookkeeping
rules live in index.py; nothing here knows of leases, policies or the published table."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvtier.shm.table import U64, digests

Slots = npt.NDArray[np.int64]
Mask = npt.NDArray[np.bool_]
# Given candidate slots and the rows of the batch they were found for, which are those rows'.
Confirm = Callable[[Slots, Slots], Mask]

KEY_WIDTH = 40  # bytes of a key its slot keeps; a longer key keeps a digest of itself there
WORDS = KEY_WIDTH // 8
LONG = 0xFF  # the length a slot records for a key longer than KEY_WIDTH
# Positions a batched find reads per key at once: at a quarter full a probe rarely runs
# past four, so one gather answers almost every key; a small batch, whose cost is the
# number of numpy calls rather than their length, reads eight.
_WINDOW, _WIDE_WINDOW, _WIDE_UP_TO = np.arange(4), np.arange(8), 256


def key_field(key: bytes) -> bytes:
    """What a slot's key field holds for `key`: the key, or a digest of a longer one."""
    if len(key) > KEY_WIDTH:
        key = hashlib.blake2b(key, digest_size=KEY_WIDTH).digest()
    return key.ljust(KEY_WIDTH, b"\0")


@dataclass(frozen=True)
class KeyBatch:
    """Keys of one namespace as the index compares them: their digests (where the map
    places them), key fields as words and recorded lengths, one row per key."""

    number: int  # the namespace's
    keys: list[bytes]
    hashes: npt.NDArray[np.uint64]
    words: npt.NDArray[np.uint64]  # (keys, KEY_WIDTH / 8)
    lengths: npt.NDArray[np.uint8]
    long: bool  # some key is longer than KEY_WIDTH

    @classmethod
    def of(
        cls, number: int, namespace: str, keys: list[bytes], hashes: U64 | None = None
    ) -> KeyBatch:
        """`hashes`: the keys' `digests`, where the caller has them already."""
        n = len(keys)
        sizes = set(map(len, keys))
        if len(sizes) == 1 and 0 < (size := next(iter(sizes))) <= KEY_WIDTH:
            # the usual batch (short keys of one length): no copy per key
            raw = np.zeros((n, KEY_WIDTH), np.uint8)
            raw[:, :size] = np.frombuffer(b"".join(keys), np.uint8).reshape(n, size)
            lengths: npt.NDArray[np.uint8] = np.full(n, size, np.uint8)
        else:
            raw = np.frombuffer(b"".join(map(key_field, keys)), np.uint8).reshape(n, KEY_WIDTH)
            lengths = np.array([len(k) if len(k) <= KEY_WIDTH else LONG for k in keys], np.uint8)
        if hashes is None:
            hashes = digests(namespace, keys) if n else np.empty(0, np.uint64)
        words = raw.view(np.uint64).reshape(n, WORDS)
        return cls(number, keys, hashes, words, lengths, max(sizes, default=0) > KEY_WIDTH)


class SlotMap:
    """Open addressing from a slot's 64-bit digest to the slot: a position holds only a slot
    number (4 bytes, four to eight positions per slot, so probes stay short), the digests
    live in a column of the index. Deletion shifts the rest of a cluster back (no
    tombstones), so probes stay short however much the chunks churn. A batch is found in
    numpy gathers of a window of positions per digest; placing and removing one slot walk
    its cluster in Python, over `array`s numpy sees through views."""

    def __init__(self, slots: int, hashes: array[int]) -> None:
        size = 1 << (4 * max(slots, 1) - 1).bit_length()  # at least four times the slots
        self._mask = size - 1
        self._at = array("i", [-1]) * size
        self._hashes = hashes
        self._at_view = np.frombuffer(self._at, np.int32)
        self._hash_view = np.frombuffer(hashes, np.uint64)

    def find(self, hashes: npt.NDArray[np.uint64], confirm: Confirm) -> Slots:
        """Per digest, the first slot placed under it that `confirm` accepts, else -1.

        Every slot of a digest lies in the run of occupied positions from the digest's home
        (a hole only ever follows a cluster, and removals close theirs), so a window's
        matches need no check for a hole before them; a key is looked for in the next
        window only while it found no hole."""
        found = np.full(len(hashes), -1, np.int64)
        rows: Slots = np.arange(len(hashes))
        start = (hashes & np.uint64(self._mask)).astype(np.int64)
        steps = _WINDOW if len(hashes) > _WIDE_UP_TO else _WIDE_WINDOW
        at, held = self._at_view, self._hash_view
        while rows.size:
            slots = at[(start[:, None] + steps) & self._mask]
            occupied = slots >= 0
            row, col = np.nonzero(occupied & (held[slots] == hashes[rows, None]))
            if row.size:
                ok = confirm(slots[row, col].astype(np.int64), rows[row])
                found[rows[row[ok]]] = slots[row[ok], col[ok]]
            going = occupied.all(axis=1) & (found[rows] < 0)
            rows, start = rows[going], start[going] + len(steps)
        return found

    def add(self, slot: int) -> None:
        """Place `slot` under the digest its column holds."""
        at, mask = self._at, self._mask
        pos = self._hashes[slot] & mask
        while at[pos] >= 0:
            pos = (pos + 1) & mask
        at[pos] = slot

    def discard(self, slot: int) -> None:
        """Take `slot` out (its column still holding the digest it was placed under), moving
        each later member of its cluster into the hole unless its home lies after the hole."""
        at, hashes, mask = self._at, self._hashes, self._mask
        hole = hashes[slot] & mask
        while (held := at[hole]) != slot:
            if held < 0:
                raise KeyError(f"slot {slot} is not in the map")
            hole = (hole + 1) & mask
        pos = (hole + 1) & mask
        while (moved := at[pos]) >= 0:
            if (pos - (hashes[moved] & mask)) & mask >= (pos - hole) & mask:
                at[hole] = moved
                hole = pos
            pos = (pos + 1) & mask
        at[hole] = -1


class FreeSlots:
    """The unused slots, as a stack, with a flag per slot: taking a given slot out (a restart
    adopting each chunk the pool holds) is then one flag, not a scan of the stack, which
    would make re-indexing a large pool quadratic. Entries whose slot was taken out this way
    stay in the stack and are skipped when they come up; a slot is handed out only while its
    flag says it is free, so never twice."""

    def __init__(self, slot_count: int) -> None:
        self._stack = array("i", range(slot_count - 1, -1, -1))
        self._is_free = np.ones(slot_count, np.bool_)
        self._count = slot_count

    def __len__(self) -> int:
        return self._count

    def pop(self) -> int:
        while True:
            slot = self._stack.pop()
            if self._is_free[slot]:
                self._is_free[slot] = False
                self._count -= 1
                return slot

    def append(self, slot: int) -> None:
        if not self._is_free[slot]:
            self._is_free[slot] = True
            self._count += 1
            self._stack.append(slot)

    def remove(self, slot: int) -> None:
        """Take a free slot out of use; ValueError if it is not free."""
        if not self._is_free[slot]:
            raise ValueError(f"slot {slot} is not free")
        self._is_free[slot] = False
        self._count -= 1


class RestingSlots:
    """Slots kept out of use until a time of their own: a writer whose lease expired, or a
    writer of an earlier agent process, may still be copying into them. The pool's index
    rests pool slots, the host tier staging slots."""

    def __init__(self) -> None:
        self._until: list[tuple[float, int]] = []  # (until, slot)

    def __len__(self) -> int:
        return len(self._until)

    def add(self, slot: int, until: float) -> None:
        self._until.append((until, slot))

    def due(self, now: float) -> list[int]:
        """Take out the slots whose rest is over at `now`, in the order they came."""
        if not self._until:
            return []
        done = [slot for until, slot in self._until if until <= now]
        if done:
            self._until = [(until, slot) for until, slot in self._until if until > now]
        return done
