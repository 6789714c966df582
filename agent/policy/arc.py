"""Adaptive Replacement Cache (Megiddo & Modha, FAST 2003).

T1 holds chunks seen once recently, T2 chunks seen at least twice; B1 and B2 remember the
ids of chunks recently evicted from each. A store of a chunk found in a ghost list means that
list was too short, so the target size `p` of T1 moves towards it. The effect that matters for
KV caches: a long scan of one-off prefixes cycles through T1 and leaves the reused system
prompts in T2 alone, where LRU would flush them.

The paper's single `request` is split in two here because the cache learns of a miss at
lookup time but only receives the chunk later, when the engine stores it: `on_hit` handles
a hit, `evict` is REPLACE, and `on_insert` the rest of a miss.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from kvtier.agent.policy.base import ChunkId, EvictionPolicy

_List = OrderedDict[ChunkId, None]


class ARCPolicy(EvictionPolicy):
    name = "arc"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.p = 0.0
        self.t1: _List = OrderedDict()
        self.t2: _List = OrderedDict()
        self.b1: _List = OrderedDict()
        self.b2: _List = OrderedDict()

    def on_hit(self, chunk: ChunkId) -> None:
        if chunk in self.t1:
            del self.t1[chunk]
            self.t2[chunk] = None
        elif chunk in self.t2:
            self.t2.move_to_end(chunk)

    def on_insert(self, chunk: ChunkId) -> None:
        c = self.capacity
        if chunk in self.b1:
            self.p = min(float(c), self.p + max(len(self.b2) / len(self.b1), 1.0))
            del self.b1[chunk]
            self.t2[chunk] = None
        elif chunk in self.b2:
            self.p = max(0.0, self.p - max(len(self.b1) / len(self.b2), 1.0))
            del self.b2[chunk]
            self.t2[chunk] = None
        elif chunk not in self.t1 and chunk not in self.t2:
            self.t1[chunk] = None
        # Directory bounds of the paper: |T1|+|B1| <= c and |T1|+|T2|+|B1|+|B2| <= 2c.
        while self.b1 and len(self.t1) + len(self.b1) > c:
            self.b1.popitem(last=False)
        while self.b2 and len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) > 2 * c:
            self.b2.popitem(last=False)

    def on_remove(self, chunk: ChunkId) -> None:
        self.t1.pop(chunk, None)
        self.t2.pop(chunk, None)

    def evict(
        self, evictable: Callable[[ChunkId], bool], incoming: ChunkId | None = None
    ) -> ChunkId | None:
        prefer_t1 = bool(self.t1) and (
            len(self.t1) > self.p or (incoming in self.b2 and len(self.t1) == int(self.p))
        )
        order = ((self.t1, self.b1), (self.t2, self.b2))
        for resident, ghost in order if prefer_t1 else order[::-1]:
            for chunk in resident:
                if evictable(chunk):
                    del resident[chunk]
                    ghost[chunk] = None
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
        }
