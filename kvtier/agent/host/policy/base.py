"""The eviction-policy interface the host index drives.

A policy only orders resident chunks; the index decides what is resident and what may be
evicted (a chunk under a lease may not), so policies stay small and testable on their own.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Sequence
from typing import Any, ClassVar

import msgspec

from kvtier.api.stats import PolicyFigure, PolicyStats

ChunkId = Hashable


class EvictionPolicy(ABC):
    name: str
    # How the index names chunks to this policy: by pool slot (an int below `capacity`), for
    # a policy that keeps nothing of a chunk once it leaves, so a slot given to another
    # chunk names that chunk; or by (namespace, key), for one that remembers chunks after
    # they left (ghosts, history). A policy of slots is not told parents (`on_parents`): a
    # parent need not be in the pool.
    by_slot: ClassVar[bool] = False
    # A policy of slots that keeps the prefix tree: the index tells it each stored chunk's
    # parent as a slot (`on_links`), where the parent is in the pool.
    links_slots: ClassVar[bool] = False

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity

    @abstractmethod
    def on_insert(self, chunk: ChunkId) -> None:
        """A chunk became resident."""

    @abstractmethod
    def on_hit(self, chunk: ChunkId) -> None:
        """A resident chunk was asked for."""

    def on_inserts(self, chunks: Sequence[ChunkId]) -> None:
        """Several chunks became resident at once, in order (a committed store)."""
        for chunk in chunks:
            self.on_insert(chunk)

    def on_hits(self, chunks: Sequence[ChunkId]) -> None:
        """Several hits at once, in request order (a batched lookup)."""
        for chunk in chunks:
            self.on_hit(chunk)

    def on_parents(self, pairs: Sequence[tuple[ChunkId, ChunkId | None]]) -> None:
        """Chunks about to be stored, each with the chunk before it in its request where
        the store named it. Only policies that keep the prefix tree use it."""
        return None

    def on_links(self, chunks: Sequence[ChunkId], parents: Sequence[int]) -> None:
        """Slots a store is about to write, each with the slot of the chunk before it in its
        request (-1 where the store named none, or it is not in the pool). Only policies
        with `links_slots` are told; every granted slot is named, so a slot's link is always
        its current chunk's."""
        return None

    @abstractmethod
    def on_remove(self, chunk: ChunkId) -> None:
        """A resident chunk left for a reason of its own (corrupt, deleted), not eviction."""

    def on_evicted(self, chunk: ChunkId) -> None:
        """A resident chunk was evicted by another policy's choice (`adaptive` runs several
        over one pool): by default as if it left for a reason of its own."""
        self.on_remove(chunk)

    @abstractmethod
    def evict(
        self, evictable: Callable[[ChunkId], bool], incoming: ChunkId | None = None
    ) -> ChunkId | None:
        """Choose a resident chunk for which `evictable` holds, forget it as resident and
        return it; None when every resident chunk is pinned."""

    @abstractmethod
    def __len__(self) -> int:
        """Number of resident chunks."""

    def describe(self) -> dict[str, Any]:
        """Policy state for stats: its name and resident chunks, then figures of its own."""
        return {"policy": self.name, "resident": len(self)}

    def stats(self) -> PolicyStats:
        """`describe` as the agent's stats carry it."""
        state = self.describe()
        name, resident = state.pop("policy"), state.pop("resident")
        figures = msgspec.convert(state, dict[str, PolicyFigure])
        return PolicyStats(policy=name, resident=resident, state=figures)
