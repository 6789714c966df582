"""Prefix-aware eviction: leaves of the prefix tree first, the lowest hit density first, and
no admission for a chunk worth less than what it would displace.

vLLM looks a request's chunks up in order and stops at the first miss, so a chunk is worth
something only while its whole prefix is resident. A chained key does not reveal its parent;
stores that name each chunk's parent (`on_parents`, from the store request) let this policy
keep the prefix tree of resident chunks and evict only leaves: a prefix is never dropped
while a longer chain that needs it stays behind.

Which leaf: the one with the least hit density (Beckmann & Sanchez, "LHD", NSDI'18): the
probability that a chunk is used again, given its class and how long ago it was last used
(its age, on a log scale), divided by the time it is then expected to wait for that use. A
chunk's class is how often it has been used (1, 2, 3-4, 5 or more times) and its pace: the
gap between its last two uses (unknown, under 1,024 accesses, 4,096, 16,384, longer), or for
a new chunk its parent's, which is its conversation's (a chat whose turns came quickly
comes back sooner), unless the parent is a shared head (used five times or more: a system
prompt's pace is no conversation's). The densities are learnt from the traffic itself:
each access of a chunk that was seen before (resident, or remembered after eviction)
records the gap since its last access under the class it had, and each access counts a
chunk entering its new class; the table is rebuilt every 4,096 accesses from counts that
halve every 65,536, a class seen little drawn towards the density of all chunks (until the
first rebuild, more uses and less age are worth more). Eviction compares the oldest leaf of
each class by the density of its use count alone (ordering by pace as well did no better,
and fell just below LRU on a multi-turn chat trace with a large pool); 20 candidates,
O(log n) with one heap per class.

Why: on the Mooncake conversation trace (512-token blocks) a chunk used once is used again
in 24% of cases, a median 500 requests later; one used six times or more in 91%, most often
by the very next request. LRU keeps whatever came last, and at 8 to 128 GiB that is a few
seconds of one-off prompt tails; this policy keeps the hot heads and the chunks of
conversations that came back. What it cannot know is which new chunk will be used again
(nothing seen online tells them apart: 24 to 26% whatever the request's length, the
chunk's position or the gap since the conversation's previous turn), which is where
Belady's bound gets most of its lead (see docs/replay.md).

Admission: when the pool is full, a chunk is not stored if its density as a new member of
its class is below that of the chunk it would evict; nor is any chunk whose parent was
just refused (it could never be reached). A chunk refused once and asked for again comes back a
class higher. Admission starts once the policy has seen four pools' worth of accesses, so
the densities it compares are learnt ones.

Use counts and last-access times of evicted chunks are remembered for 16 times as many
chunks as the pool holds, and at least 65,536: a prompt often comes back only after the
pool has turned over several times, and its history is what tells it from a one-off. They
are kept by the chunk's hash, not its name: two chunks of one hash (one in 2^64 per pair)
share a history, which can only misjudge a class, never what a chunk holds.

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

from kvtier.agent.host.policy.arc import ARCPolicy
from kvtier.agent.host.policy.base import ChunkId, EvictionPolicy

HISTORY_MIN = 65536
USES = (0, 0, 1, 2, 2, 3, 3, 3, 3)  # use-count bucket by min(uses, 8): 1, 2, 3-4, 5+
PACES = 5  # gap between the last two uses: unknown, under 2^10, 2^12, 2^14 accesses, longer
CLASSES = 4 * PACES
AGES = 64  # age buckets: bit length of the age in accesses
REFRESH = 4096  # accesses between rebuilds of the density table
HALVE = 65536  # accesses between halvings of the counts
WARM_POOLS = 4  # pools' worth of accesses before admission control starts
REFUSED_MAX = 4096
SMOOTHING = 256.0
HEAD_USES = 5  # a parent used this often is a shared head: its pace is no conversation's

_Entry = tuple[int, int, ChunkId]  # (last access, sequence, chunk)
_State = tuple[int, int, int, int]  # (last access, uses, class, pace)
_Key = tuple[float, int, int, ChunkId]  # (density, last access, class, chunk)


def _pace(gap: int) -> int:
    return 1 if gap < 1 << 10 else 2 if gap < 1 << 12 else 3 if gap < 1 << 14 else 4


def _class(uses: int, pace: int) -> int:
    return USES[min(uses, 8)] * PACES + pace


class PrefixPolicy(EvictionPolicy):
    name = "prefix"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.arc: ARCPolicy | None = ARCPolicy(capacity)  # None once parents are known
        self.now = 0  # accesses so far: the clock ages are measured on
        self._state: dict[ChunkId, _State] = {}  # resident chunks
        self._children: dict[ChunkId, int] = {}  # resident children, where any
        self._parent: dict[ChunkId, ChunkId] = {}  # resident chunks with a known parent
        self._announced: OrderedDict[ChunkId, ChunkId] = OrderedDict()  # stores not committed
        # Evicted chunks by hash: a chunk's name (a namespace and a key) is not kept alive
        # for it, which made history most of the policy's memory (16 entries per slot).
        self._history: OrderedDict[int, _State] = OrderedDict()
        self._history_size = max(16 * capacity, HISTORY_MIN)
        self._refused: OrderedDict[ChunkId, None] = OrderedDict()
        self._heaps: list[list[_Entry]] = [[] for _ in range(CLASSES)]  # oldest on top
        self._seq = 0
        # What the densities are learnt from, per class: accesses that entered it, and reuse
        # gaps by age bucket.
        self._entered = [0.0] * CLASSES
        self._gaps = [[0.0] * AGES for _ in range(CLASSES)]
        # Until the first rebuild, a prior: more uses and less age are worth more.
        self._density = [[(c // PACES + 1) / (1 << b) for b in range(AGES)] for c in range(CLASSES)]
        self._coarse = [[(u + 1) / (1 << b) for b in range(AGES)] for u in range(CLASSES // PACES)]
        self._order = [self._coarse[c // PACES] for c in range(CLASSES)]  # eviction's rows
        # Each class's eviction key, its heap's valid top as (density, last access, class,
        # chunk), None where the heap is empty; a class whose heap may have changed is
        # dirty, and an eviction re-keys only those and the ones whose top's age bucket
        # (hence density) has moved on since: `_until`, each key's end, `_soonest` the
        # least of them or less.
        self._key: list[_Key | None] = [None] * CLASSES
        self._until = [0] * CLASSES
        self._soonest = 0
        self._dirty: set[int] = set(range(CLASSES))
        self._until_refresh = REFRESH
        self._until_halve = HALVE
        self._extended: set[ChunkId] = set()  # during a store: chunks a later one extends
        self.refused = 0

    # --- what the index tells it ----------------------------------------------------------

    def on_parents(self, pairs: Sequence[tuple[ChunkId, ChunkId | None]]) -> None:
        announced = self._announced
        for chunk, parent in pairs:
            if parent is None:
                continue
            if self.arc is not None:
                self._leave_arc()
            announced[chunk] = parent
            announced.move_to_end(chunk)
        while len(announced) > 2 * self.capacity:  # stores that were never committed
            announced.popitem(last=False)

    def on_insert(self, chunk: ChunkId) -> None:
        if self.arc is not None:
            self.arc.on_insert(chunk)
            return
        if chunk in self._state:
            self.on_hit(chunk)
            return
        self._refused.pop(chunk, None)
        parent = self._announced.pop(chunk, None)
        pace = 0
        if parent is not None:
            held = self._state.get(parent)
            if held is not None:
                self._parent[chunk] = parent
                self._children[parent] = self._children.get(parent, 0) + 1
                self._stale(held[2], parent)  # no longer a leaf
                pace = held[3] if held[1] < HEAD_USES else 0  # its conversation's pace
        self._access(chunk, self._history.pop(hash(chunk), None), pace)

    def on_inserts(self, chunks: Sequence[ChunkId]) -> None:
        """In order. A chunk that a later chunk of the same store extends is no leaf by the
        time anything evicts, so it gets no heap entry (a chain's store would leave all but
        its last entry superseded)."""
        if self.arc is not None:
            self.arc.on_inserts(chunks)
            return
        state, announced = self._state, self._announced
        seen: set[ChunkId] = set()
        extended = self._extended
        for chunk in chunks:
            if chunk not in state and chunk not in seen:
                parent = announced.get(chunk)
                if parent in seen:  # resident by then, so linked: no longer a leaf
                    extended.add(parent)
            seen.add(chunk)
        try:
            for chunk in chunks:
                self.on_insert(chunk)
        finally:
            extended.clear()

    def on_hit(self, chunk: ChunkId) -> None:
        if self.arc is not None:
            self.arc.on_hit(chunk)
            return
        held = self._state.get(chunk)
        if held is not None:
            self._access(chunk, held, 0)

    def on_hits(self, chunks: Sequence[ChunkId]) -> None:
        if self.arc is not None:
            self.arc.on_hits(chunks)
            return
        state, access = self._state, self._access
        for chunk in chunks:
            held = state.get(chunk)
            if held is not None:
                access(chunk, held, 0)

    def on_remove(self, chunk: ChunkId) -> None:
        if self.arc is not None:
            self.arc.on_remove(chunk)
        elif chunk in self._state:
            self._forget(chunk, remember=False)

    def on_evicted(self, chunk: ChunkId) -> None:
        """Another policy chose `chunk` for eviction: forgotten as resident, remembered."""
        if self.arc is not None:
            self.arc.on_evicted(chunk)
        elif chunk in self._state:
            self._forget(chunk, remember=True)

    def evict(
        self, evictable: Callable[[ChunkId], bool], incoming: ChunkId | None = None
    ) -> ChunkId | None:
        if self.arc is not None:
            return self.arc.evict(evictable, incoming)
        admitting = incoming is not None and self.now >= WARM_POOLS * self.capacity
        if admitting and self._announced.get(incoming) in self._refused:
            self._refuse(incoming)
            return None
        found = self._lowest_leaf(evictable)
        if found is None:
            # Every leaf is pinned (a request longer than the pool): any unpinned chunk.
            unpinned = [c for c in self._state if evictable(c)]
            if not unpinned:
                return None
            victim = min(unpinned, key=self._density_of)
        else:
            victim = found[0]
            if admitting:
                # the incoming chunk as a new member of its class (age 0) against its victim
                cls = self._incoming_class(incoming, self._history.get(hash(incoming)))
                if self._density[cls][0] < self._density_of(victim):
                    self._refuse(incoming, cls)
                    return None
        self._forget(victim, remember=True)  # its heap entry is superseded now
        return victim

    def __len__(self) -> int:
        return len(self.arc) if self.arc is not None else len(self._state)

    def describe(self) -> dict[str, Any]:
        if self.arc is not None:
            return {**self.arc.describe(), "policy": self.name, "tree": False}
        return {
            **super().describe(),
            "tree": True,
            "leaves": sum(1 for c in self._state if not self._children.get(c)),
            "refused": self.refused,
        }

    # --- internals -----------------------------------------------------------------------

    def _incoming_class(self, incoming: ChunkId | None, before: _State | None) -> int:
        """The class `incoming` would enter as a new chunk; `before` is what history
        remembers of it."""
        if before is not None:
            return _class(before[1] + 1, _pace(self.now + 1 - before[0]) if before[0] >= 0 else 0)
        parent = self._state.get(self._announced.get(incoming))
        return _class(1, parent[3] if parent is not None and parent[1] < HEAD_USES else 0)

    def _access(self, chunk: ChunkId, before: _State | None, pace: int) -> None:
        """A use of `chunk`: `before` is what was known of it (None: never seen; `pace` is
        then its parent's)."""
        now = self.now = self.now + 1
        if before is None:
            uses = 1
        else:
            last, uses, cls, pace = before
            self._stale(cls, chunk)
            if last >= 0:
                gap = now - last
                self._gaps[cls][gap.bit_length()] += 1
                # _pace and _class inlined: this runs for every access
                pace = 1 if gap < 1 << 10 else 2 if gap < 1 << 12 else 3 if gap < 1 << 14 else 4
            uses += 1
        cls = USES[uses if uses < 8 else 8] * PACES + pace
        self._entered[cls] += 1
        self._state[chunk] = (now, uses, cls, pace)
        if not self._children.get(chunk) and chunk not in self._extended:
            self._push(cls, chunk, now)
        self._until_refresh -= 1
        if self._until_refresh <= 0:
            self._refresh()

    def _stale(self, cls: int, chunk: ChunkId) -> None:
        """`chunk` of class `cls` changed: its class is re-keyed if it was the key."""
        key = self._key[cls]
        if key is not None and key[3] == chunk:
            self._dirty.add(cls)

    def _push(self, cls: int, chunk: ChunkId, last: int) -> None:
        """A leaf's entry; its class is re-keyed if the entry goes before the key (a
        leaf's entry is pushed when it is used, the newest, or when it becomes one)."""
        self._seq += 1
        heapq.heappush(self._heaps[cls], (last, self._seq, chunk))
        key = self._key[cls]
        if key is None or last < key[1]:
            self._dirty.add(cls)
        if not self._seq % 1024 and sum(map(len, self._heaps)) > 3 * len(self._state) + 64:
            self._compact()

    def _compact(self) -> None:
        """Drop superseded heap entries (chunks used again, gone, or no longer leaves)."""
        heaps: list[list[_Entry]] = [[] for _ in range(CLASSES)]
        for chunk, (last, _, cls, _) in self._state.items():
            if not self._children.get(chunk):
                self._seq += 1
                heaps[cls].append((last, self._seq, chunk))
        for heap in heaps:
            heap.sort()
        self._heaps = heaps
        self._dirty.update(range(CLASSES))

    @staticmethod
    def _densities(gaps: list[float], entered: float, out: list[float]) -> None:
        """For a chunk at age bucket b: the chance it is used again (reuses at gaps from b
        on, over chunks that reached b unused) over the mean wait for that use."""
        before = sum(gaps)  # reuses at gaps below bucket b, as b goes down
        tail = weighted = 0.0  # reuses at gaps from b on; their summed use times
        for b in range(AGES - 1, -1, -1):
            low = (1 << (b - 1)) if b else 0
            before -= gaps[b]
            tail += gaps[b]
            weighted += gaps[b] * (1.5 * low if b else 0.5)
            wait = weighted - tail * low + tail  # from the bucket's start, at least 1
            survivors = max(entered - before, tail, 1.0)
            out[b] = tail * tail / (survivors * wait) if tail else 0.0

    def _refresh(self) -> None:
        """Rebuild the density tables: per class (each drawn towards the densities of all
        chunks by SMOOTHING chunks' worth of them, so a class seen little is ordered by
        age), and per use count, which eviction orders by."""
        self._until_refresh = REFRESH
        self._until_halve -= REFRESH
        self._dirty.update(range(CLASSES))  # every density may have changed
        halve = self._until_halve <= 0
        overall = [0.0] * AGES
        self._densities(
            [sum(g[b] for g in self._gaps) for b in range(AGES)], sum(self._entered), overall
        )
        for use in range(CLASSES // PACES):
            group = range(use * PACES, (use + 1) * PACES)
            self._densities(
                [sum(self._gaps[c][b] for c in group) for b in range(AGES)],
                sum(self._entered[c] for c in group),
                self._coarse[use],
            )
        for cls in range(CLASSES):
            gaps, density, entered = self._gaps[cls], self._density[cls], self._entered[cls]
            self._densities(gaps, entered, density)
            weight = entered / (entered + SMOOTHING)
            for b in range(AGES):
                density[b] = weight * density[b] + (1 - weight) * overall[b]
            if halve:
                self._entered[cls] /= 2
                for b in range(AGES):
                    gaps[b] /= 2
        if halve:
            self._until_halve = HALVE

    def _density_of(self, chunk: ChunkId) -> float:
        last, _, cls, _ = self._state[chunk]
        return self._density[cls][(self.now - last).bit_length()]

    def _lowest_leaf(self, evictable: Callable[[ChunkId], bool]) -> tuple[ChunkId, float] | None:
        """The evictable leaf of least density among each class's oldest, and its density
        (ties: the older, then the lower class). Only the winner is asked whether it may
        go; a pinned one is set aside and the classes compared again (pins sit on recent
        chunks, rarely on a class's oldest)."""
        keys, dirty, now = self._key, self._dirty, self.now
        if now >= self._soonest:
            until, soonest = self._until, now + (1 << 62)
            for cls in range(CLASSES):
                if keys[cls] is not None:
                    if until[cls] <= now:
                        dirty.add(cls)
                    elif until[cls] < soonest:
                        soonest = until[cls]
            self._soonest = soonest
        if dirty:
            for cls in dirty:
                self._rekey(cls)
            dirty.clear()
        pinned: list[tuple[int, _Entry]] = []
        found: tuple[ChunkId, float] | None = None
        while True:
            best = min(filter(None, keys), default=None)
            if best is None:
                break
            density, _, cls, chunk = best
            if evictable(chunk):
                found = (chunk, density)
                break
            pinned.append((cls, heapq.heappop(self._heaps[cls])))
            self._rekey(cls)
        for cls, item in pinned:
            heapq.heappush(self._heaps[cls], item)
            dirty.add(cls)
        return found

    def _rekey(self, cls: int) -> None:
        """Key `cls` by its heap's oldest valid leaf, dropping superseded entries on the way."""
        heap, state, children = self._heaps[cls], self._state, self._children
        while heap:
            last, _, chunk = heap[0]
            held = state.get(chunk)
            if held is None or held[0] != last or children.get(chunk):
                heapq.heappop(heap)  # superseded, gone, or no longer a leaf
                continue
            age = (self.now - last).bit_length()
            self._key[cls] = (self._order[cls][age], last, cls, chunk)
            until = self._until[cls] = last + (1 << age)
            if until < self._soonest:
                self._soonest = until
            return
        self._key[cls] = None

    def _refuse(self, incoming: ChunkId | None, cls: int | None = None) -> None:
        """Turn a store away (`cls`: its class as an incoming chunk, where known). It was
        an access all the same: counted, and remembered, so the chunk comes back a class
        higher if it is asked for again."""
        self.refused += 1
        refused = self._refused
        refused[incoming] = None
        if len(refused) > REFUSED_MAX:
            refused.popitem(last=False)
        history, name = self._history, hash(incoming)
        before = history.pop(name, None)
        if cls is None:
            cls = self._incoming_class(incoming, before)
        now = self.now = self.now + 1
        if before is None:
            uses, pace = 1, cls % PACES
        else:
            last, uses, was, _ = before
            gap = now - last
            self._gaps[was][gap.bit_length()] += 1
            uses, pace = uses + 1, _pace(gap)
        self._entered[cls] += 1
        history[name] = (now, uses, cls, pace)
        if len(history) > self._history_size:
            history.popitem(last=False)

    def _forget(self, chunk: ChunkId, remember: bool) -> None:
        held = self._state.pop(chunk)
        self._stale(held[2], chunk)
        children = self._children
        children.pop(chunk, None)
        parent = self._parent.pop(chunk, None)
        if parent is not None and parent in children:
            left = children[parent] - 1
            if left > 0:
                children[parent] = left
            else:
                del children[parent]
                last, _, cls, _ = self._state[parent]
                self._push(cls, parent, last)  # a leaf now
        if remember:
            history, name = self._history, hash(chunk)
            history.pop(name, None)
            history[name] = held  # the newest
            if len(history) > self._history_size:
                history.popitem(last=False)

    def _leave_arc(self) -> None:
        """Carry ARC's resident chunks over: seen once (T1) or at least twice (T2), in
        ARC's recency order."""
        arc, self.arc = self.arc, None
        assert arc is not None
        for uses, chunks in ((1, arc.t1), (2, arc.t2)):
            for chunk in chunks:
                self._access(chunk, None if uses == 1 else (-1, 1, 0, 0), 0)
