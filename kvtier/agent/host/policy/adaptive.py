"""Eviction that follows the traffic: candidate policies run side by side on the pool, and
the one that would hit most on the traffic of now chooses the victims.

Each candidate (`lru`, `prefix` and `arc`, all leaves of the prefix tree first) is told every
store, hit and eviction, so each always orders the chunks actually resident and any of
them can take over at once. Which one evicts is decided by shadow caches: for each
candidate, a copy of it at `rate` times the pool's size, fed only the chunks whose key
hashes below `rate` (a scaled-down copy of the traffic, as SHARDS samples miss-ratio
curves; `rate` is 1 for pools of up to 4,096 chunks and 4,096 chunks' worth above; the key's
hash is scrambled first, so the slice is a random one whatever the ids). A shadow counts the
hits it would have had, a request's hits up to its first sampled miss (a request without
hits starts afresh at its store from the root), with a decay of about twelve shadow pools'
worth of accesses; the leader changes when another shadow is ahead by 0.3%. The shadows'
chains are the sampled chunks of a request in order. Tuned on seed 1 of the trace suite
(`python -m kvtier.bench.eviction`): a margin of 2% kept the first leader where the others
were ahead by less; 1,024-chunk shadows were too noisy above 1,024 blocks; a decay over
four pools followed noise, over 32 too slowly.

What it costs: every candidate's state for every resident chunk, plus the shadows (a few
thousand entries whatever the pool), and each access reaches every candidate. Its state
and decisions (`leader`, `switches`, each shadow's score) are in `describe`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvtier.agent.host.policy.arc import ARCPolicy
from kvtier.agent.host.policy.base import ChunkId, EvictionPolicy
from kvtier.agent.host.policy.prefix import PrefixPolicy

SHADOW_CHUNKS = 4096
MARGIN = 1.003
DECAY_POOLS = 12
_FIB = 0x9E3779B97F4A7C15
_MASK = (1 << 64) - 1


class KeyedLRUPolicy(ARCPolicy):
    """`lru` by key, for running beside policies of keys: ARC's tree bookkeeping with
    every chunk in T1 and no ghosts, which is the least recently used leaf first."""

    name = "lru"

    def on_hit(self, chunk: ChunkId) -> None:
        if chunk in self.t1:
            self.t1.move_to_end(chunk)

    def on_insert(self, chunk: ChunkId) -> None:
        t1 = self.t1
        if chunk in t1:
            return
        parent = self._announced.pop(chunk, None)
        if parent is not None:
            self._link(chunk, parent, t1 if parent in t1 else None)
        t1[chunk] = None

    def on_evicted(self, chunk: ChunkId) -> None:
        self.on_remove(chunk)

    def evict(
        self, evictable: Callable[[ChunkId], bool], incoming: ChunkId | None = None
    ) -> ChunkId | None:
        t1, kids = self.t1, self._kids
        for leaves in (True, False):
            for chunk in t1:
                if (not leaves or chunk not in kids) and evictable(chunk):
                    del t1[chunk]
                    self.forced += not leaves
                    self._leave(chunk)
                    return chunk
        return None


class _Shadow:
    def __init__(self, policy: EvictionPolicy) -> None:
        self.policy = policy
        self.resident: set[ChunkId] = set()
        self.score = 0.0

    def accesses(
        self, chunks: Sequence[ChunkId], last: ChunkId | None, decay: float, alive: bool
    ) -> bool:
        """A request's sampled accesses in order, `last` the sampled chunk before them;
        hits count only while the request's sampled prefix is alive. Whether it still is.
        Shadows are independent of each other, so each takes a request's accesses at once."""
        policy, resident = self.policy, self.resident
        on_hit, on_parents, on_insert, evict = (
            policy.on_hit,
            policy.on_parents,
            policy.on_insert,
            policy.evict,
        )
        capacity, score = policy.capacity, self.score
        for chunk in chunks:
            score *= decay
            if chunk in resident:
                on_hit(chunk)
                if alive:
                    score += 1.0
            else:
                alive = False
                on_parents(((chunk, last),))
                if len(resident) >= capacity:
                    victim = evict(_always, chunk)
                    if victim is None:
                        last = chunk
                        continue
                    resident.discard(victim)
                resident.add(chunk)
                on_insert(chunk)
            last = chunk
        self.score = score
        return alive


def _always(_chunk: ChunkId) -> bool:
    return True


class AdaptivePolicy(EvictionPolicy):
    name = "adaptive"

    def __init__(self, capacity: int, candidates: Sequence[str] = ("lru", "prefix", "arc")) -> None:
        super().__init__(capacity)
        kinds: dict[str, type[EvictionPolicy]] = {
            "lru": KeyedLRUPolicy,
            "prefix": PrefixPolicy,
            "arc": ARCPolicy,
        }
        self.names = list(candidates)
        self.members = [kinds[n](capacity) for n in self.names]
        self.rate = min(1.0, SHADOW_CHUNKS / max(capacity, 1))
        small = max(8, round(capacity * self.rate))
        self.shadows = [_Shadow(kinds[n](small)) for n in self.names]
        self._threshold = int(self.rate * (1 << 32))
        self._decay = 1.0 - 1.0 / (DECAY_POOLS * small)
        self.leader = 0
        self.switches = 0
        self._last: ChunkId | None = None  # the request's last sampled chunk
        self._alive = [True] * len(self.shadows)

    def _observe(self, chunks: Sequence[ChunkId], fresh: bool) -> None:
        if fresh:
            self._last = None
            self._alive = [True] * len(self.shadows)
        if self.rate < 1.0:
            # Fibonacci hashing: Python hashes small ints to themselves, and a slice of the
            # key space must be a random one whatever the ids look like.
            below = self._threshold
            chunks = [c for c in chunks if ((hash(c) * _FIB) & _MASK) >> 32 < below]
        if chunks:
            last, decay, alive = self._last, self._decay, self._alive
            for i, shadow in enumerate(self.shadows):
                alive[i] = shadow.accesses(chunks, last, decay, alive[i])
            self._last = chunks[-1]
        best = max(range(len(self.shadows)), key=lambda i: self.shadows[i].score)
        if best != self.leader and (
            self.shadows[best].score > MARGIN * self.shadows[self.leader].score
        ):
            self.leader = best
            self.switches += 1

    # --- what the index tells it ---------------------------------------------------------

    def on_parents(self, pairs: Sequence[tuple[ChunkId, ChunkId | None]]) -> None:
        for member in self.members:
            member.on_parents(pairs)
        if pairs and pairs[0][1] is None:
            # A store from the root: a new request's chain, with no hit before it (a request
            # with hits starts afresh in `on_hits`), so every shadow's prefix is alive again.
            self._last = None
            self._alive = [True] * len(self.shadows)

    def on_insert(self, chunk: ChunkId) -> None:
        self.on_inserts((chunk,))

    def on_inserts(self, chunks: Sequence[ChunkId]) -> None:
        for member in self.members:
            member.on_inserts(chunks)
        self._observe(chunks, fresh=False)

    def on_hit(self, chunk: ChunkId) -> None:
        self.on_hits((chunk,))

    def on_hits(self, chunks: Sequence[ChunkId]) -> None:
        for member in self.members:
            member.on_hits(chunks)
        self._observe(chunks, fresh=True)

    def on_remove(self, chunk: ChunkId) -> None:
        for member in self.members:
            member.on_remove(chunk)

    def evict(
        self, evictable: Callable[[ChunkId], bool], incoming: ChunkId | None = None
    ) -> ChunkId | None:
        victim = self.members[self.leader].evict(evictable, incoming)
        if victim is not None:
            for i, member in enumerate(self.members):
                if i != self.leader:
                    member.on_evicted(victim)
        return victim

    def __len__(self) -> int:
        return len(self.members[self.leader])

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "tree": True,
            "leader": self.names[self.leader],
            "switches": self.switches,
            "sample_rate": self.rate,
            "scores": {n: s.score for n, s in zip(self.names, self.shadows, strict=True)},
        }
