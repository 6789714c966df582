"""Which chunks became readable on the node or left it, for KV-event consumers.

`ChunkEvents` is the host pool's own log, per namespace (the index records into it).
`NodeEvents` is the node's: every tier's stores and removals, the pool's pumped in from
`ChunkEvents`, the secondary tiers' recorded by the tiers themselves, each tagged with the
residency vLLM's KV events name (medium CPU or STORAGE, locality LOCAL or REMOTE). Tiers of
one residency (a filesystem and an object store are both local STORAGE) count as one: a
chunk is stored there when the first of them holds it and removed when the last lets it go,
so a router never reads a removal for a chunk the node still holds. vLLM engines forward the
node's events (`Events` requests) and the agent publishes them on its own ZMQ stream
(`event_stream.py`), so a router learns what the whole node holds, not only what one engine
offloaded. The logs are bounded; a reader that fell too far behind is told so.

The peer tier reports nothing, on purpose. What it gives this node is the pools of the
tier's other agents, and those agents already publish them (medium CPU, locality LOCAL,
their own node as owner). This node does not know what its peers hold: it keeps only the
share of the tier's directory homed on it (announcements for keys that hash here, soft
state that expires), an accident of rendezvous hashing, not what this node can serve. As
CPU REMOTE events that share would tell a router that the key's home is a better place for
a prefix than any other member, when every member reaches a peer's chunk at the same cost,
and its removals (expiry, a holder's withdrawal) would trail or miss the holder's own. A
router that counts peers as reachable reads it from the holder's stream: a chunk in one
member's pool is one peer read away from every member of the tier.
"""

from __future__ import annotations

import heapq
import threading
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

ALL_NAMESPACES = ""  # `ChunkEvents.since` for every namespace (no namespace is empty)
HOST = "host"  # the pool's tier name (reserved: no secondary tier may take it)


@dataclass(frozen=True)
class EventBatch:
    seq: int  # pass as `after` next time
    stored: list[bytes]
    evicted: list[bytes]
    truncated: bool  # events after the reader's `after` were dropped before it asked
    # every event in order: (namespace, removed, key); stored/evicted lose the order
    items: list[tuple[str, bool, bytes]] = field(default_factory=list)


class ChunkEvents:
    def __init__(self, per_namespace: int = 65536) -> None:
        self._limit = per_namespace
        self._logs: dict[str, deque[tuple[int, bool, bytes]]] = {}
        self._seq = 0

    def record(self, namespace: str, key: bytes, removed: bool) -> None:
        self._seq += 1
        log = self._logs.get(namespace)
        if log is None:
            log = self._logs[namespace] = deque(maxlen=self._limit)
        log.append((self._seq, removed, key))

    def since(self, namespace: str, after: int) -> EventBatch:
        if namespace == ALL_NAMESPACES:
            return self._all_since(after)
        log = self._logs.get(namespace)
        if not log:
            return EventBatch(self._seq, [], [], False)
        newer: list[tuple[int, bool, bytes]] = []
        for item in reversed(log):
            if item[0] <= after:
                break
            newer.append(item)
        newer.reverse()
        truncated = len(log) == self._limit and log[0][0] > after + 1
        return EventBatch(
            self._seq,
            [key for _, removed, key in newer if not removed],
            [key for _, removed, key in newer if removed],
            truncated,
            [(namespace, removed, key) for _, removed, key in newer],
        )

    def _all_since(self, after: int) -> EventBatch:
        """Every namespace's events after `after`, merged in sequence order."""
        tails: list[list[tuple[int, bool, bytes, str]]] = []
        truncated = False
        for namespace, log in self._logs.items():
            tail: list[tuple[int, bool, bytes, str]] = []
            for seq, removed, key in reversed(log):
                if seq <= after:
                    break
                tail.append((seq, removed, key, namespace))
            tail.reverse()
            if tail:
                tails.append(tail)
            truncated |= len(log) == self._limit and log[0][0] > after + 1
        merged = list(heapq.merge(*tails))
        return EventBatch(
            self._seq,
            [key for _, removed, key, _ in merged if not removed],
            [key for _, removed, key, _ in merged if removed],
            truncated,
            [(namespace, removed, key) for _, removed, key, namespace in merged],
        )


class Residency(NamedTuple):
    """Where a chunk is, as vLLM's KV events name it (`Medium`, `Locality` in 0.33)."""

    medium: str  # "CPU" | "STORAGE"
    locality: str  # "LOCAL" | "REMOTE"


POOL = Residency("CPU", "LOCAL")
STORAGE = Residency("STORAGE", "LOCAL")
# The residency each kind of secondary tier reports as; the peer tier reports nothing (see
# the module's docstring): its chunks are on the holders' streams as their pools'.
RESIDENCY_OF_KIND = {"filesystem": STORAGE, "objectStore": STORAGE}


class NodeEvent(NamedTuple):
    seq: int
    namespace: str
    residency: Residency
    removed: bool
    key: bytes


@dataclass(frozen=True)
class Run:
    """Consecutive events of one residency and direction."""

    medium: str
    locality: str
    removed: bool
    keys: list[bytes]


@dataclass(frozen=True)
class NodeBatch:
    seq: int  # pass as `after` next time
    runs: list[Run]
    truncated: bool


def runs_of(events: Iterable[NodeEvent]) -> list[Run]:
    """Events grouped into runs, order kept."""
    runs: list[Run] = []
    for event in events:
        last = runs[-1] if runs else None
        if (
            last is None
            or last.removed != event.removed
            or (last.medium, last.locality) != event.residency
        ):
            last = Run(event.residency.medium, event.residency.locality, event.removed, [])
            runs.append(last)
        last.keys.append(event.key)
    return runs


class NodeEvents:
    """The node's events, every tier's, in one sequence (see the module's docstring).

    `record` is called from any thread (tiers' writers and upkeep, the pool's pump); each
    tier's holdings are kept as a set so a tier may report a chunk twice (a write of a file
    already there, a listing after a write) and a removal of what it does not hold is
    dropped."""

    def __init__(self, owner: str, limit: int = 1 << 20) -> None:
        self.owner = owner  # `ownership` of every event: the node, for every engine on it
        self._lock = threading.Lock()
        self._residency: dict[str, Residency] = {HOST: POOL}
        self._held: dict[str, set[tuple[str, bytes]]] = {HOST: set()}
        self._log: deque[NodeEvent] = deque(maxlen=limit)
        self._limit = limit
        self._seq = 0
        self._pumped = 0  # the pool's event sequence pumped up to
        self._pumping = threading.Lock()

    @property
    def seq(self) -> int:
        return self._seq

    def add_tier(self, tier: str, residency: Residency) -> None:
        with self._lock:
            self._residency[tier] = residency
            self._held.setdefault(tier, set())

    def record(self, tier: str, namespace: str, keys: Iterable[bytes], removed: bool) -> None:
        """`tier` now holds (or no longer holds) `keys` of `namespace`."""
        with self._lock:
            self._record_locked(tier, namespace, keys, removed)

    def _record_locked(
        self, tier: str, namespace: str, keys: Iterable[bytes], removed: bool
    ) -> None:
        residency = self._residency[tier]
        held = self._held[tier]
        siblings = [
            self._held[t] for t, r in self._residency.items() if r == residency and t != tier
        ]
        for key in keys:
            item = (namespace, key)
            if removed:
                if item not in held:
                    continue
                held.discard(item)
            else:
                if item in held:
                    continue
                held.add(item)
            if any(item in other for other in siblings):
                continue  # the residency's state did not change
            self._seq += 1
            self._log.append(NodeEvent(self._seq, namespace, residency, removed, key))

    def clear_tier(self, tier: str) -> None:
        """Everything `tier` held is gone (it was emptied or replaced)."""
        with self._lock:
            by_namespace: dict[str, list[bytes]] = {}
            for namespace, key in self._held[tier]:
                by_namespace.setdefault(namespace, []).append(key)
            for namespace, keys in by_namespace.items():
                self._record_locked(tier, namespace, keys, True)

    def pump(
        self,
        events_since: Callable[[str, int], EventBatch],
        held: Callable[[], dict[str, set[bytes]]],
    ) -> None:
        """Take the pool's new events into the node's log: `events_since` and `held` are
        the host tier's. When the pool's log overran the pump, what the pool holds now is
        compared with what was announced, and the difference recorded. One pump at a time
        (a batch is read and applied as one)."""
        with self._pumping:
            batch = events_since(ALL_NAMESPACES, self._pumped)
            now = (
                {(ns, key) for ns, keys in held().items() for key in keys}
                if batch.truncated
                else None
            )
            with self._lock:
                if now is not None:
                    was = self._held[HOST]
                    for namespace, key in sorted(was - now):
                        self._record_locked(HOST, namespace, (key,), True)
                    for namespace, key in sorted(now - was):
                        self._record_locked(HOST, namespace, (key,), False)
                else:
                    for namespace, removed, key in batch.items:
                        self._record_locked(HOST, namespace, (key,), removed)
                self._pumped = batch.seq

    @property
    def pumped(self) -> int:
        return self._pumped

    def tail(self, after: int) -> tuple[list[NodeEvent], bool]:
        """Every event after `after`, and whether some were dropped before being read."""
        with self._lock:
            newer: list[NodeEvent] = []
            for event in reversed(self._log):
                if event.seq <= after:
                    break
                newer.append(event)
            newer.reverse()
            truncated = bool(self._log) and self._log[0].seq > after + 1 and after < self._seq
            truncated &= len(self._log) == self._limit
            return newer, truncated

    def since(self, namespace: str, after: int) -> NodeBatch:
        """A namespace's events after `after`, as runs (what an engine forwards to vLLM)."""
        events, truncated = self.tail(after)
        return NodeBatch(
            self._seq, runs_of(e for e in events if e.namespace == namespace), truncated
        )

    def snapshot(self) -> tuple[int, dict[Residency, dict[str, set[bytes]]]]:
        """What the node holds now, by residency and namespace, and the sequence it is at."""
        with self._lock:
            out: dict[Residency, dict[str, set[bytes]]] = {}
            for tier, held in self._held.items():
                by_namespace = out.setdefault(self._residency[tier], {})
                for namespace, key in held:
                    by_namespace.setdefault(namespace, set()).add(key)
            return self._seq, out
