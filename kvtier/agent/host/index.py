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

What the index knows of a chunk lives in per-slot columns, not in objects (a chunk being
written or ready occupies exactly one slot): an object, dict entries and an ordering node
cost about half a kilobyte a chunk, gigabytes of agent memory for a pool of millions of
chunks, where the columns cost under 128 bytes a slot (`index_footprint_and_rate` in
kvtier/bench/host.py measures it). An `Entry` is a view of one slot.

Every lookup the agent answers, and every one a client reports having answered from the
published table (1,000 keys a vLLM request is common), passes through here, so the batch
paths are numpy operations over the whole batch rather than Python work per key:
- A chunk is placed, in an open-addressing map of slot numbers (`SlotMap`), under the
  64-bit digest the published table files it under (`shm_index.digests`, vectorised, where a
  cryptographic digest costs half a microsecond a key). A batch probes the map together, a
  window of positions per key in one gather; the map has four positions per slot or more,
  so a probe almost always ends inside the first window.
- The same map answers clients' reports by digest (`lookup_digests`): the digest is the
  one they looked up, so no second map is kept.
- Identity is exact, so no chunk is ever taken for another ("never load wrong KV"): a
  digest only says where to look. Each slot keeps its key in a fixed field of `KEY_WIDTH`
  bytes with its length (vLLM's keys are 32-byte hashes, a few bytes more with a suffix),
  compared for the whole batch at once; a longer key keeps a blake2b digest of itself in the
  field and the key itself aside (`_long`), compared in full where the field matches.
- Columns are numpy arrays, read and written for the batch by slot numbers; only the map's
  positions and digests, walked one position at a time when a chunk is placed or removed,
  are `array`s seen by numpy through views of the same memory.
- What stays per chunk is what has a chunk to act on: the policy's order (LRU relinks a
  batch's hits in one loop, after the reply, at `touch`), the event log, publication in
  the table and eviction. A policy that names chunks by key (ARC and prefix remember
  chunks after they left) is also given a dict from key to slot, which LRU does without.

The key field is most of a slot's bytes (41 of about 90, besides the map's 16 to 32 and
LRU's 8): what makes identity exact, and names a chunk (events, evictions, stats) without
reading the pool's slot header.
"""

from __future__ import annotations

import itertools
from array import array
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple, cast

import numpy as np
import numpy.typing as npt

from kvtier.agent.chunk import ChunkHeader, SlotState
from kvtier.agent.host.events import ChunkEvents
from kvtier.agent.host.policy import ChunkId, EvictionPolicy
from kvtier.agent.host.slots import (
    KEY_WIDTH,
    LONG,
    WORDS,
    FreeSlots,
    KeyBatch,
    Mask,
    RestingSlots,
    SlotMap,
    Slots,
)
from kvtier.client.protocol import StoreCode, Where
from kvtier.shm.table import U64, TableWriter


class LeaseError(ValueError):
    """A lease that is unknown (expired, or granted by an earlier agent process), held by
    another client, or of the other kind."""


ChunkKey = tuple[str, bytes]
# A slot's state is the one its header in the pool carries (`SlotState`): the agent makes a
# chunk readable and writes its SEALED header in one step under its lock. As plain ints,
# which numpy stores and compares without consulting the enum.
_FREE, _WRITING, _SEALED = int(SlotState.FREE), int(SlotState.WRITING), int(SlotState.SEALED)


class Entry:
    """The chunk in one slot, read from the index's columns. Entries are used only while
    their chunk holds the slot (pinned, or within one call under the agent's lock): a view
    does not notice its slot going to another chunk."""

    __slots__ = ("_index", "generation", "slot")

    def __init__(self, index: HostIndex, slot: int) -> None:
        self._index = index
        self.slot = slot
        self.generation = int(index._generation[slot])  # the slot's stamp for this chunk

    @property
    def id(self) -> ChunkKey:
        return self._index.key_at(self.slot)

    @property
    def hits(self) -> int:
        return int(self._index._hits[self.slot])

    @property
    def length(self) -> int:
        return int(self._index._length[self.slot])

    @length.setter
    def length(self, value: int) -> None:
        self._index._length[self.slot] = value

    @property
    def checksum(self) -> int | None:
        """Set once the bytes are complete and checksummed: by the host tier where it seals
        the chunk (an index used without a pool, as by trace replays, leaves it unset)."""
        index = self._index
        return int(index._checksum[self.slot]) if index._summed[self.slot] else None

    @checksum.setter
    def checksum(self, value: int) -> None:
        self._index._checksum[self.slot] = value
        self._index._summed[self.slot] = 1

    def header(self) -> ChunkHeader:
        checksum = self.checksum
        assert checksum is not None, "only a sealed chunk has a full header"
        namespace, key = self.id
        return ChunkHeader(namespace, key, self.length, checksum)


class Grant(NamedTuple):
    """What a store or a load was granted: the lease (0 when no slot was), per key a slot or
    the code saying why none (`StoreCode` for a store, `Where.MISS` for a load), each
    granted slot's generation, the stamp it carries while the lease holds (0 for no slot),
    and for a store through the host tier, per key the staging slot the client writes its
    chunk into (-1 for none; the index itself grants none)."""

    lease: int
    slots: list[int]
    generations: list[int]
    staging: tuple[int, ...] = ()


@dataclass(eq=False)
class Lease:
    id: int
    client: str
    kind: Literal["store", "load"]
    slots: Slots  # one per chunk held (a slot twice where a load named a key twice)
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
        self._resting = RestingSlots()
        # Per slot, meaningful while its state is not FREE.
        self._state = np.zeros(slot_count, np.uint8)
        self._namespace = np.zeros(slot_count, np.uint32)  # its namespace's number
        self._key = np.zeros((slot_count, WORDS), np.uint64)  # its key field (`key_field`)
        self._key_bytes = self._key.data.cast("B")
        self._key_length = np.zeros(slot_count, np.uint8)  # LONG: see `_long`
        self._pins = np.zeros(slot_count, np.int32)
        self._hits = np.zeros(slot_count, np.uint32)  # wraps after 2^32 hits of one chunk
        self._length = np.zeros(slot_count, np.uint64)
        self._checksum = np.zeros(slot_count, np.uint64)
        self._summed = np.zeros(slot_count, np.uint8)
        self._published = np.zeros(slot_count, np.uint8)  # in the table under its digest
        self._generation = np.zeros(slot_count, np.uint64)
        self._digests = array("Q", [0]) * slot_count  # its `shm_index.digest`
        self._chunks = SlotMap(slot_count, self._digests)
        self._long: dict[int, bytes] = {}  # slot -> a key longer than KEY_WIDTH
        self._numbers: dict[str, int] = {}
        self._names: list[str] = []  # by number
        self._by_slot = policy.by_slot
        # For a policy that names chunks by key: each slot's name for it, the very tuple the
        # policy keeps, and the slot of each name.
        self._ids: list[ChunkKey | None] = [] if self._by_slot else [None] * slot_count
        self._slot_by_key: dict[ChunkKey, int] = {}
        self._free = FreeSlots(slot_count)
        # Slots of chunks removed while pinned: out of every lookup, back to use at last unpin.
        self._withdrawn: set[int] = set()
        self._leases: dict[int, Lease] = {}
        self._lease_ids = itertools.count((boot << 32) + 1)
        self._next_generation = (boot << 32) + 1
        self._pending_hits: list[tuple[Slots, npt.NDArray[np.uint64]]] = []  # slots, stamps
        self._touched: list[Slots] = []
        self.counters = IndexCounters()
        self.events = ChunkEvents()

    # --- queries -------------------------------------------------------------------------

    def get(self, namespace: str, key: bytes) -> Entry | None:
        return self.entries(namespace, [key])[0]

    def entries(self, namespace: str, keys: list[bytes]) -> list[Entry | None]:
        """`get` for many keys in one pass."""
        slots = self._slots(namespace, keys).tolist()
        return [Entry(self, slot) if slot >= 0 else None for slot in slots]

    def sealed(self, slots: list[int]) -> list[tuple[int, int] | None]:
        """The length and checksum of the chunk in each of `slots` (leased, so still its
        chunk's; -1 for none), None where a slot has no checksum yet: the columns read once
        for all of them, not an entry per chunk."""
        wanted = np.asarray(slots, np.int64)
        safe = np.where(wanted >= 0, wanted, 0)
        summed = ((self._summed[safe] == 1) & (wanted >= 0)).tolist()
        lengths, checksums = self._length[safe].tolist(), self._checksum[safe].tolist()
        return [
            (length, checksum) if ok else None
            for length, checksum, ok in zip(lengths, checksums, summed, strict=True)
        ]

    def key_at(self, slot: int) -> ChunkKey:
        """The namespace and key of the chunk in `slot`."""
        if self._state[slot] == _FREE:
            raise LookupError(f"slot {slot} holds no chunk")
        return self._names[int(self._namespace[slot])], self._keys_at([slot])[0]

    def lookup(
        self, namespace: str, keys: list[bytes], hashes: U64 | None = None
    ) -> tuple[list[bool], int]:
        """Per-key hits and the length of the longest all-hit prefix (`hashes`: the keys'
        digests, where the caller has them already).

        The policy learns of the hits only at `touch`, which the agent calls after it has
        answered, so the eviction order's upkeep stays out of the lookup's latency.
        """
        hits = self._count_lookup(self._ready_slots(namespace, keys, hashes))
        misses = np.flatnonzero(~hits)
        return hits.tolist(), int(misses[0]) if misses.size else len(keys)

    def lookup_digests(self, namespace: str, digests: U64) -> list[bool]:
        """`lookup` by index digests (what clients report of the lookups they answered
        from the published table): the hits are the chunks published under them now."""
        number = self._numbers.get(namespace)

        def published(slots: Slots, rows: Slots) -> Mask:
            alike: Mask = (self._namespace[slots] == number) & (self._published[slots] == 1)
            return alike

        found = (
            np.full(len(digests), -1, np.int64)
            if number is None
            else self._chunks.find(digests, published)
        )
        hits: list[bool] = self._count_lookup(found).tolist()
        return hits

    def touch(self) -> None:
        """Tell the policy about the hits of lookups answered since the last call and raise
        the chunks' hit counts; the slots wait for `take_touched`. A hit whose chunk left its
        slot meanwhile is dropped (the generation tells)."""
        if not self._pending_hits:
            return
        slots = np.concatenate([slots for slots, _ in self._pending_hits])
        stamps = np.concatenate([stamps for _, stamps in self._pending_hits])
        self._pending_hits.clear()
        held = (self._state[slots] == _SEALED) & (self._generation[slots] == stamps)
        slots = slots[held]
        if not slots.size:
            return
        np.add.at(self._hits, slots, 1)
        self.policy.on_hits(self._chunk_ids(slots.tolist()))
        self._touched.append(slots)

    def take_touched(self) -> list[Entry]:
        """Entries hit since the last call (once per hit), whether `touch` ran after a reply
        or before an eviction needed the current order."""
        self.touch()
        touched = [Entry(self, slot) for slots in self._touched for slot in slots.tolist()]
        self._touched.clear()
        return touched

    def missing(self, namespace: str, keys: list[bytes]) -> list[bytes]:
        """Keys not readable from the pool, without counting a lookup."""
        slots = self._ready_slots(namespace, keys).tolist()
        return [key for key, slot in zip(keys, slots, strict=True) if slot < 0]

    def ready_keys(self) -> dict[str, set[bytes]]:
        """Every sealed chunk's key, by namespace."""
        held: dict[str, set[bytes]] = {}
        for slot in np.flatnonzero(self._state == _SEALED).tolist():
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
        return int(np.count_nonzero(self._pins))

    # --- store ---------------------------------------------------------------------------

    def allocate(
        self,
        client: str,
        namespace: str,
        keys: list[bytes],
        length: int,
        deadline: float,
        parents: list[bytes | None] | None = None,
        limit: int | None = None,
    ) -> Grant:
        """Reserve a slot per new key for `client` to write.

        Keys already held or being written get EXISTS/BUSY instead of a slot, so duplicate
        stores cost one round trip and no copy; new keys past the first `limit` get
        STAGING_FULL (the host tier's staging slots free right now). `parents`, where the
        store names them, are each key's predecessor in its request, told to the policy
        (`PrefixPolicy`) before the store evicts anything.
        """
        batch = KeyBatch.of(self._number(namespace), namespace, keys)
        held = self._find(batch).tolist()
        if parents is not None:
            self._note_parents(namespace, keys, parents, held)
        slots = self._place(batch, held, limit)
        granted = [i for i, slot in enumerate(slots) if slot >= 0]
        if not granted:
            return Grant(0, slots, [0] * len(keys))
        rows = np.array(granted, np.int64)
        taken = np.array([slots[i] for i in granted], np.int64)
        self._hold(taken, batch, rows, self._next_generation, length)
        self._next_generation += len(granted)
        if self.policy.links_slots:
            self._link(namespace, granted, taken, parents)
        generations = [0] * len(keys)
        for i, generation in zip(granted, self._generation[taken].tolist(), strict=True):
            generations[i] = generation
        return Grant(self._new_lease(client, "store", taken, deadline), slots, generations)

    def _note_parents(
        self, namespace: str, keys: list[bytes], parents: list[bytes | None], slots: list[int]
    ) -> None:
        """Tell the policy each key's predecessor in its request (None where the store did
        not name one), for the keys not held yet (`slots` < 0): what a store is about to
        add. A policy that names chunks by slot is not told: a parent need not be in the
        pool."""
        if len(parents) != len(keys):
            raise ValueError(f"{len(parents)} parents for {len(keys)} keys")
        if self._by_slot or all(p is None for p in parents):
            return
        self.policy.on_parents(
            [
                ((namespace, key), None if parent is None else (namespace, parent))
                for key, parent, slot in zip(keys, parents, slots, strict=True)
                if slot < 0
            ]
        )

    def _link(
        self, namespace: str, granted: list[int], taken: Slots, parents: list[bytes | None] | None
    ) -> None:
        """Tell a policy of slots that keeps the prefix tree each granted slot's parent's
        slot (-1: unnamed, or not in the pool; a parent this store writes counts)."""
        named = [] if parents is None else [parents[i] for i in granted]
        if not any(p is not None for p in named):
            self.policy.on_links(taken.tolist(), [-1] * len(granted))
            return
        found = iter(self._slots(namespace, [p for p in named if p is not None]).tolist())
        self.policy.on_links(taken.tolist(), [-1 if p is None else next(found) for p in named])

    def commit(
        self, lease_id: int, client: str, keep: Callable[[Entry], bool] | None = None
    ) -> list[Entry]:
        """Make a store lease's chunks readable; returns them for sealing. A chunk `keep`
        refuses (its slot was written over) is dropped before anyone can see it."""
        lease = self._take(lease_id, client, "store")
        self._pins[lease.slots] -= 1  # a store's slots are distinct
        kept = [Entry(self, slot) for slot in lease.slots.tolist()]
        if keep is not None:
            for entry in [e for e in kept if not keep(e)]:
                self._vacate(entry.slot)
                self._free.append(entry.slot)
                kept.remove(entry)
        self._make_ready(self._names[int(self._namespace[lease.slots[0]])], [e.slot for e in kept])
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
        return [Entry(self, slot) for slot in lease.slots.tolist()]

    def abort(self, lease_id: int, client: str) -> None:
        self._release(self._take(lease_id, client, "store"))

    # --- load ----------------------------------------------------------------------------

    def begin_load(self, client: str, namespace: str, keys: list[bytes], deadline: float) -> Grant:
        """Pin the ready chunks among `keys` for reading; MISS for the others."""
        slots = self._ready_slots(namespace, keys)
        hit = slots >= 0
        pinned = slots[hit]
        generations = np.where(hit, self._generation[slots], 0)
        listed = np.where(hit, slots, int(Where.MISS)).tolist()
        if not pinned.size:
            return Grant(0, listed, generations.tolist())
        np.add.at(self._pins, pinned, 1)
        lease = self._new_lease(client, "load", pinned, deadline)
        return Grant(lease, listed, generations.tolist())

    def lease_bytes(self, lease_id: int) -> int:
        lease = self._leases.get(lease_id)
        return int(self._length[lease.slots].sum()) if lease else 0

    def end_load(self, lease_id: int, client: str) -> None:
        self._release(self._take(lease_id, client, "load"))

    # --- maintenance ---------------------------------------------------------------------

    def pin(self, entry: Entry) -> None:
        self._pins[entry.slot] += 1

    def unpin(self, entry: Entry) -> None:
        self._pins[entry.slot] -= 1
        if self._withdrawn:
            self._return_withdrawn([entry.slot])

    def adopt(self, header: ChunkHeader, slot: int, generation: int) -> Entry:
        """Index a verified chunk found in the pool after a restart, keeping its slot's
        generation (readers of the earlier agent process may still be copying it)."""
        self._free.remove(slot)
        batch = KeyBatch.of(self._number(header.namespace), header.namespace, [header.key])
        self._hold(np.array([slot]), batch, np.zeros(1, np.int64), generation, header.length)
        if self.policy.links_slots:
            self.policy.on_links([slot], [-1])
        self._pins[slot] = 0
        entry = Entry(self, slot)
        entry.checksum = header.checksum
        self._make_ready(header.namespace, [slot])
        return entry

    def holds(self, entry: Entry) -> bool:
        """Whether `entry`'s slot still holds its chunk, sealed: the slot has not gone to
        another chunk (a new generation), nor been vacated, since the entry was read."""
        slot = entry.slot
        return bool(self._state[slot] == _SEALED and self._generation[slot] == entry.generation)

    def remove(self, entry: Entry) -> None:
        """Drop a ready chunk (it failed verification). It leaves every lookup now, pinned
        or not: a pin is a reader still copying it (a peer's transfer, a write-back), which
        must not make a damaged chunk servable again. A pinned slot goes back to use when
        its last pin ends, so no reader sees its bytes change under it."""
        slot = entry.slot
        if self._state[slot] != _SEALED:
            return
        self.policy.on_remove(self._chunk_id(slot))
        self._forget(slot)
        if self._pins[slot]:
            self._withdrawn.add(slot)
        else:
            self._free.append(slot)

    def _return_withdrawn(self, slots: list[int]) -> None:
        """Put back to use the withdrawn slots among `slots` that no pin holds any more."""
        for slot in slots:
            if slot in self._withdrawn and not self._pins[slot]:
                self._withdrawn.discard(slot)
                self._free.append(slot)

    def rest(self, slot: int, until: float) -> None:
        """Keep a free slot out of use until `until`: a writer may still copy into it."""
        self._free.remove(slot)
        self._resting.add(slot, until)

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
        for slot in self._resting.due(now):
            self._free.append(slot)
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
        self, client: str, kind: Literal["store", "load"], slots: Slots, deadline: float
    ) -> int:
        lease = Lease(next(self._lease_ids), client, kind, slots, deadline)
        self._leases[lease.id] = lease
        return lease.id

    def _release(self, lease: Lease, rest_until: float | None = None) -> None:
        """End a lease. An unfinished write is worthless: its slot goes back, to rest until
        `rest_until` when its writer may still be copying (the lease expired)."""
        np.subtract.at(self._pins, lease.slots, 1)
        if lease.kind == "load":
            if self._withdrawn:
                self._return_withdrawn(lease.slots.tolist())
            return
        for slot in lease.slots.tolist():
            self._vacate(slot)
            if rest_until is None:
                self._free.append(slot)
            else:
                self._resting.add(slot, rest_until)

    def _number(self, namespace: str) -> int:
        """The namespace's number, given it on first sight."""
        number = self._numbers.get(namespace)
        if number is None:
            number = self._numbers[namespace] = len(self._names)
            self._names.append(namespace)
        return number

    def _slots(self, namespace: str, keys: list[bytes], hashes: U64 | None = None) -> Slots:
        """Each key's slot (its chunk ready or being written), else -1."""
        number = self._numbers.get(namespace)
        if number is None:
            return np.full(len(keys), -1, np.int64)
        return self._find(KeyBatch.of(number, namespace, keys, hashes))

    def _ready_slots(self, namespace: str, keys: list[bytes], hashes: U64 | None = None) -> Slots:
        """Each key's slot where its chunk is ready to read, else -1."""
        slots = self._slots(namespace, keys, hashes)
        return np.where(self._state[slots] == _SEALED, slots, -1)

    def _find(self, batch: KeyBatch) -> Slots:
        """Each key's slot, else -1: the map's candidates, confirmed by namespace and key."""

        def same(slots: Slots, rows: Slots) -> Mask:
            alike: Mask = (
                (self._namespace[slots] == batch.number)
                & (self._key_length[slots] == batch.lengths[rows])
                & (self._key[slots] == batch.words[rows]).all(axis=1)
            )
            if batch.long:  # a digest in the field: the keys themselves decide
                for i in np.flatnonzero(alike & (batch.lengths[rows] == LONG)).tolist():
                    alike[i] = self._long[int(slots[i])] == batch.keys[int(rows[i])]
            return alike

        return self._chunks.find(batch.hashes, same)

    def _place(self, batch: KeyBatch, held: list[int], limit: int | None) -> list[int]:
        """A slot for each key of a store not held (`held`: where each key was before the
        store), at most `limit` of them, else its code: EXISTS, BUSY (being written, by this
        store too), STAGING_FULL (past the limit) or FULL. A chunk evicted for an earlier key
        of the batch counts as not held."""
        state, name = self._state, self._names[batch.number]
        placed: dict[bytes, int] = {}
        given: set[int] = set()  # a key found in one of these was evicted for this store
        out: list[int] = []
        for key, slot in zip(batch.keys, held, strict=True):
            if slot in given:
                slot = -1
            if slot < 0 and key in placed:
                slot = placed[key]
            if slot >= 0:
                out.append(StoreCode.EXISTS if state[slot] == _SEALED else StoreCode.BUSY)
                continue
            if limit is not None and len(given) >= limit:
                out.append(StoreCode.STAGING_FULL)
                continue
            got = self._free.pop() if self._free else self._evict((name, key))
            if got is None:
                self.counters.full += 1
                out.append(StoreCode.FULL)
                continue
            given.add(got)
            placed[key] = got
            out.append(got)
        return out

    def _count_lookup(self, slots: Slots) -> Mask:
        """Count a lookup that found the chunks in `slots` (-1: a miss) and keep its hits
        for `touch`."""
        hits: Mask = slots >= 0
        found = slots[hits]
        if found.size:
            self._pending_hits.append((found, self._generation[found]))
        self.counters.lookups += len(slots)
        self.counters.hits += int(found.size)
        return hits

    def _chunk_id(self, slot: int) -> ChunkId:
        """What the policy calls the chunk in `slot`."""
        return slot if self._by_slot else cast(ChunkKey, self._ids[slot])

    def _chunk_ids(self, slots: list[int]) -> Sequence[ChunkId]:
        return slots if self._by_slot else [self._ids[slot] for slot in slots]

    def _slot_of(self, chunk: ChunkId) -> int:
        """The slot of a chunk the policy names."""
        return cast(int, chunk) if self._by_slot else self._slot_by_key[cast(ChunkKey, chunk)]

    def _evictable(self, chunk: ChunkId) -> bool:
        return not self._pins[self._slot_of(chunk)]

    def _evict(self, incoming: ChunkKey) -> int | None:
        """Free a slot for `incoming` by evicting the chunk the policy chooses."""
        if self._pending_hits:
            self.touch()
        victim = self.policy.evict(self._evictable, None if self._by_slot else incoming)
        if victim is None:
            return None
        slot = self._slot_of(victim)
        self._forget(slot)
        self.counters.evictions += 1
        return slot

    def _hold(self, slots: Slots, batch: KeyBatch, rows: Slots, first: int, length: int) -> None:
        """Give free slots to the batch's keys in `rows`, to be written: generations from
        `first` on, pinned by the store."""
        self._state[slots] = _WRITING
        self._namespace[slots] = batch.number
        self._key[slots] = batch.words[rows]
        self._key_length[slots] = batch.lengths[rows]
        self._generation[slots] = np.arange(first, first + len(slots), dtype=np.uint64)
        self._length[slots] = length
        self._pins[slots] = 1
        self._hits[slots] = self._summed[slots] = self._published[slots] = 0
        hashes = batch.hashes[rows].tolist()
        name = self._names[batch.number]
        for slot, row, digest in zip(slots.tolist(), rows.tolist(), hashes, strict=True):
            self._digests[slot] = digest
            self._chunks.add(slot)
            if batch.long and batch.lengths[row] == LONG:
                self._long[slot] = batch.keys[row]
            if not self._by_slot:
                chunk = self._ids[slot] = (name, batch.keys[row])
                self._slot_by_key[chunk] = slot

    def _vacate(self, slot: int) -> None:
        """Take a chunk out of its slot, which is free from then on."""
        if not self._by_slot:
            del self._slot_by_key[cast(ChunkKey, self._ids[slot])]
            self._ids[slot] = None
        self._chunks.discard(slot)
        self._long.pop(slot, None)
        self._state[slot] = _FREE

    def _keys_at(self, slots: list[int]) -> list[bytes]:
        """The key of the chunk in each of `slots`."""
        held, long = self._key_bytes, self._long
        return [
            long[slot] if length == LONG else held[slot * KEY_WIDTH :][:length].tobytes()
            for slot, length in zip(slots, self._key_length[slots].tolist(), strict=True)
        ]

    def _make_ready(self, namespace: str, slots: list[int]) -> None:
        """Make written chunks of `namespace` readable: ordered by the policy, logged,
        published."""
        if not slots:
            return
        keys = self._keys_at(slots)
        self._state[slots] = _SEALED
        self.policy.on_inserts(self._chunk_ids(slots))
        self.counters.namespaces[namespace] += len(slots)
        for key in keys:
            self.events.record(namespace, key, removed=False)
        if self.table is None:
            return
        put, published = self.table.put, self._published
        for slot, generation in zip(slots, self._generation[slots].tolist(), strict=True):
            if put(self._digests[slot], slot, generation):
                published[slot] = 1

    def _forget(self, slot: int) -> None:
        """A ready chunk leaves the pool: withdrawn from the table before its slot can go to
        another chunk."""
        namespace, key = self.key_at(slot)
        if self._published[slot]:
            if self.table is not None:
                self.table.remove(self._digests[slot])
            self._published[slot] = 0
        self._vacate(slot)
        self.events.record(namespace, key, removed=True)
        self.counters.namespaces[namespace] -= 1
        if not self.counters.namespaces[namespace]:
            del self.counters.namespaces[namespace]
