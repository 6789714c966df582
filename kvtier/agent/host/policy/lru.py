"""Least-recently-used eviction over the prefix tree: leaves first, as a doubly linked list
over pool slots.

vLLM looks a request's chunks up in order and stops at the first miss, so a chunk is worth
something only while its whole prefix is resident: a flat LRU that drops the first chunk of
a chain while the rest stays keeps dead weight. This LRU never evicts a chunk while a
resident chunk extends it (a child), unless every leaf is pinned; a cached prefix has no
holes. It is the LRU of kvcache-simulator (the least recently used leaf of the prefix tree),
which `tests/test_floor.py` holds it to.

The index tells it, at each store, the slot of each new chunk's parent (`on_links`: the
chunk before it in its request, where that chunk is in the pool); a chunk without one is a
root. The order is kept so that a parent is always more recent than its children: a
request's hits are ordered leaf first (each chunk just before its parent when the parent
came just before it in the batch) and a stored chunk joins just before its parent. So the
least recent chunk is a leaf, and eviction takes it in O(1); the walk past non-leaves that
remains is for chunks the order could not place (a hit beyond a request's first miss).

It forgets a chunk the moment it leaves, so it names chunks by slot (`by_slot`) and keeps
three arrays of slot numbers and one of child counts (16 bits, the rare count past that in
a dict), 14 bytes a slot, where a linked dict of keys costs over a hundred bytes a chunk.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np

from kvtier.agent.host.policy.base import ChunkId, EvictionPolicy

KIDS_MAX = 0xFFFF


class LRUPolicy(EvictionPolicy):
    name = "lru"
    by_slot = True
    links_slots = True

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        # Slot `capacity` stands for both ends: its next is the least recent chunk, its
        # previous the most recent. -1 marks a slot not in the list.
        self._next = array("i", [-1]) * (capacity + 1)
        self._prev = array("i", [-1]) * (capacity + 1)
        self._next[capacity] = self._prev[capacity] = capacity
        self._parent = array("i", [-1]) * (capacity + 1)  # the parent's slot, -1: a root
        # Resident children, up to KIDS_MAX; past it the rest are counted in `_more` (a
        # system prompt's head may have more children than 16 bits count).
        self._kids = array("H", [0]) * (capacity + 1)
        self._more: dict[int, int] = {}
        self._len = 0
        self.forced = 0  # evictions of a chunk with resident children (every leaf pinned)

    # --- the tree ------------------------------------------------------------------------

    def on_links(self, chunks: Sequence[ChunkId], parents: Sequence[int]) -> None:
        """Slots about to be written, each with its parent's slot (-1: none known)."""
        parent_of = self._parent
        for slot, parent in zip(cast(Sequence[int], chunks), parents, strict=True):
            parent_of[slot] = parent if parent != slot else -1

    def parent_of(self, slot: int) -> int:
        return self._parent[slot]

    def children(self, slot: int) -> int:
        return self._kids[slot] + self._more.get(slot, 0)

    # --- what the index tells it ---------------------------------------------------------

    def on_insert(self, chunk: ChunkId) -> None:
        self.on_inserts((chunk,))

    def on_inserts(self, chunks: Sequence[ChunkId]) -> None:
        following, preceding, parent_of, kids = self._next, self._prev, self._parent, self._kids
        end = self.capacity
        for slot in cast(Sequence[int], chunks):
            if preceding[slot] >= 0:  # held already: a use
                self._move(slot, -1)
                continue
            parent = parent_of[slot]
            if parent >= 0 and preceding[parent] < 0:  # the parent left meanwhile
                parent = parent_of[slot] = -1
            if parent >= 0:
                if kids[parent] < KIDS_MAX:
                    kids[parent] += 1
                else:
                    self._more[parent] = self._more.get(parent, 0) + 1
                after = parent  # just before its parent: less recent than it
            else:
                after = end
            before = preceding[after]
            following[before] = slot
            preceding[slot] = before
            following[slot] = after
            preceding[after] = slot
            self._len += 1

    def on_hit(self, chunk: ChunkId) -> None:
        self.on_hits((chunk,))

    def on_hits(self, chunks: Sequence[ChunkId]) -> None:
        """Each chunk still held becomes recent, in order, a chunk whose parent came just
        before it placed just before that parent (the links are rewritten in place: every
        lookup's hits come here)."""
        last = -1
        preceding = self._prev
        for slot in cast(Sequence[int], chunks):
            if preceding[slot] < 0:
                last = -1
                continue
            self._move(slot, last)
            last = slot

    def _move(self, slot: int, last: int) -> None:
        following, preceding = self._next, self._prev
        before, after = preceding[slot], following[slot]
        following[before] = after
        preceding[after] = before
        anchor = last if last >= 0 and self._parent[slot] == last else self.capacity
        before = preceding[anchor]
        following[before] = slot
        preceding[slot] = before
        following[slot] = anchor
        preceding[anchor] = slot

    def on_remove(self, chunk: ChunkId) -> None:
        slot = cast(int, chunk)
        if self._next[slot] >= 0:
            self._leave(slot)

    def evict(
        self, evictable: Callable[[ChunkId], bool], incoming: ChunkId | None = None
    ) -> ChunkId | None:
        end, following, kids = self.capacity, self._next, self._kids
        slot = following[end]
        while slot != end:
            if not kids[slot] and evictable(slot):
                self._leave(slot)
                return slot
            slot = following[slot]
        # Every leaf is pinned (a request longer than the pool): the least recent chunk.
        slot = following[end]
        while slot != end:
            if evictable(slot):
                self.forced += 1
                self._leave(slot)
                return slot
            slot = following[slot]
        return None

    def __len__(self) -> int:
        return self._len

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "tree": True, "forced": self.forced}

    def _leave(self, slot: int) -> None:
        before, after = self._prev[slot], self._next[slot]
        self._next[before] = after
        self._prev[after] = before
        self._next[slot] = self._prev[slot] = -1
        self._len -= 1
        parent = self._parent[slot]
        if parent >= 0:
            more = self._more.get(parent)
            if more is None:
                self._kids[parent] -= 1
            elif more > 1:
                self._more[parent] = more - 1
            else:
                del self._more[parent]
            self._parent[slot] = -1
        if self._kids[slot]:  # its children are roots now (and stores naming it as parent)
            parents = np.frombuffer(self._parent, np.int32)
            parents[parents == slot] = -1
            self._kids[slot] = 0
            self._more.pop(slot, None)
