"""The agent's stats, typed and defined once: what the `stats` request returns, what the
KVCacheNode report is built from (node_status.py) and what Prometheus reads its counters from
(metrics.py), so no counter is kept twice and no two parts' keys can collide.

Counters only grow while the agent runs; the rest are gauges read when the stats are taken.
"""

from __future__ import annotations

import threading
from typing import Generic, Literal, TypeVar

import msgspec

TierCount = Literal[
    "hits",
    "misses",
    "promotions",
    "writebacks",
    "dropped_queue_full",
    "dropped_pool_pressure",
    "dropped_unhealthy",
    "write_errors",
    "read_errors",
    "read_timeouts",
    "exists_errors",
    "probe_errors",
    "maintain_errors",
    "corrupt",
    "evictions",
]
PeerCount = Literal[
    "nixl_reads",
    "zmq_reads",
    "stream_reads",
    "nixl_failures",
    "stream_failures",
    "busy",
    "batch_errors",
    "reannounced",
    "refused_sources",
    "idle_closed",
]


class TierCounts(msgspec.Struct, kw_only=True):
    """What one secondary tier did since the agent started."""

    hits: int = 0  # keys asked of it and found
    misses: int = 0  # keys asked of it and not found
    promotions: int = 0  # chunks read from it into the pool
    writebacks: int = 0  # chunks written to it from the pool
    dropped_queue_full: int = 0  # write-backs dropped: it fell behind
    dropped_pool_pressure: int = 0  # ... half the pool pinned by write-backs already
    dropped_unhealthy: int = 0  # ... it is marked unhealthy
    write_errors: int = 0  # failed operations, by operation
    read_errors: int = 0
    read_timeouts: int = 0  # reads not done within the request's budget
    exists_errors: int = 0
    probe_errors: int = 0  # probes of an unhealthy tier that failed
    maintain_errors: int = 0
    corrupt: int = 0  # chunks read from it that failed verification (dropped)
    evictions: int = 0  # chunks its upkeep evicted to stay under its watermarks

    @property
    def dropped(self) -> int:
        """Write-backs not even attempted, whatever the reason."""
        return self.dropped_queue_full + self.dropped_pool_pressure + self.dropped_unhealthy


class PeerCounts(msgspec.Struct, kw_only=True):
    """The peer tier's traffic since the agent started, and its state now."""

    nixl_reads: int = 0  # chunks read from other agents over NIXL
    zmq_reads: int = 0  # ... as ZMQ frames
    stream_reads: int = 0  # ... over the stream (TCP, each chunk's tag checked)
    nixl_failures: int = 0  # NIXL connections or transfers that failed (another path took over)
    stream_failures: int = 0  # streams that broke or could not connect (ZMQ took over)
    busy: int = 0  # chunks holders refused to lend, being busy
    batch_errors: int = 0  # batched reads from a holder that failed
    reannounced: int = 0  # keys re-announced to their homes
    refused_sources: int = 0  # requests naming a non-member as their source
    idle_closed: int = 0  # idle connections closed
    lent: int = 0  # slots lent to other agents right now
    refused: int = 0  # chunks not lent, maxLentChunks being reached
    refused_requests: int = 0  # requests from or naming a non-member
    refused_handshakes: int = 0  # CURVE handshakes with an unknown key
    connections: int = 0  # connections to other agents open now
    directory_keys: int = 0  # keys this agent is home to


C = TypeVar("C", "TierCounts", "PeerCounts", "StoreSkips")


class Tally(Generic[C]):
    """Counters of one kind (`TierCounts`, `PeerCounts`, `StoreSkips`) raised from several
    threads."""

    def __init__(self, counts: C) -> None:
        self._counts: C = counts
        self._lock = threading.Lock()

    def add(self, what: TierCount | PeerCount | StoreSkip, n: int = 1) -> None:
        with self._lock:
            setattr(self._counts, what, getattr(self._counts, what) + n)

    def read(self) -> C:
        """A copy, consistent with itself."""
        with self._lock:
            copy: C = msgspec.structs.replace(self._counts)
            return copy


StoreSkip = Literal["exists", "busy", "full", "staging"]


class StoreSkips(msgspec.Struct, kw_only=True):
    """Keys of store requests not written, by reason: held already, being written by
    another store, no slot to evict (every chunk pinned), no staging slot free."""

    exists: int = 0
    busy: int = 0
    full: int = 0
    staging: int = 0


# One figure of a policy's own state: a count, a rate, a flag, a name, or scores by name.
PolicyFigure = int | float | bool | str | dict[str, float]


class PolicyStats(msgspec.Struct, kw_only=True, omit_defaults=True):
    """The eviction policy's state: its name and resident chunks, which every policy has,
    then the figures of its own under the names it gives them (`EvictionPolicy.describe`:
    ARC's target `p` and lists' lengths, the prefix policy's leaves, `adaptive`'s leader
    and scores, ...), so no policy's figures need a field here."""

    policy: str
    resident: int
    state: dict[str, PolicyFigure] = msgspec.field(default_factory=dict)


class HostStats(msgspec.Struct, kw_only=True):
    """The pool: its size, what it holds, its leases and the index's counters."""

    capacity_bytes: int
    used_bytes: int
    slot_bytes: int
    slots: int
    free_slots: int
    resting_slots: int
    staging_slots: int
    free_staging_slots: int
    chunks: int
    leases: int
    pinned_slots: int
    lookups: int
    hits: int
    evictions: int
    store_skipped: StoreSkips
    leases_expired: int
    leases_reclaimed: int
    corrupt: int
    index_published: int
    index_collisions: int
    namespaces: dict[str, int]
    policy: PolicyStats


class TierStats(msgspec.Struct, kw_only=True):
    """One secondary tier: occupancy, its write-back queue, health and counters (`peer` only
    for the peer tier)."""

    name: str
    kind: str
    capacity_bytes: int
    used_bytes: int
    chunks: int
    queued: int
    healthy: bool
    counts: TierCounts
    peer: PeerCounts | None = None


class EventStreamStats(msgspec.Struct, kw_only=True):
    """Where routers subscribe to the node's KV event stream (`event_stream.py`)."""

    endpoint: str  # the PUB socket, e.g. tcp://10.0.0.7:5558
    replay_endpoint: str  # the replay ROUTER socket
    topic: str  # the batches' topic with the node filled in, {namespace} left to fill
    curve_key: str | None = None  # the CURVE public key it serves with; None: open


class AgentStats(msgspec.Struct, kw_only=True):
    """The whole agent: the host tier, the secondary tiers in lookup order, the peers it
    talks to, its clients, and where its metrics are served (None while not serving)."""

    name: str
    host: HostStats
    tiers: list[TierStats]
    peers: list[str]
    clients: int
    metrics_port: int | None = None
    events: EventStreamStats | None = None  # None: no event stream

    def tier(self, name: str) -> TierStats:
        """The secondary tier called `name`; KeyError naming the tiers there are."""
        for tier in self.tiers:
            if tier.name == name:
                return tier
        raise KeyError(f"no tier {name!r}; tiers: {[t.name for t in self.tiers]}")
