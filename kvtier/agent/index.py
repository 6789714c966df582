"""The host tier's index: which chunk lives in which pool slot, and who holds it.

Pure bookkeeping with no I/O, so every rule (no eviction under a lease, leases reclaimed
when they expire or their client dies, a chunk readable only once committed, a lease used
only by its holder and for its kind) is tested directly. The agent serialises calls with one
lock; nothing here blocks. A refused call raises before it changes anything.

Lease ids and slot generations carry the agent's boot id in their upper 32 bits, so no id
or generation handed out by an earlier agent process can match one of this process's.

With a `table` (see shm_index.py), every ready chunk is also published there for clients to
find without asking: it is published when it becomes ready and withdrawn before its slot can
go to another chunk, so a table entry never names a slot being rewritten.

The slot of a store lease that expired rests for `rest_seconds` before it is used again (and
so do slots an earlier agent process had handed to writers, see `rest`): its writer may
still be copying into it, and would otherwise alter the chunk the slot holds next.
"""

from __future__ import annotations

import enum
import itertools
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, cast

from kvtier.agent.chunk import ChunkHeader
from kvtier.agent.events import ChunkEvents
from kvtier.agent.policy import ChunkId, EvictionPolicy
from kvtier.agent.protocol import StoreCode, Where
from kvtier.agent.shm_index import TableWriter, digest


class LeaseError(ValueError):
    """A lease that is unknown (expired, or granted by an earlier agent process), held by
    another client, or of the other kind."""


class EntryState(enum.IntEnum):
    WRITING = 1
    READY = 2


ChunkKey = tuple[str, bytes]


@dataclass(eq=False)
class Entry:
    id: ChunkKey
    slot: int
    length: int
    state: EntryState = EntryState.WRITING
    pins: int = 0
    hits: int = 0
    checksum: int | None = None  # set once sealed: the bytes are complete and verified
    generation: int = 0  # the slot's stamp while it holds this chunk
    published: int = 0  # its digest in the shared table, 0 while not published there

    def header(self) -> ChunkHeader:
        assert self.checksum is not None, "only a sealed chunk has a full header"
        return ChunkHeader(self.id[0], self.id[1], self.length, self.checksum)


@dataclass(eq=False)
class Lease:
    id: int
    client: str
    kind: Literal["store", "load"]
    entries: list[Entry]
    deadline: float
    committing: bool = False  # the agent is copying its chunks in: never expired meanwhile


@dataclass
class IndexCounters:
    lookups: int = 0
    hits: int = 0
    evictions: int = 0
    full: int = 0
    leases_expired: int = 0
    leases_reclaimed: int = 0
    namespaces: Counter[str] = field(default_factory=Counter)


class HostIndex:
    def __init__(
        self,
        slot_count: int,
        policy: EvictionPolicy,
        boot: int = 0,
        rest_seconds: float = 0.0,
        table: TableWriter | None = None,
    ) -> None:
        self.slot_count = slot_count
        self.table = table
        self.policy = policy
        self.rest_seconds = rest_seconds
        self._resting: list[tuple[float, int]] = []  # (until, slot)
        self._by_ns: dict[str, dict[bytes, Entry]] = {}
        # The READY subset of _by_ns, so a lookup is one membership test per key.
        self._ready: dict[str, dict[bytes, Entry]] = {}
        self._free = list(range(slot_count - 1, -1, -1))
        self._leases: dict[int, Lease] = {}
        self._lease_ids = itertools.count((boot << 32) + 1)
        self._generations = itertools.count((boot << 32) + 1)
        self._pending_hits: list[tuple[str, list[bytes], list[bool]]] = []
        self._published: dict[int, Entry] = {}  # digest -> entry, for reported lookups
        self._touched: list[Entry] = []
        self.counters = IndexCounters()
        self.events = ChunkEvents()

    # --- queries -------------------------------------------------------------------------

    def get(self, namespace: str, key: bytes) -> Entry | None:
        return self._by_ns.get(namespace, {}).get(key)

    def lookup(self, namespace: str, keys: list[bytes]) -> tuple[list[bool], int]:
        """Per-key hits and the length of the longest all-hit prefix.

        The policy learns of the hits only at `touch`, which the agent calls after it has
        answered, so the eviction order's upkeep stays out of the lookup's latency.
        """
        ready = self._ready.get(namespace, {})
        hits = [k in ready for k in keys]
        n_hits = sum(hits)
        if n_hits:
            self._pending_hits.append((namespace, keys, hits))
        self.counters.lookups += len(keys)
        self.counters.hits += n_hits
        return hits, hits.index(False) if n_hits < len(keys) else len(keys)

    def lookup_digests(self, namespace: str, digests: list[int]) -> list[bool]:
        """`lookup` by index digests (what clients report of the lookups they answered
        from the published table): the hits are the chunks published under them now."""
        found = [self._published.get(d) for d in digests]
        hits = [e is not None and e.id[0] == namespace for e in found]
        n_hits = sum(hits)
        if n_hits:
            keys = [e.id[1] for e, hit in zip(found, hits, strict=True) if hit and e is not None]
            self._pending_hits.append((namespace, keys, [True] * len(keys)))
        self.counters.lookups += len(digests)
        self.counters.hits += n_hits
        return hits

    def touch(self) -> None:
        """Tell the policy about the hits of lookups answered since the last call and raise
        the entries' hit counts; the entries wait in `touched` for `take_touched`."""
        for namespace, keys, hits in self._pending_hits:
            ready = self._ready.get(namespace, {})
            entries = [e for k, hit in zip(keys, hits, strict=True) if hit and (e := ready.get(k))]
            for entry in entries:
                entry.hits += 1
            self.policy.on_hits([e.id for e in entries])
            self._touched += entries
        self._pending_hits.clear()

    def take_touched(self) -> list[Entry]:
        """Entries hit since the last call (once per hit), whether `touch` ran after a reply
        or before an eviction needed the current order."""
        self.touch()
        touched, self._touched = self._touched, []
        return touched

    def missing(self, namespace: str, keys: list[bytes]) -> list[bytes]:
        """Keys not readable from the pool, without counting a lookup."""
        ready = self._ready.get(namespace, {})
        return [k for k in keys if k not in ready]

    @property
    def chunks(self) -> int:
        return sum(self.counters.namespaces.values())

    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def resting_slots(self) -> int:
        return len(self._resting)

    @property
    def leases(self) -> int:
        return len(self._leases)

    def pinned_slots(self) -> int:
        return sum(1 for t in self._by_ns.values() for e in t.values() if e.pins)

    # --- store ---------------------------------------------------------------------------

    def allocate(
        self,
        client: str,
        namespace: str,
        keys: list[bytes],
        length: int,
        deadline: float,
        parents: list[bytes | None] | None = None,
    ) -> tuple[int, list[int], list[int]]:
        """Reserve a slot per new key for `client` to write; returns (lease id, slots, the
        granted slots' generations).

        Keys already held or being written get EXISTS/BUSY instead of a slot, so duplicate
        stores cost one round trip and no copy. `parents`, where the store names them, are
        each key's predecessor in its request, for the policy (`PrefixPolicy`).
        """
        if parents is not None:
            self.note_parents(namespace, keys, parents)
        table = self._by_ns.setdefault(namespace, {})
        slots: list[int] = []
        generations: list[int] = []
        entries: list[Entry] = []
        for key in keys:
            existing = table.get(key)
            slot = None if existing is not None else self._take_slot((namespace, key))
            if slot is None:
                if existing is not None:
                    slots.append(
                        StoreCode.EXISTS if existing.state is EntryState.READY else StoreCode.BUSY
                    )
                else:
                    self.counters.full += 1
                    slots.append(StoreCode.FULL)
                generations.append(0)
                continue
            entry = Entry(
                id=(namespace, key),
                slot=slot,
                length=length,
                pins=1,
                generation=next(self._generations),
            )
            table[key] = entry
            entries.append(entry)
            slots.append(slot)
            generations.append(entry.generation)
        if not table:
            del self._by_ns[namespace]
        if not entries:
            return 0, slots, generations
        return self._new_lease(client, "store", entries, deadline), slots, generations

    def ready_keys(self) -> dict[str, set[bytes]]:
        """Every sealed chunk's key, by namespace."""
        return {ns: set(entries) for ns, entries in self._ready.items() if entries}

    def note_parents(self, namespace: str, keys: list[bytes], parents: list[bytes | None]) -> None:
        """Tell the policy each key's predecessor in its request (None where the store did
        not name one), for the keys not held yet: what a store is about to add."""
        if len(parents) != len(keys):
            raise ValueError(f"{len(parents)} parents for {len(keys)} keys")
        if all(p is None for p in parents):
            return
        held = self._by_ns.get(namespace, {})
        self.policy.on_parents(
            [
                ((namespace, key), None if parent is None else (namespace, parent))
                for key, parent in zip(keys, parents, strict=True)
                if key not in held
            ]
        )

    def commit(
        self, lease_id: int, client: str, keep: Callable[[Entry], bool] | None = None
    ) -> list[Entry]:
        """Make a store lease's chunks readable; returns them for sealing. A chunk `keep`
        refuses (its slot was written over) is dropped before anyone can see it."""
        lease = self._take(lease_id, client, "store")
        kept = []
        for entry in lease.entries:
            entry.pins -= 1
            if keep is not None and not keep(entry):
                self._by_ns[entry.id[0]].pop(entry.id[1], None)
                self._free.append(entry.slot)
                continue
            entry.state = EntryState.READY
            self._make_ready(entry)
            kept.append(entry)
        return kept

    def begin_commit(self, lease_id: int, client: str) -> list[Entry]:
        """The chunks of a store lease its holder commits, which the agent now copies into
        their slots: the lease no longer expires nor goes with its client, as the agent
        itself writes those slots until `commit` or `abort`. Raises as `commit` would."""
        lease = self._leases.get(lease_id)
        if lease is None or lease.client != client:
            self._take(lease_id, client, "store")  # raises the error commit would raise
        assert lease is not None
        if lease.kind != "store":
            raise ValueError(f"lease {lease_id} is a {lease.kind} lease, not a store lease")
        lease.committing = True
        return list(lease.entries)

    def abort(self, lease_id: int, client: str) -> None:
        self._release(self._take(lease_id, client, "store"))

    # --- load ----------------------------------------------------------------------------

    def begin_load(
        self, client: str, namespace: str, keys: list[bytes], deadline: float
    ) -> tuple[int, list[int], list[int]]:
        """Pin the ready chunks among `keys` for reading; MISS for the others. Returns the
        lease, the slots and each granted slot's generation (0 for a miss)."""
        ready = self._ready.get(namespace, {})
        slots: list[int] = []
        generations: list[int] = []
        entries: list[Entry] = []
        for key in keys:
            entry = ready.get(key)
            if entry is None:
                slots.append(Where.MISS)
                generations.append(0)
                continue
            entry.pins += 1
            entries.append(entry)
            slots.append(entry.slot)
            generations.append(entry.generation)
        if not entries:
            return 0, slots, generations
        return self._new_lease(client, "load", entries, deadline), slots, generations

    def lease_bytes(self, lease_id: int) -> int:
        lease = self._leases.get(lease_id)
        return sum(e.length for e in lease.entries) if lease else 0

    def end_load(self, lease_id: int, client: str) -> None:
        self._release(self._take(lease_id, client, "load"))

    # --- maintenance ---------------------------------------------------------------------

    def pin(self, entry: Entry) -> None:
        entry.pins += 1

    def unpin(self, entry: Entry) -> None:
        entry.pins -= 1

    def adopt(self, header: ChunkHeader, slot: int, generation: int) -> Entry:
        """Index a verified chunk found in the pool after a restart, keeping its slot's
        generation (readers of the earlier agent process may still be copying it)."""
        self._free.remove(slot)
        namespace, key = header.namespace, header.key
        entry = Entry(
            id=(namespace, key),
            slot=slot,
            length=header.length,
            state=EntryState.READY,
            checksum=header.checksum,
            generation=generation,
        )
        self._by_ns.setdefault(namespace, {})[key] = entry
        self._make_ready(entry)
        return entry

    def remove(self, entry: Entry) -> None:
        """Drop a ready, unpinned chunk (it failed verification, or was deleted)."""
        if entry.pins or entry.state is not EntryState.READY:
            return
        self.policy.on_remove(entry.id)
        self._forget(entry)
        self._free.append(entry.slot)

    def rest(self, slot: int, until: float) -> None:
        """Keep a free slot out of use until `until`: a writer may still copy into it."""
        self._free.remove(slot)
        self._resting.append((until, slot))

    def expire(self, now: float) -> list[Lease]:
        """Release leases past their deadline (store slots go to rest) and return rested
        slots to use."""
        expired = [
            lease
            for lease in self._leases.values()
            if lease.deadline <= now and not lease.committing
        ]
        for lease in expired:
            del self._leases[lease.id]
            self._release(lease, rest_until=now + self.rest_seconds)
        self.counters.leases_expired += len(expired)
        if self._resting:
            self._free += [slot for until, slot in self._resting if until <= now]
            self._resting = [(until, slot) for until, slot in self._resting if until > now]
        return expired

    def release_client(self, client: str) -> list[Lease]:
        """Release every lease of a client that is gone."""
        gone = [
            lease
            for lease in self._leases.values()
            if lease.client == client and not lease.committing
        ]
        for lease in gone:
            del self._leases[lease.id]
            self._release(lease)
        self.counters.leases_reclaimed += len(gone)
        return gone

    def clients_with_leases(self) -> set[str]:
        return {lease.client for lease in self._leases.values()}

    # --- internals -----------------------------------------------------------------------

    def _take(self, lease_id: int, client: str, kind: Literal["store", "load"]) -> Lease:
        """Remove and return a lease its holder ends. Raises, changing nothing, LeaseError
        for a lease this client does not hold and ValueError for one of the other kind."""
        lease = self._leases.get(lease_id)
        if lease is None or lease.client != client:
            raise LeaseError(
                f"lease {lease_id} is not held by this client (expired, released, granted "
                "by an earlier agent process, or another client's)"
            )
        if lease.kind != kind:
            raise ValueError(f"lease {lease_id} is a {lease.kind} lease, not a {kind} lease")
        del self._leases[lease_id]
        return lease

    def _new_lease(
        self, client: str, kind: Literal["store", "load"], entries: list[Entry], deadline: float
    ) -> int:
        lease = Lease(next(self._lease_ids), client, kind, entries, deadline)
        self._leases[lease.id] = lease
        return lease.id

    def _release(self, lease: Lease, rest_until: float | None = None) -> None:
        """End a lease. An unfinished write is worthless: its slot goes back, to rest until
        `rest_until` when its writer may still be copying (the lease expired)."""
        for entry in lease.entries:
            entry.pins -= 1
            if lease.kind == "store":
                self._by_ns[entry.id[0]].pop(entry.id[1], None)
                if rest_until is None:
                    self._free.append(entry.slot)
                else:
                    self._resting.append((rest_until, entry.slot))

    def _evictable(self, chunk: ChunkId) -> bool:
        ns, key = cast(ChunkKey, chunk)
        return self._by_ns[ns][key].pins == 0

    def _take_slot(self, incoming: ChunkKey) -> int | None:
        if self._free:
            return self._free.pop()
        if self._pending_hits:
            self.touch()
        victim = self.policy.evict(self._evictable, incoming)
        if victim is None:
            return None
        ns, key = cast(ChunkKey, victim)
        entry = self._by_ns[ns][key]
        self._forget(entry)
        self.counters.evictions += 1
        return entry.slot

    def _make_ready(self, entry: Entry) -> None:
        ns, key = entry.id
        self._ready.setdefault(ns, {})[key] = entry
        self.policy.on_insert(entry.id)
        self.counters.namespaces[ns] += 1
        self.events.record(ns, key, removed=False)
        if self.table is not None:
            d = digest(ns, key)
            if self.table.put(d, entry.slot, entry.generation):
                entry.published = d
                self._published[d] = entry

    def _forget(self, entry: Entry) -> None:
        ns, key = entry.id
        if entry.published and self.table is not None:
            self.table.remove(entry.published)
            del self._published[entry.published]
            entry.published = 0
        del self._by_ns[ns][key]
        del self._ready[ns][key]
        self.events.record(ns, key, removed=True)
        self.counters.namespaces[ns] -= 1
        if not self.counters.namespaces[ns]:
            del self.counters.namespaces[ns]
