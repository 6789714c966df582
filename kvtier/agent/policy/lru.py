"""Least-recently-used eviction."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from kvtier.agent.policy.base import ChunkId, EvictionPolicy


class LRUPolicy(EvictionPolicy):
    name = "lru"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._order: OrderedDict[ChunkId, None] = OrderedDict()

    def on_insert(self, chunk: ChunkId) -> None:
        self._order[chunk] = None
        self._order.move_to_end(chunk)

    def on_hit(self, chunk: ChunkId) -> None:
        if chunk in self._order:
            self._order.move_to_end(chunk)

    def on_hits(self, chunks: Sequence[ChunkId]) -> None:
        move = self._order.move_to_end
        for chunk in chunks:
            move(chunk)

    def on_remove(self, chunk: ChunkId) -> None:
        self._order.pop(chunk, None)

    def evict(
        self, evictable: Callable[[ChunkId], bool], incoming: ChunkId | None = None
    ) -> ChunkId | None:
        for chunk in self._order:
            if evictable(chunk):
                del self._order[chunk]
                return chunk
        return None

    def __len__(self) -> int:
        return len(self._order)
