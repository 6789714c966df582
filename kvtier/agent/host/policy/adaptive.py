"""Eviction that follows the traffic: LRU or ARC over one pool, whichever would hit more on
the traffic of now, chosen by two shadow caches.

One structure holds both candidates: ARC's lists (T1 chunks seen once recently, T2 twice or
more, the ghost lists B1 and B2 of chunks evicted from each) with the time of each resident
chunk's last use. ARC's victim is its own (the least recent leaf of the list REPLACE
picks); LRU's is the least recent leaf of T1 and T2 together, the older of the two lists'
oldest leaves, since each list is in order of last use. Both orders are of the chunks
actually resident, so either can take over at once; a chunk evicted by LRU's choice joins
ARC's ghost list as if ARC had evicted it, so ARC keeps learning under either leader. Both
evict leaves of the prefix tree first (a cached prefix has no holes).

Which one evicts is decided by shadows: an LRU and an ARC at `rate` times the pool's size,
fed only the chunks whose key hashes below `rate` (a scaled-down copy of the traffic, as
SHARDS samples miss-ratio curves; the hash is scrambled first, so the slice is a random one
whatever the ids). A shadow counts a request's sampled hits up to its first sampled miss.
The decision is a sign test on the accesses where the two shadows disagree (one hit, the
other missed), both counts decaying over `DECAY_POOLS` shadow pools' worth of sampled
accesses: the leader changes only when the other is ahead by `Z` standard deviations of
that difference and by `LEAD` of the hits, so noise between near-equal candidates does not
flip it. Until the shadows have seen `WARM_POOLS` pools' worth of accesses the leader is
ARC (ahead of LRU on most of the suite, and its protected list is what a late switch to it
would lack). Tuned on seed 1 of the trace suite (`python -m kvtier.bench.eviction`), see
docs/replay.md.

What it costs: ARC's state (the index keeps a key per slot for a policy of keys, and ARC
ghosts), one more integer per resident chunk, and the shadows (a bounded number of chunks
whatever the pool). Its state and decisions (`leader`, `switches`, the shadows' hits and
the test statistic) are in `describe`.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from kvtier.agent.host.policy.base import ChunkId, EvictionPolicy

LRU, ARC = 0, 1
NAMES = ("lru", "arc")

SHADOW_CHUNKS = 1024  # the shadows' size for a pool larger than this
SHADOW_MIN = 64  # the smallest shadow a small pool gets (its whole traffic, then)
DECAY_POOLS = 12  # the test's memory, in shadow pools' worth of sampled accesses
WARM_POOLS = 2  # sampled accesses, in shadow pools, before the shadows may take over
START = ARC  # the leader until the shadows have warmed: ARC
Z = 2.0  # standard deviations of the disagreements the challenger must be ahead by
LEAD = 0.002  # and its share of the sampled accesses


class _Pool(EvictionPolicy):
    """ARC's lists, each resident chunk with the time of its last use, evicting as ARC
    (`arc.py`, whose rules this follows step for step) or as LRU."""

    name = "arc"

    def __init__(self, capacity: int, mode: int = ARC) -> None:
        super().__init__(capacity)
        self.mode = mode
        self.p = 0.0
        # Resident chunks by list, each with its last use; ghosts of each.
        self.t1: OrderedDict[ChunkId, int] = OrderedDict()
        self.t2: OrderedDict[ChunkId, int] = OrderedDict()
        self.b1: OrderedDict[ChunkId, None] = OrderedDict()
        self.b2: OrderedDict[ChunkId, None] = OrderedDict()
        self._adapted: set[ChunkId] = set()  # ghost hits adapted in `evict` already
        self._announced: OrderedDict[ChunkId, ChunkId] = OrderedDict()  # stores in flight
        self._parent: dict[ChunkId, ChunkId] = {}
        self._kids: dict[ChunkId, int] = {}
        self._tick = 0
        self.forced = 0

    def on_parents(self, pairs: Sequence[tuple[ChunkId, ChunkId | None]]) -> None:
        announced = self._announced
        for chunk, parent in pairs:
            if parent is not None:
                announced[chunk] = parent
                announced.move_to_end(chunk)
        while len(announced) > 2 * self.capacity:
            announced.popitem(last=False)

    def on_hit(self, chunk: ChunkId) -> None:
        self._tick += 1
        if chunk in self.t1:
            del self.t1[chunk]
            self.t2[chunk] = self._tick
        elif chunk in self.t2:
            self.t2.move_to_end(chunk)
            self.t2[chunk] = self._tick

    def on_hits(self, chunks: Sequence[ChunkId]) -> None:
        """Leaf first, so each parent ends more recent than its children."""
        t1, t2 = self.t1, self.t2
        tick = self._tick
        for chunk in reversed(chunks):
            tick += 1
            if chunk in t1:
                del t1[chunk]
                t2[chunk] = tick
            elif chunk in t2:
                t2.move_to_end(chunk)
                t2[chunk] = tick
        self._tick = tick

    def on_insert(self, chunk: ChunkId) -> None:
        self.on_inserts((chunk,))

    def on_inserts(self, chunks: Sequence[ChunkId]) -> None:
        """Deepest first, so each parent ends more recent than its children; a chunk whose
        parent comes in the same store is linked to it."""
        t1, t2, b1, b2 = self.t1, self.t2, self.b1, self.b2
        announced, parent_of, kids = self._announced, self._parent, self._kids
        c = self.capacity
        batch = set(chunks) if len(chunks) > 1 else None
        tick = self._tick
        for chunk in reversed(chunks):
            if chunk in t1 or chunk in t2:
                continue
            tick += 1
            parent = announced.pop(chunk, None)
            if parent is not None:
                held = t1 if parent in t1 else t2 if parent in t2 else None
                if held is not None or (batch is not None and parent in batch):
                    parent_of[chunk] = parent
                    kids[parent] = kids.get(parent, 0) + 1
                if held is not None:
                    held.move_to_end(parent)
                    held[parent] = tick
            if chunk in b1 or chunk in b2:
                if chunk in self._adapted:
                    self._adapted.discard(chunk)
                else:
                    self._adapt(chunk)
                b1.pop(chunk, None)
                b2.pop(chunk, None)
                t2[chunk] = tick
            else:
                t1[chunk] = tick
            while b1 and len(t1) + len(b1) > c:
                self._adapted.discard(b1.popitem(last=False)[0])
            while b2 and len(t1) + len(t2) + len(b1) + len(b2) > 2 * c:
                self._adapted.discard(b2.popitem(last=False)[0])
        self._tick = tick

    def _adapt(self, chunk: ChunkId) -> None:
        if chunk in self.b1:
            self.p = min(float(self.capacity), self.p + max(len(self.b2) / len(self.b1), 1.0))
        elif chunk in self.b2:
            self.p = max(0.0, self.p - max(len(self.b1) / len(self.b2), 1.0))

    def on_remove(self, chunk: ChunkId) -> None:
        if chunk in self.t1 or chunk in self.t2:
            self.t1.pop(chunk, None)
            self.t2.pop(chunk, None)
            self._leave(chunk)

    def _leave(self, chunk: ChunkId) -> None:
        parent = self._parent.pop(chunk, None)
        if parent is not None:
            left = self._kids[parent] - 1
            if left:
                self._kids[parent] = left
            else:
                del self._kids[parent]
        if self._kids.pop(chunk, None):  # forced out: its children are roots now
            for child in [k for k, p in self._parent.items() if p == chunk]:
                del self._parent[child]

    def evict(
        self, evictable: Callable[[ChunkId], bool], incoming: ChunkId | None = None
    ) -> ChunkId | None:
        t1, t2, kids = self.t1, self.t2, self._kids
        if self.mode == ARC:
            returning = incoming is not None and (incoming in self.b1 or incoming in self.b2)
            if returning and incoming not in self._adapted:
                self._adapt(incoming)
                self._adapted.add(incoming)
            prefer_t1 = bool(t1) and (
                len(t1) > self.p or (incoming in self.b2 and len(t1) == self.p)
            )
            order = ((t1, self.b1), (t2, self.b2))
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
        # LRU: the least recent leaf of both lists, walking them merged by last use.
        for leaves in (True, False):
            ones, twos = iter(t1.items()), iter(t2.items())
            one, two = next(ones, None), next(twos, None)
            while one is not None or two is not None:
                if two is None or (one is not None and one[1] <= two[1]):
                    assert one is not None
                    chunk, first = one[0], True
                    one = next(ones, None)
                else:
                    chunk, first = two[0], False
                    two = next(twos, None)
                if (not leaves or chunk not in kids) and evictable(chunk):
                    if first:
                        del t1[chunk]
                        self.b1[chunk] = None
                    else:
                        del t2[chunk]
                        self.b2[chunk] = None
                    self.forced += not leaves
                    self._leave(chunk)
                    return chunk
        return None

    def __contains__(self, chunk: object) -> bool:
        return chunk in self.t1 or chunk in self.t2

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)


class _Shadow:
    def __init__(self, pool: _Pool) -> None:
        self.pool = pool
        self.hits = 0.0

    def access(self, chunk: ChunkId, parent: ChunkId | None) -> bool:
        """One sampled access; whether it hit."""
        pool = self.pool
        if chunk in pool:
            pool.on_hit(chunk)
            return True
        if parent is not None:
            pool.on_parents(((chunk, parent),))
        if len(pool) >= pool.capacity and pool.evict(_always, chunk) is None:
            return False
        pool.on_insert(chunk)
        return False


def _always(_chunk: ChunkId) -> bool:
    return True


class AdaptivePolicy(EvictionPolicy):
    name = "adaptive"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.pool = _Pool(capacity, START)
        self.rate = min(1.0, SHADOW_CHUNKS / max(capacity, 1))
        small = max(min(SHADOW_MIN, capacity), round(capacity * self.rate))
        self.shadows = [_Shadow(_Pool(small, LRU)), _Shadow(_Pool(small, ARC))]
        self._threshold = int(self.rate * (1 << 32))
        self._decay = 1.0 - 1.0 / (DECAY_POOLS * small)
        self._warm = WARM_POOLS * small
        self.sampled = 0
        self.leader = START
        self.switches = 0
        self.ahead = 0.0  # decayed (ARC's hits - LRU's) where they disagree
        self.disagree = 0.0  # decayed count of those accesses
        self.weight = 0.0  # decayed count of every sampled access
        self._last: ChunkId | None = None  # the request's last sampled chunk
        self._alive = [True, True]

    def _fresh(self) -> None:
        self._last = None
        self._alive = [True, True]

    def _observe(self, chunks: Sequence[ChunkId]) -> None:
        threshold, decay = self._threshold, self._decay
        lru, arc = self.shadows
        alive = self._alive
        changed = False
        for chunk in chunks:
            if ((hash(chunk) * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF) >> 32 >= threshold:
                continue
            parent = self._last
            hit_lru = lru.access(chunk, parent) and alive[LRU]
            hit_arc = arc.access(chunk, parent) and alive[ARC]
            alive[LRU], alive[ARC] = hit_lru, hit_arc
            self._last = chunk
            self.sampled += 1
            self.weight = self.weight * decay + 1.0
            self.ahead *= decay
            self.disagree *= decay
            if hit_lru != hit_arc:
                self.ahead += 1.0 if hit_arc else -1.0
                self.disagree += 1.0
                changed = True
            lru.hits += hit_lru
            arc.hits += hit_arc
        if changed and self.sampled >= self._warm:
            self._decide()

    def _decide(self) -> None:
        lead = self.ahead if self.leader == LRU else -self.ahead
        if lead > Z * math.sqrt(self.disagree) and lead > LEAD * self.weight:
            self.leader = ARC - self.leader
            self.pool.mode = self.leader
            self.switches += 1

    # --- what the index tells it ---------------------------------------------------------

    def on_parents(self, pairs: Sequence[tuple[ChunkId, ChunkId | None]]) -> None:
        self.pool.on_parents(pairs)
        if pairs and pairs[0][1] is None:
            # A store from the root: a new request's chain with no hit before it (a request
            # with hits starts afresh in `on_hits`), so both shadows' prefixes are alive.
            self._fresh()

    def on_insert(self, chunk: ChunkId) -> None:
        self.on_inserts((chunk,))

    def on_inserts(self, chunks: Sequence[ChunkId]) -> None:
        self.pool.on_inserts(chunks)
        self._observe(chunks)

    def on_hit(self, chunk: ChunkId) -> None:
        self.on_hits((chunk,))

    def on_hits(self, chunks: Sequence[ChunkId]) -> None:
        self.pool.on_hits(chunks)
        self._fresh()
        self._observe(chunks)

    def on_remove(self, chunk: ChunkId) -> None:
        self.pool.on_remove(chunk)

    def evict(
        self, evictable: Callable[[ChunkId], bool], incoming: ChunkId | None = None
    ) -> ChunkId | None:
        return self.pool.evict(evictable, incoming)

    def __len__(self) -> int:
        return len(self.pool)

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "tree": True,
            "leader": NAMES[self.leader],
            "switches": self.switches,
            "sample_rate": self.rate,
            "p": self.pool.p,
            "ahead": self.ahead,
            "disagree": self.disagree,
            "hits": {n: s.hits for n, s in zip(NAMES, self.shadows, strict=True)},
        }
