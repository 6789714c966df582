"""Adaptive Replacement Cache (Megiddo & Modha, FAST 2003).

T1 holds chunks seen once recently, T2 chunks seen at least twice; B1 and B2 remember the
ids of chunks recently evicted from each. A store of a chunk found in a ghost list means that
list was too short, so the target size `p` of T1 moves towards it. The effect that matters for
KV caches: a long scan of one-off prefixes cycles through T1 and leaves the reused system
prompts in T2 alone, where LRU would flush them.

The paper's single `request` is split in two here because the cache learns of a miss at
lookup time but only receives the chunk later, when the engine stores it: `on_hit` handles
a hit (case I), `evict` is REPLACE, and `on_insert` the rest of a miss. The order is the
paper's: a store of a chunk found in a ghost list adapts `p` first (in `evict`, which the
index calls with the incoming chunk when the pool is full; in `on_insert` when a slot was
free), then REPLACE compares |T1| with that new `p`, exactly (`p` is a real number; the
tie |T1| = p favours evicting from T1 only for a chunk coming back from B2). The directory
trimming of case IV (drop B1's or B2's oldest ghost) runs when the chunk is inserted, which
leaves the same lists as the paper's order: REPLACE never looks at which ghosts are there
other than the incoming chunk.


Over the prefix tree: like `lru`, it never evicts a chunk while a resident chunk extends it
(leaves first, unless every leaf is pinned), so a cached prefix has no holes. Stores name
each chunk's parent (`on_parents`); a request's hits are taken leaf first, so a parent is
more recent in its list than its children, and a store moves the parent it extends to the
recent end of its list (no promotion: it was used by the very request).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from kvtier.agent.host.policy.base import ChunkId, EvictionPolicy

_List = OrderedDict[ChunkId, None]
_NONE: frozenset[ChunkId] = frozenset()


class ARCPolicy(EvictionPolicy):
    name = "arc"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.p = 0.0
        self.t1: _List = OrderedDict()
        self.t2: _List = OrderedDict()
        self.b1: _List = OrderedDict()
        self.b2: _List = OrderedDict()
        # Ghost hits whose adaptation of p already ran in `evict`, before REPLACE.
        self._adapted: set[ChunkId] = set()
        self._announced: OrderedDict[ChunkId, ChunkId] = OrderedDict()  # stores in flight
        self._parent: dict[ChunkId, ChunkId] = {}  # resident chunks with a resident parent
        self._kids: dict[ChunkId, int] = {}  # resident children, where any
        self._batch: set[ChunkId] | frozenset[ChunkId] = _NONE  # the store being committed
        self.forced = 0

    def on_parents(self, pairs: Sequence[tuple[ChunkId, ChunkId | None]]) -> None:
        announced = self._announced
        for chunk, parent in pairs:
            if parent is not None:
                announced[chunk] = parent
                announced.move_to_end(chunk)
        while len(announced) > 2 * self.capacity:  # stores that were never committed
            announced.popitem(last=False)

    def on_hits(self, chunks: Sequence[ChunkId]) -> None:
        """Leaf first, so each parent ends more recent than its children (`on_hit`, inlined:
        every lookup's hits come here)."""
        t1, t2 = self.t1, self.t2
        for chunk in reversed(chunks):
            if chunk in t1:
                del t1[chunk]
                t2[chunk] = None
            elif chunk in t2:
                t2.move_to_end(chunk)

    def on_inserts(self, chunks: Sequence[ChunkId]) -> None:
        """Deepest first, so each parent ends more recent than its children; a chunk whose
        parent comes in the same store is linked to it (it is resident once the store is)."""
        self._batch = set(chunks)
        try:
            for chunk in reversed(chunks):
                self.on_insert(chunk)
        finally:
            self._batch = _NONE

    def on_hit(self, chunk: ChunkId) -> None:
        self.on_hits((chunk,))

    def children_of(self, chunk: ChunkId) -> int:
        return self._kids.get(chunk, 0)

    def _adapt(self, chunk: ChunkId) -> None:
        """Cases II and III: a ghost hit moves the target size of T1 towards its list, by
        1 or by the other ghost list's size relative to this one, whichever is larger."""
        if chunk in self.b1:
            self.p = min(float(self.capacity), self.p + max(len(self.b2) / len(self.b1), 1.0))
        elif chunk in self.b2:
            self.p = max(0.0, self.p - max(len(self.b1) / len(self.b2), 1.0))

    def on_insert(self, chunk: ChunkId) -> None:
        t1, t2, b1, b2 = self.t1, self.t2, self.b1, self.b2
        if chunk in t1 or chunk in t2:
            return  # resident already (a hit): nothing changes, the bounds still hold
        parent = self._announced.pop(chunk, None)
        if parent is not None:  # _link, inlined: every stored chunk comes here
            held = t1 if parent in t1 else t2 if parent in t2 else None
            if held is not None or parent in self._batch:
                self._parent[chunk] = parent
                kids = self._kids
                kids[parent] = kids.get(parent, 0) + 1
            if held is not None:
                held.move_to_end(parent)
        if chunk in b1 or chunk in b2:
            if chunk in self._adapted:
                self._adapted.discard(chunk)
            else:
                self._adapt(chunk)
            b1.pop(chunk, None)
            b2.pop(chunk, None)
            t2[chunk] = None
        else:
            t1[chunk] = None
        # Directory bounds of the paper: |T1|+|B1| <= c and |T1|+|T2|+|B1|+|B2| <= 2c.
        c = self.capacity
        while b1 and len(t1) + len(b1) > c:
            self._adapted.discard(b1.popitem(last=False)[0])
        while b2 and len(t1) + len(t2) + len(b1) + len(b2) > 2 * c:
            self._adapted.discard(b2.popitem(last=False)[0])

    def _link(self, chunk: ChunkId, parent: ChunkId, held: _List | None) -> None:
        """A new chunk extends `parent`, resident in list `held` (None: not resident; linked
        all the same if the store being committed brings it), which moves to its list's
        recent end."""
        if held is not None or parent in self._batch:
            self._parent[chunk] = parent
            self._kids[parent] = self._kids.get(parent, 0) + 1
        if held is not None:
            held.move_to_end(parent)

    def on_remove(self, chunk: ChunkId) -> None:
        if chunk in self.t1 or chunk in self.t2:
            self.t1.pop(chunk, None)
            self.t2.pop(chunk, None)
            self._leave(chunk)

    def on_evicted(self, chunk: ChunkId) -> None:
        """Another policy chose `chunk` for eviction: it goes as if this one had evicted it
        (remembered in the ghost list of the list it was in)."""
        for resident, ghost in ((self.t1, self.b1), (self.t2, self.b2)):
            if chunk in resident:
                del resident[chunk]
                ghost[chunk] = None
                self._leave(chunk)
                return

    def _leave(self, chunk: ChunkId) -> None:
        kids = self._kids
        parent = self._parent.pop(chunk, None)
        if parent is not None:
            left = kids[parent] - 1
            if left:
                kids[parent] = left
            else:
                del kids[parent]
        if chunk in kids and kids.pop(chunk):  # forced out: its children are roots now
            for child in [k for k, p in self._parent.items() if p == chunk]:
                del self._parent[child]

    def evict(
        self, evictable: Callable[[ChunkId], bool], incoming: ChunkId | None = None
    ) -> ChunkId | None:
        returning = incoming is not None and (incoming in self.b1 or incoming in self.b2)
        if returning and incoming not in self._adapted:
            self._adapt(incoming)
            self._adapted.add(incoming)
        prefer_t1 = bool(self.t1) and (
            len(self.t1) > self.p or (incoming in self.b2 and len(self.t1) == self.p)
        )
        order = ((self.t1, self.b1), (self.t2, self.b2))
        kids = self._kids
        for leaves in (True, False):
            for resident, ghost in order if prefer_t1 else order[::-1]:
                for chunk in resident:
                    if (not leaves or chunk not in kids) and evictable(chunk):
                        del resident[chunk]
                        ghost[chunk] = None
                        self.forced += not leaves
                        self._leave(chunk)
                        return chunk
        return None

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "p": self.p,
            "t1": len(self.t1),
            "t2": len(self.t2),
            "b1": len(self.b1),
            "b2": len(self.b2),
            "tree": True,
            "forced": self.forced,
        }
