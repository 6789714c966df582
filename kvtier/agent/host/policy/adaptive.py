"""Eviction that follows the traffic: candidate policies run side by side on the pool, and
the one that would hit most on the traffic of now chooses the victims.

Each candidate (`lru`, `prefix` and `arc`, all leaves of the prefix tree first) has a
member told every store, hit and eviction, so each always orders the chunks actually
resident and any of them can take over at once (where the pool follows its leader's
shadow, below, all but `arc`'s). Which one evicts is decided by shadow caches: for each
candidate, a copy of it at `rate` times the pool's size, fed only the chunks whose key
hashes below `rate` (a scaled-down copy of the traffic, as SHARDS samples miss-ratio
curves; `rate` is 1 for pools of up to 4,096 chunks and 4,096 chunks' worth above; the key's
hash is scrambled first, so the slice is a random one whatever the ids). A request is a
lookup's hits and the store after it, its chunks hung from their parents (among the hits,
or the root); each shadow takes the request's sampled chunks as the index would tell its
policy and counts the hits it would have had, up to its first miss, with a decay of about
twelve shadow pools' worth of accesses. Told the same calls in the same order, a full-size
shadow is its policy alone on the same traffic: exactly so in a replay; in the agent, where
lookups' hits reach the policy in batches and a client stores in rounds, the requests are
rebuilt only roughly.

The leader changes only when another shadow is ahead by more than `NOISE` times the noise
between the two: the decayed sum of the squared differences of their hits per request,
square-rooted (a paired test; both shadows see the same requests, so most of their noise is
shared). Candidates within noise of each other would otherwise trade the lead back and
forth, and each change hands a pool shaped by one policy to another, a cost no shadow sees.
Where the shadows are the pool's size (`rate` 1, 8 chunks or more) the pool also takes the
leader's shape: a chunk the leader's shadow has evicted goes first, so after a change the
pool converges on the leader's own contents and then evicts as it does. A member then
chooses only when none of those may go (under an `arc` lead, the `lru` member), and
`prefix`'s turns stores away by its own state. `arc` leads first:
it was the best of the three at most budgets of the trace suite
(`python -m kvtier.bench.eviction`).

What it costs: every member's state for every resident chunk, plus the shadows (a few
thousand entries whatever the pool), and each access reaches every member and shadow. Its
state and decisions (`leader`, `switches`, each shadow's score, the chunks still to
converge) are in `describe`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from kvtier.agent.host.policy.arc import ARCPolicy
from kvtier.agent.host.policy.base import ChunkId, EvictionPolicy
from kvtier.agent.host.policy.prefix import PrefixPolicy

SHADOW_CHUNKS = 4096
DECAY_POOLS = 12
NOISE = 0.25  # how many of the noise's deviations a new leader must be ahead by
_FIB = 0x9E3779B97F4A7C15
_MASK = (1 << 64) - 1


class KeyedLRUPolicy(ARCPolicy):
    """`lru` by key, for running beside policies of keys: ARC's tree bookkeeping with
    every chunk in T1 and no ghosts, which is the least recently used leaf first."""

    name = "lru"

    def on_hit(self, chunk: ChunkId) -> None:
        self.on_hits((chunk,))

    def on_hits(self, chunks: Sequence[ChunkId]) -> None:
        t1 = self.t1
        for chunk in reversed(chunks):
            if chunk in t1:
                t1.move_to_end(chunk)

    def on_insert(self, chunk: ChunkId) -> None:
        t1 = self.t1
        if chunk in t1:
            return
        parent = self._announced.pop(chunk, None)
        if parent is not None:
            self._link(chunk, parent, t1 if parent in t1 else None)
        t1[chunk] = None

    def on_evicted(self, chunk: ChunkId) -> None:
        if chunk in self.t1:  # every chunk is in T1 (ARC's on_remove would try T2 too)
            del self.t1[chunk]
            self._leave(chunk)

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
        self.hits = 0  # in the last request
        self.evicted: list[ChunkId] = []  # since the owner last cleared it

    def request(self, path: Sequence[ChunkId], fade: float) -> None:
        """A request's sampled chunks in order, told to the policy as the index tells the
        pool's: the held ones as one batch of hits, the rest (all after the first miss) as
        one store, each chunk with the one before it as its parent and an eviction for
        each, the hit prefix and the store's own chunks never evicted. It hits up to its
        first miss; the score is of hits decaying by `fade` a request."""
        policy, resident = self.policy, self.resident
        hits, n = 0, len(path)
        while hits < n and path[hits] in resident:
            hits += 1
        self.hits, self.score = hits, self.score * fade + hits
        if hits == n:
            policy.on_hits(path)
            return
        held = list(path[:hits])  # and any held beyond the first miss
        pairs: list[tuple[ChunkId, ChunkId | None]] = []  # the rest, after their parents
        before = path[hits - 1] if hits else None
        for chunk in path[hits:]:
            if chunk in resident:
                held.append(chunk)
            else:
                pairs.append((chunk, before))
            before = chunk
        if held:
            policy.on_hits(held)
        policy.on_parents(pairs)
        pinned = set(path[:hits])
        evict, capacity, stored, evicted = policy.evict, policy.capacity, [], self.evicted

        def evictable(c: ChunkId) -> bool:
            return c not in pinned

        for chunk, _ in pairs:
            if len(resident) >= capacity:
                victim = evict(evictable, chunk)
                if victim is None:
                    continue
                resident.discard(victim)
                evicted.append(victim)
            resident.add(chunk)
            pinned.add(chunk)
            stored.append(chunk)
        if stored:
            policy.on_inserts(stored)


class AdaptivePolicy(EvictionPolicy):
    name = "adaptive"

    def __init__(
        self,
        capacity: int,
        candidates: Sequence[str] = ("lru", "prefix", "arc"),
        follow: bool = True,
    ) -> None:
        """`follow`: whether the pool takes the shape of the leader's shadow where the
        shadows are full size (off only to measure what it brings)."""
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
        self.leader = self.names.index("arc") if "arc" in self.names else 0
        self.switches = 0
        self._hits: list[ChunkId] = []  # the last lookup's hits, not yet told the shadows
        # Stored chunks the shadows were told of, oldest first (an OrderedDict: a dict's
        # iterator walks past every deleted entry, so trimming its front grows quadratic).
        self._told: OrderedDict[ChunkId, None] = OrderedDict()
        n = len(self.shadows)
        self._pairs = [(j, k) for j in range(n) for k in range(j + 1, n)]
        self._spread = [[0.0] * n for _ in range(n)]  # decayed squared hit differences
        # Where the shadows are the pool's size and there is a leader to change: the
        # resident chunks the leader's shadow does not hold, evicted first, in the order
        # they were found so (one with children in the pool is left to the leader's order).
        # The `lru` member knows the pool's chunks and its tree.
        following = follow and small == capacity and n > 1 and "lru" in self.names
        lru = self.members[self.names.index("lru")] if following else None
        self._lru = lru if isinstance(lru, KeyedLRUPolicy) else None
        if self._lru is not None:
            # The `arc` member would choose only what the stale chunks leave: a sixth of
            # the work per access, for no hits over the trace suite (docs/replay.md).
            self.members = [m for m in self.members if m.name != "arc"]
        self._by_name = {m.name: m for m in self.members}
        self._stale: OrderedDict[ChunkId, None] = OrderedDict()  # (trimmed at its front)

    def _tell(self, path: Sequence[ChunkId]) -> None:
        """A request's chunks in order to every shadow, then whether the lead changes."""
        if self.rate < 1.0:
            # Fibonacci hashing: Python hashes small ints to themselves, and a slice of the
            # key space must be a random one whatever the ids look like.
            below = self._threshold
            path = [c for c in path if ((hash(c) * _FIB) & _MASK) >> 32 < below]
        if not path:
            return
        shadows, fade = self.shadows, self._decay ** len(path)
        for shadow in shadows:
            shadow.request(path, fade)
        spread = self._spread
        for j, k in self._pairs:
            d = shadows[j].hits - shadows[k].hits
            spread[j][k] = spread[k][j] = spread[j][k] * fade + d * d
        if self._lru is not None:
            self._track(self._lru, shadows[self.leader], path)
        for shadow in shadows:
            shadow.evicted.clear()
        lead = self.leader
        best = max(range(len(shadows)), key=lambda i: shadows[i].score)
        ahead = shadows[best].score - shadows[lead].score
        if best != lead and ahead > NOISE * spread[best][lead] ** 0.5:
            self.leader = best
            self.switches += 1
            if self._lru is not None:
                held = shadows[best].resident
                self._stale = OrderedDict.fromkeys(c for c in self._lru.t1 if c not in held)

    def _flush(self) -> None:
        """A lookup's hits no store followed: a request that hit whole."""
        if self._hits:
            hits, self._hits = self._hits, []
            self._tell(hits)

    def _track(self, lru: KeyedLRUPolicy, lead: _Shadow, chunks: Sequence[ChunkId]) -> None:
        """What the leader's shadow just evicted, of the pool's chunks, is stale; what it
        just took in is not."""
        held, stale, resident = lru.t1, self._stale, lead.resident
        for victim in lead.evicted:
            if victim in held:
                stale[victim] = None
        for chunk in chunks:
            if chunk in resident:
                stale.pop(chunk, None)

    # --- what the index tells it ---------------------------------------------------------

    def on_parents(self, pairs: Sequence[tuple[ChunkId, ChunkId | None]]) -> None:
        """A store about to follow the last lookup: its chunks hang from their parents
        among the lookup's hits or from the root, which gives the request's path, and the
        shadows see the whole request now, before the pool evicts for it. A chunk whose
        parent is neither comes last."""
        for member in self.members:
            member.on_parents(pairs)
        if not pairs:
            return
        below = {p: c for c, p in pairs}  # parent -> the stored chunk after it
        if not any(chunk in below for chunk in self._hits):
            self._flush()  # the hits were a request of their own
        hits, self._hits = self._hits, []
        path: list[ChunkId] = []
        for chunk in (None, *hits):
            if chunk is not None:
                path.append(chunk)
            while chunk in below:
                chunk = below.pop(chunk)
                path.append(chunk)
        placed = set(path)
        path.extend(c for c, _ in pairs if c not in placed)  # hung from neither
        told = self._told
        while len(told) > 2 * self.capacity:  # stores never committed, chunks refused
            told.popitem(last=False)
        for chunk, _ in pairs:  # this store's whole, and newest, however long
            told.pop(chunk, None)
            told[chunk] = None
        self._tell(path)

    def on_insert(self, chunk: ChunkId) -> None:
        self.on_inserts((chunk,))

    def on_inserts(self, chunks: Sequence[ChunkId]) -> None:
        for member in self.members:
            member.on_inserts(chunks)
        told = self._told
        untold = [c for c in chunks if told.pop(c, 0) is not None]
        if untold:  # a store that named no parents
            self._flush()
            self._tell(untold)
        if self._lru is not None:
            stale, lead = self._stale, self.shadows[self.leader].resident
            for chunk in reversed(chunks):  # the deepest first, as a shadow evicts
                if chunk not in lead:
                    stale[chunk] = None

    def on_hit(self, chunk: ChunkId) -> None:
        self.on_hits((chunk,))

    def on_hits(self, chunks: Sequence[ChunkId]) -> None:
        for member in self.members:
            member.on_hits(chunks)
        self._flush()
        self._hits = list(chunks)

    def on_remove(self, chunk: ChunkId) -> None:
        for member in self.members:
            member.on_remove(chunk)
        self._stale.pop(chunk, None)

    def evict(
        self, evictable: Callable[[ChunkId], bool], incoming: ChunkId | None = None
    ) -> ChunkId | None:
        lru, stale = self._lru, self._stale
        if lru is not None:
            inner = []  # with children in the pool: left to the leader's order
            kids = lru._kids
            for chunk in stale:
                if chunk in kids:
                    inner.append(chunk)
                elif evictable(chunk):
                    break
            else:
                chunk = None
            for held in inner:
                del stale[held]
            if chunk is not None:
                del stale[chunk]
                for member in self.members:
                    member.on_evicted(chunk)
                return chunk
        chooser = self._chooser()
        victim = chooser.evict(evictable, incoming)
        if victim is not None:
            stale.pop(victim, None)
            for member in self.members:
                if member is not chooser:
                    member.on_evicted(victim)
        return victim

    def _chooser(self) -> EvictionPolicy:
        """The member that evicts: the leader's, or `lru` where the leader has none."""
        chooser = self._by_name.get(self.names[self.leader], self._lru)
        assert chooser is not None  # every candidate has a member unless following
        return chooser

    def __len__(self) -> int:
        return len(self._chooser())

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "tree": True,
            "leader": self.names[self.leader],
            "switches": self.switches,
            "sample_rate": self.rate,
            "scores": {n: s.score for n, s in zip(self.names, self.shadows, strict=True)},
            "converging": len(self._stale),
        }
