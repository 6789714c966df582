"""Prefix-aware eviction: leaves of the prefix tree first, by reuse with aging.

vLLM looks a request's chunks up in order and stops at the first miss, so a chunk is worth
something only while its whole prefix is resident. A chained key does not reveal its parent;
stores that name each chunk's parent (`on_parents`, from the store request) let this policy
keep the prefix tree of resident chunks and evict only leaves: a prefix is never dropped
while a longer chain that needs it stays behind.

Among leaves it evicts the lowest priority, greedy-dual style (LFU with dynamic aging): a
chunk's priority is the cache age at its last use plus the number of uses it has had, and
the age rises to each victim's priority. Chunks reused by many requests (system prompts,
the heads of long conversations) outlive one-off prompts, and a chunk not used for a while
ages out however often it was used before. (On the Mooncake conversation trace a chunk used
once is used again in 26% of cases, one used six times in 88%. Weighing uses more, e.g.
squared, recovers more of that trace's hits at 32 and 128 GiB but keeps finished
conversations too long on a multi-turn chat trace, where it then falls below LRU.) Use
counts of evicted chunks are remembered for 16 times as many chunks as the pool holds, and
at least 65,536: a prompt often comes back only after the pool has turned over several
times, and its history is what tells it from a one-off.

Until a store names a parent, the policy is ARC: an older plug-in that sends no parents
gets exactly the `arc` policy. From the first parent on it keeps the tree (the chunks ARC
held are carried over, those ARC had seen twice counted as used twice); a chunk stored
without a parent is a root.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from kvtier.agent.policy.arc import ARCPolicy
from kvtier.agent.policy.base import ChunkId, EvictionPolicy

HISTORY_MIN = 65536


class PrefixPolicy(EvictionPolicy):
    name = "prefix"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.arc: ARCPolicy | None = ARCPolicy(capacity)  # None once parents are known
        self.age = 0.0
        self._priority: dict[ChunkId, float] = {}  # resident chunks
        self._uses: dict[ChunkId, int] = {}
        self._children: dict[ChunkId, int] = {}  # resident children, where any
        self._parent: dict[ChunkId, ChunkId] = {}  # resident chunks with a known parent
        self._announced: OrderedDict[ChunkId, ChunkId] = OrderedDict()  # stores not committed
        self._history: OrderedDict[ChunkId, int] = OrderedDict()  # uses of evicted chunks
        self._history_size = max(16 * capacity, HISTORY_MIN)
        self._heap: list[tuple[float, int, ChunkId]] = []
        self._seq = 0

    # --- what the index tells it ----------------------------------------------------------

    def on_parents(self, pairs: Sequence[tuple[ChunkId, ChunkId | None]]) -> None:
        for chunk, parent in pairs:
            if parent is None:
                continue
            if self.arc is not None:
                self._leave_arc()
            self._announced[chunk] = parent
            self._announced.move_to_end(chunk)
        while len(self._announced) > 2 * self.capacity:  # stores that were never committed
            self._announced.popitem(last=False)

    def on_insert(self, chunk: ChunkId) -> None:
        if self.arc is not None:
            self.arc.on_insert(chunk)
            return
        if chunk in self._priority:
            self.on_hit(chunk)
            return
        uses = self._history.pop(chunk, 0) + 1
        self._uses[chunk] = uses
        parent = self._announced.pop(chunk, None)
        if parent is not None and parent in self._priority:
            self._parent[chunk] = parent
            self._children[parent] = self._children.get(parent, 0) + 1
        self._set(chunk, self.age + uses)

    def on_hit(self, chunk: ChunkId) -> None:
        if self.arc is not None:
            self.arc.on_hit(chunk)
            return
        if chunk in self._priority:
            uses = self._uses[chunk] = self._uses[chunk] + 1
            self._set(chunk, self.age + uses)

    def on_remove(self, chunk: ChunkId) -> None:
        if self.arc is not None:
            self.arc.on_remove(chunk)
        elif chunk in self._priority:
            self._forget(chunk, remember=False)

    def evict(
        self, evictable: Callable[[ChunkId], bool], incoming: ChunkId | None = None
    ) -> ChunkId | None:
        if self.arc is not None:
            return self.arc.evict(evictable, incoming)
        victim = self._lowest_leaf(evictable)
        if victim is None:
            # Every leaf is pinned (a request longer than the pool): any unpinned chunk.
            unpinned = [c for c in self._priority if evictable(c)]
            if not unpinned:
                return None
            victim = min(unpinned, key=self._priority.__getitem__)
        self.age = max(self.age, self._priority[victim])
        self._forget(victim, remember=True)
        return victim

    def __len__(self) -> int:
        return len(self.arc) if self.arc is not None else len(self._priority)

    def describe(self) -> dict[str, Any]:
        if self.arc is not None:
            return {**self.arc.describe(), "policy": self.name, "tree": False}
        return {**super().describe(), "tree": True, "age": self.age, "leaves": self._leaves()}

    # --- internals -----------------------------------------------------------------------

    def _leaves(self) -> int:
        return sum(1 for c in self._priority if not self._children.get(c))

    def _set(self, chunk: ChunkId, priority: float) -> None:
        self._priority[chunk] = priority
        if not self._children.get(chunk):
            self._push(chunk)

    def _push(self, chunk: ChunkId) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (self._priority[chunk], self._seq, chunk))
        if len(self._heap) > 4 * len(self._priority) + 64:  # drop superseded entries
            self._heap = [
                item
                for item in self._heap
                if self._priority.get(item[2]) == item[0] and not self._children.get(item[2])
            ]
            heapq.heapify(self._heap)

    def _lowest_leaf(self, evictable: Callable[[ChunkId], bool]) -> ChunkId | None:
        pinned: list[tuple[float, int, ChunkId]] = []
        victim: ChunkId | None = None
        while self._heap:
            item = heapq.heappop(self._heap)
            chunk = item[2]
            if self._priority.get(chunk) != item[0] or self._children.get(chunk):
                continue  # superseded, gone, or no longer a leaf
            if not evictable(chunk):
                pinned.append(item)
                continue
            victim = chunk
            break
        for item in pinned:
            heapq.heappush(self._heap, item)
        return victim

    def _forget(self, chunk: ChunkId, remember: bool) -> None:
        del self._priority[chunk]
        uses = self._uses.pop(chunk)
        self._children.pop(chunk, None)
        parent = self._parent.pop(chunk, None)
        if parent is not None and parent in self._priority and parent in self._children:
            left = self._children[parent] - 1
            if left > 0:
                self._children[parent] = left
            else:
                del self._children[parent]
                self._push(parent)  # a leaf now
        if remember:
            self._history[chunk] = uses
            if len(self._history) > self._history_size:
                self._history.popitem(last=False)

    def _leave_arc(self) -> None:
        """Carry ARC's resident chunks over: seen once (T1) or at least twice (T2), in
        ARC's recency order."""
        arc, self.arc = self.arc, None
        assert arc is not None
        for uses, chunks in ((1, arc.t1), (2, arc.t2)):
            for chunk in chunks:
                self._uses[chunk] = uses
                self._set(chunk, float(uses))
