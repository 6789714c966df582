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

What the index knows of a chunk lives in per-slot arrays, not in objects (a chunk being
written or ready occupies exactly one slot): an object, dict entries and an ordering node
cost about half a kilobyte a chunk, gigabytes of agent memory for a pool of millions of
chunks, where the arrays cost under 128 bytes a slot (`index_footprint_and_rate` in
kvtier/bench/host.py measures it). A chunk is named by its namespace's number and a 128-bit
blake2b digest of its key, found through open addressing over slot numbers (`_SlotMap`): two
keys of one digest (a 2^-128 chance) would be taken for one chunk, which the slot's header in
the pool, naming namespace and key in full, lets a reader tell. Keys are kept only where
nothing else has them: the host tier reads a chunk's key back from its slot's header
(`key_of`); an index without it (replay, tests) keeps them, and so does one whose policy
names chunks by key rather than slot (ARC and prefix remember chunks after eviction, when no
slot names them), sharing the policy's (namespace, key) tuples. An `Entry` is a view of one
slot.
"""

from __future__ import annotations

import enum
import hashlib
import itertools
import struct
from array import array
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
    FREE = 0  # the slot holds no chunk
    WRITING = 1
    READY = 2


ChunkKey = tuple[str, bytes]
KeyOf = Callable[[int], ChunkKey]

_MASK = (1 << 64) - 1
_SALT = 0x9E3779B97F4A7C15  # odd, so each namespace number gets a salt of its own
_HALVES = struct.Struct("<QQ").unpack


def _identities(namespace: int, keys: list[bytes]) -> list[tuple[int, int]]:
    """The 128-bit names of `keys` in namespace number `namespace`, each as two halves: the
    first (salted by the namespace) places the chunk in the slot map, the second confirms
    it. One call per batch: the names are what a lookup spends most of its time on."""
    salt, blake2b, halves = namespace * _SALT & _MASK, hashlib.blake2b, _HALVES
    named = (halves(blake2b(key, digest_size=16).digest()) for key in keys)
    return [(first ^ salt, second) for first, second in named]


def _identity(namespace: int, key: bytes) -> tuple[int, int]:
    return _identities(namespace, [key])[0]


class _SlotMap:
    """Open addressing from a 64-bit hash to the slot placed under it. A slot's hash and a
    tag that confirms it live in columns of the index (`hashes`, `tags`), so a position holds
    only a slot number: 4 bytes, two to four positions per slot. Deletion shifts the rest of
    a cluster back (no tombstones), so probes stay short however much the chunks churn."""

    def __init__(self, slots: int, hashes: array[int], tags: array[int]) -> None:
        size = 1 << (2 * max(slots, 1) - 1).bit_length()  # at least twice the slots
        self._mask = size - 1
        self._at = array("i", [-1]) * size
        self._hashes = hashes
        self._tags = tags

    def find(self, h: int, tag: int) -> int:
        """The slot placed under `h` with tag `tag`, or -1."""
        at, hashes, tags, mask = self._at, self._hashes, self._tags, self._mask
        pos = h & mask
        while (slot := at[pos]) >= 0:
            if hashes[slot] == h and tags[slot] == tag:
                return slot
            pos = (pos + 1) & mask
        return -1

    def add(self, slot: int) -> None:
        """Place `slot` under the hash its column holds."""
        at, mask = self._at, self._mask
        pos = self._hashes[slot] & mask
        while at[pos] >= 0:
            pos = (pos + 1) & mask
        at[pos] = slot

    def discard(self, slot: int) -> None:
        """Take `slot` out (its column still holding the hash it was placed under), moving
        each later member of its cluster into the hole unless its home lies after the hole."""
        at, hashes, mask = self._at, self._hashes, self._mask
        hole = hashes[slot] & mask
        while (held := at[hole]) != slot:
            if held < 0:
                raise KeyError(f"slot {slot} is not in the map")
            hole = (hole + 1) & mask
        pos = (hole + 1) & mask
        while (moved := at[pos]) >= 0:
            if (pos - (hashes[moved] & mask)) & mask >= (pos - hole) & mask:
                at[hole] = moved
                hole = pos
            pos = (pos + 1) & mask
        at[hole] = -1


class Entry:
    """The chunk in one slot, read from the index's columns. Entries are used only while
    their chunk holds the slot (pinned, or within one call under the agent's lock): a view
    does not notice its slot going to another chunk. It knows its key where it was made from
    one (a lease, a lookup by key); otherwise `id` asks the index."""

    __slots__ = ("_index", "_key", "generation", "slot")

    def __init__(self, index: HostIndex, slot: int, key: ChunkKey | None = None) -> None:
        self._index = index
        self.slot = slot
        self.generation = index._generation[slot]  # the slot's stamp while it holds this chunk
        self._key = key

    @property
    def id(self) -> ChunkKey:
        return self._key if self._key is not None else self._index.key_at(self.slot)

    @property
    def hits(self) -> int:
        return self._index._hits[self.slot]

    @property
    def length(self) -> int:
        return self._index._length[self.slot]

    @length.setter
    def length(self, value: int) -> None:
        self._index._length[self.slot] = value

    @property
    def checksum(self) -> int | None:
        """Set once sealed: the bytes are complete and verified."""
        index = self._index
        return index._checksum[self.slot] if index._sealed[self.slot] else None

    @checksum.setter
    def checksum(self, value: int) -> None:
        self._index._checksum[self.slot] = value
        self._index._sealed[self.slot] = 1

    def header(self) -> ChunkHeader:
        checksum = self.checksum
        assert checksum is not None, "only a sealed chunk has a full header"
        namespace, key = self.id
        return ChunkHeader(namespace, key, self.length, checksum)


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
        key_of: KeyOf | None = None,
    ) -> None:
        self.slot_count = slot_count
        self.table = table
        self.policy = policy
        self.rest_seconds = rest_seconds
        self._resting: list[tuple[float, int]] = []  # (until, slot)
        # Per slot, meaningful while its state is not FREE.
        self._state = array("B", bytes(slot_count))
        self._namespace = array("I", [0]) * slot_count  # its namespace's number
        self._pins = array("i", [0]) * slot_count
        self._hits = array("Q", [0]) * slot_count
        self._length = array("Q", [0]) * slot_count
        self._checksum = array("Q", [0]) * slot_count
        self._sealed = array("B", bytes(slot_count))
        self._generation = array("Q", [0]) * slot_count
        self._published = array("Q", [0]) * slot_count  # its digest in the table; 0: not there
        self._place = array("Q", [0]) * slot_count  # the two halves of its `_identity`
        self._confirm = array("Q", [0]) * slot_count
        self._chunks = _SlotMap(slot_count, self._place, self._confirm)
        self._by_digest = _SlotMap(slot_count, self._published, self._namespace)
        self._numbers: dict[str, int] = {}
        self._by_slot = policy.by_slot
        self._key_of = key_of
        self._keeps_keys = key_of is None or not policy.by_slot
        self._keys: list[ChunkKey | None] = [None] * slot_count if self._keeps_keys else []
        self._free = array("i", range(slot_count - 1, -1, -1))
        self._leases: dict[int, Lease] = {}
        self._lease_ids = itertools.count((boot << 32) + 1)
        self._generations = itertools.count((boot << 32) + 1)
        self._pending_hits: list[tuple[int, int]] = []  # (slot, generation) per hit
        self._touched: list[Entry] = []
        self.counters = IndexCounters()
        self.events = ChunkEvents()

    # --- queries -------------------------------------------------------------------------

    def get(self, namespace: str, key: bytes) -> Entry | None:
        slot = self._slot(self._numbers.get(namespace), key)
        return Entry(self, slot, (namespace, key)) if slot >= 0 else None

    def key_at(self, slot: int) -> ChunkKey:
        """The namespace and key of the chunk in `slot`."""
        if self._keeps_keys:
            chunk = self._keys[slot]
            if chunk is None:
                raise LookupError(f"slot {slot} holds no chunk")
            return chunk
        assert self._key_of is not None  # given whenever keys are not kept
        return self._key_of(slot)

    def lookup(self, namespace: str, keys: list[bytes]) -> tuple[list[bool], int]:
        """Per-key hits and the length of the longest all-hit prefix.

        The policy learns of the hits only at `touch`, which the agent calls after it has
        answered, so the eviction order's upkeep stays out of the lookup's latency.
        """
        hits = self._count_lookup(self._ready_slots(namespace, keys))
        n_hits = sum(hits)
        return hits, hits.index(False) if n_hits < len(keys) else len(keys)

    def lookup_digests(self, namespace: str, digests: list[int]) -> list[bool]:
        """`lookup` by index digests (what clients report of the lookups they answered
        from the published table): the hits are the chunks published under them now."""
        number = self._numbers.get(namespace)
        if number is None:
            return self._count_lookup([-1] * len(digests))
        find = self._by_digest.find
        return self._count_lookup([find(d, number) for d in digests])

    def touch(self) -> None:
        """Tell the policy about the hits of lookups answered since the last call and raise
        the entries' hit counts; the entries wait in `touched` for `take_touched`. A hit
        whose chunk left its slot meanwhile is dropped (the generation tells)."""
        state, generation, hits = self._state, self._generation, self._hits
        touched = [
            Entry(self, slot)
            for slot, stamp in self._pending_hits
            if state[slot] == EntryState.READY and generation[slot] == stamp
        ]
        self._pending_hits.clear()
        if not touched:
            return
        for entry in touched:
            hits[entry.slot] += 1
        self.policy.on_hits([self._chunk_id(e.slot) for e in touched])
        self._touched += touched

    def take_touched(self) -> list[Entry]:
        """Entries hit since the last call (once per hit), whether `touch` ran after a reply
        or before an eviction needed the current order."""
        self.touch()
        touched, self._touched = self._touched, []
        return touched

    def missing(self, namespace: str, keys: list[bytes]) -> list[bytes]:
        """Keys not readable from the pool, without counting a lookup."""
        slots = self._ready_slots(namespace, keys)
        return [key for key, slot in zip(keys, slots, strict=True) if slot < 0]

    def ready_keys(self) -> dict[str, set[bytes]]:
        """Every sealed chunk's key, by namespace."""
        held: dict[str, set[bytes]] = {}
        for slot, state in enumerate(self._state):
            if state == EntryState.READY:
                namespace, key = self.key_at(slot)
                held.setdefault(namespace, set()).add(key)
        return held

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
        return len(self._pins) - self._pins.count(0)

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
        number = self._number(namespace)
        slots: list[int] = []
        generations: list[int] = []
        entries: list[Entry] = []
        for key, identity in zip(keys, _identities(number, keys), strict=True):
            held = self._chunks.find(*identity)
            chunk = (namespace, key)
            slot = None if held >= 0 else self._take_slot(chunk)
            if slot is None:
                if held >= 0:
                    ready = self._state[held] == EntryState.READY
                    slots.append(StoreCode.EXISTS if ready else StoreCode.BUSY)
                else:
                    self.counters.full += 1
                    slots.append(StoreCode.FULL)
                generations.append(0)
                continue
            self._hold(slot, number, identity, chunk, next(self._generations), length)
            self._pins[slot] = 1
            entry = Entry(self, slot, chunk)
            entries.append(entry)
            slots.append(slot)
            generations.append(entry.generation)
        if not entries:
            return 0, slots, generations
        return self._new_lease(client, "store", entries, deadline), slots, generations

    def note_parents(self, namespace: str, keys: list[bytes], parents: list[bytes | None]) -> None:
        """Tell the policy each key's predecessor in its request (None where the store did
        not name one), for the keys not held yet: what a store is about to add. A policy that
        names chunks by slot is not told: a parent need not be in the pool."""
        if len(parents) != len(keys):
            raise ValueError(f"{len(parents)} parents for {len(keys)} keys")
        if self._by_slot or all(p is None for p in parents):
            return
        number = self._numbers.get(namespace)
        self.policy.on_parents(
            [
                ((namespace, key), None if parent is None else (namespace, parent))
                for key, parent in zip(keys, parents, strict=True)
                if self._slot(number, key) < 0
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
            self._pins[entry.slot] -= 1
            if keep is not None and not keep(entry):
                self._vacate(entry.slot)
                self._free.append(entry.slot)
                continue
            self._make_ready(entry.slot, entry.id)
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
        slots: list[int] = []
        generations: list[int] = []
        entries: list[Entry] = []
        for key, slot in zip(keys, self._ready_slots(namespace, keys), strict=True):
            if slot < 0:
                slots.append(Where.MISS)
                generations.append(0)
                continue
            self._pins[slot] += 1
            entry = Entry(self, slot, (namespace, key))
            entries.append(entry)
            slots.append(slot)
            generations.append(entry.generation)
        if not entries:
            return 0, slots, generations
        return self._new_lease(client, "load", entries, deadline), slots, generations

    def lease_bytes(self, lease_id: int) -> int:
        lease = self._leases.get(lease_id)
        return sum(self._length[e.slot] for e in lease.entries) if lease else 0

    def end_load(self, lease_id: int, client: str) -> None:
        self._release(self._take(lease_id, client, "load"))

    # --- maintenance ---------------------------------------------------------------------

    def pin(self, entry: Entry) -> None:
        self._pins[entry.slot] += 1

    def unpin(self, entry: Entry) -> None:
        self._pins[entry.slot] -= 1

    def adopt(self, header: ChunkHeader, slot: int, generation: int) -> Entry:
        """Index a verified chunk found in the pool after a restart, keeping its slot's
        generation (readers of the earlier agent process may still be copying it)."""
        self._free.remove(slot)
        number = self._number(header.namespace)
        chunk = (header.namespace, header.key)
        self._hold(slot, number, _identity(number, header.key), chunk, generation, header.length)
        entry = Entry(self, slot, chunk)
        entry.checksum = header.checksum
        self._make_ready(slot, chunk)
        return entry

    def remove(self, entry: Entry) -> None:
        """Drop a ready, unpinned chunk (it failed verification, or was deleted)."""
        slot = entry.slot
        if self._pins[slot] or self._state[slot] != EntryState.READY:
            return
        self.policy.on_remove(self._chunk_id(slot))
        self._forget(slot)
        self._free.append(slot)

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
            self._free.extend(slot for until, slot in self._resting if until <= now)
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
            slot = entry.slot
            self._pins[slot] -= 1
            if lease.kind == "store":
                self._vacate(slot)
                if rest_until is None:
                    self._free.append(slot)
                else:
                    self._resting.append((rest_until, slot))

    def _number(self, namespace: str) -> int:
        """The namespace's number, given it on first sight."""
        number = self._numbers.get(namespace)
        if number is None:
            number = self._numbers[namespace] = len(self._numbers)
        return number

    def _slot(self, number: int | None, key: bytes) -> int:
        """The slot holding `key` of namespace `number` (None: never seen), or -1."""
        return -1 if number is None else self._chunks.find(*_identity(number, key))

    def _ready_slots(self, namespace: str, keys: list[bytes]) -> list[int]:
        """Each key's slot where its chunk is ready to read, else -1."""
        number = self._numbers.get(namespace)
        if number is None:
            return [-1] * len(keys)
        find, state, ready = self._chunks.find, self._state, EntryState.READY
        slots = [find(place, confirm) for place, confirm in _identities(number, keys)]
        return [slot if slot >= 0 and state[slot] == ready else -1 for slot in slots]

    def _count_lookup(self, slots: list[int]) -> list[bool]:
        """Count a lookup that found the chunks in `slots` (-1: a miss) and keep its hits
        for `touch`."""
        hits = [slot >= 0 for slot in slots]
        n_hits = sum(hits)
        if n_hits:
            generation = self._generation
            self._pending_hits += [(slot, generation[slot]) for slot in slots if slot >= 0]
        self.counters.lookups += len(slots)
        self.counters.hits += n_hits
        return hits

    def _chunk_id(self, slot: int) -> ChunkId:
        """What the policy calls the chunk in `slot`."""
        return slot if self._by_slot else self._keys[slot]

    def _slot_of(self, chunk: ChunkId) -> int:
        """The slot of a chunk the policy names."""
        if self._by_slot:
            return cast(int, chunk)
        namespace, key = cast(ChunkKey, chunk)
        return self._slot(self._numbers[namespace], key)

    def _evictable(self, chunk: ChunkId) -> bool:
        return self._pins[self._slot_of(chunk)] == 0

    def _take_slot(self, incoming: ChunkKey) -> int | None:
        if self._free:
            return self._free.pop()
        if self._pending_hits:
            self.touch()
        victim = self.policy.evict(self._evictable, None if self._by_slot else incoming)
        if victim is None:
            return None
        slot = self._slot_of(victim)
        self._forget(slot)
        self.counters.evictions += 1
        return slot

    def _hold(
        self,
        slot: int,
        number: int,
        identity: tuple[int, int],
        chunk: ChunkKey,
        generation: int,
        length: int,
    ) -> None:
        """Give a free slot to a chunk being written."""
        self._state[slot] = EntryState.WRITING
        self._namespace[slot] = number
        self._place[slot], self._confirm[slot] = identity
        self._generation[slot] = generation
        self._length[slot] = length
        self._hits[slot] = self._pins[slot] = self._sealed[slot] = 0
        self._chunks.add(slot)
        if self._keeps_keys:
            self._keys[slot] = chunk

    def _vacate(self, slot: int) -> None:
        """Take a chunk out of its slot, which is free from then on."""
        self._chunks.discard(slot)
        self._state[slot] = EntryState.FREE
        if self._keeps_keys:
            self._keys[slot] = None

    def _make_ready(self, slot: int, chunk: ChunkKey) -> None:
        namespace, key = chunk
        self._state[slot] = EntryState.READY
        self.policy.on_insert(self._chunk_id(slot))
        self.counters.namespaces[namespace] += 1
        self.events.record(namespace, key, removed=False)
        if self.table is not None:
            d = digest(namespace, key)
            if self.table.put(d, slot, self._generation[slot]):
                self._published[slot] = d
                self._by_digest.add(slot)

    def _forget(self, slot: int) -> None:
        """A ready chunk leaves the pool: withdrawn from the table before its slot can go to
        another chunk."""
        namespace, key = self.key_at(slot)
        if self._published[slot]:
            if self.table is not None:
                self.table.remove(self._published[slot])
            self._by_digest.discard(slot)
            self._published[slot] = 0
        self._vacate(slot)
        self.events.record(namespace, key, removed=True)
        self.counters.namespaces[namespace] -= 1
        if not self.counters.namespaces[namespace]:
            del self.counters.namespaces[namespace]
