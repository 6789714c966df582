"""Least-recently-used eviction, as a doubly linked list over pool slots.

It forgets a chunk the moment it leaves, so it names chunks by slot (`by_slot`) and keeps
its order in two arrays of slot numbers, 8 bytes a slot, where a linked dict of keys costs
over a hundred bytes a chunk.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from typing import cast

from kvtier.agent.policy.base import ChunkId, EvictionPolicy


class LRUPolicy(EvictionPolicy):
    name = "lru"
    by_slot = True

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        # Slot `capacity` stands for both ends: its next is the least recent chunk, its
        # previous the most recent. -1 marks a slot not in the list.
        self._next = array("i", [-1]) * (capacity + 1)
        self._prev = array("i", [-1]) * (capacity + 1)
        self._next[capacity] = self._prev[capacity] = capacity
        self._len = 0

    def on_insert(self, chunk: ChunkId) -> None:
        self.on_inserts((chunk,))

    def on_inserts(self, chunks: Sequence[ChunkId]) -> None:
        following, preceding = self._next, self._prev
        for slot in cast(Sequence[int], chunks):
            if preceding[slot] < 0:  # a list of its own, which the move to the end joins
                following[slot] = preceding[slot] = slot
                self._len += 1
        self.on_hits(chunks)

    def on_hit(self, chunk: ChunkId) -> None:
        self.on_hits((chunk,))

    def on_hits(self, chunks: Sequence[ChunkId]) -> None:
        """Move each chunk still held to the most recent end, in order (the links are
        rewritten in place: every lookup's hits come here)."""
        following, preceding, end = self._next, self._prev, self.capacity
        for slot in cast(Sequence[int], chunks):
            before = preceding[slot]
            if before < 0:
                continue
            after = following[slot]
            following[before] = after
            preceding[after] = before
            last = preceding[end]
            following[last] = slot
            preceding[slot] = last
            following[slot] = end
            preceding[end] = slot

    def on_remove(self, chunk: ChunkId) -> None:
        slot = cast(int, chunk)
        if self._next[slot] >= 0:
            self._unlink(slot)

    def evict(
        self, evictable: Callable[[ChunkId], bool], incoming: ChunkId | None = None
    ) -> ChunkId | None:
        end, following = self.capacity, self._next
        slot = following[end]
        while slot != end:
            if evictable(slot):
                self._unlink(slot)
                return slot
            slot = following[slot]
        return None

    def __len__(self) -> int:
        return self._len

    def _unlink(self, slot: int) -> None:
        before, after = self._prev[slot], self._next[slot]
        self._next[before] = after
        self._prev[after] = before
        self._next[slot] = self._prev[slot] = -1
        self._len -= 1
