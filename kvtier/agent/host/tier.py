"""The host-memory tier: the shared pool, its index, and the sealing of committed chunks.

Bytes altered in the pool after sealing are never served because no client can alter them:
clients map the pool read-only (the file is the agent's to write, its group's to read) and
write what they store into a staging area beside it. At commit the agent copies each staged
chunk into its pool slot and computes its checksum while the bytes are hot (block by block,
each block hashed right after it is copied), then seals and publishes it. Loads therefore
copy straight out of the pool with no check on the way; the checksums serve re-indexing
after a restart and every copy that leaves the node (secondary tiers, peers).

Each slot handed to a chunk gets the chunk's header (WRITING, naming namespace and key) and
a new generation stamp when it is allocated; a commit publishes only slots that still carry
both, and a reader checks the stamp after copying (see pool.py). A staging slot goes back
when its store is committed or aborted, and rests first when its lease expired (its writer
may still be copying into it).

Promotions from secondary tiers hold at most a quarter of the pool at once: a tier that
hangs mid-read keeps its reserved slots until the read ends, and without a cap a few stuck
reads would evict every chunk clients can use.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import xxhash

from kvtier.agent.chunk import ChunkHeader, SlotState, checksum
from kvtier.agent.host.events import EventBatch
from kvtier.agent.host.index import Entry, Grant, HostIndex
from kvtier.agent.host.policy import make_policy
from kvtier.agent.host.resize import open_pool
from kvtier.agent.host.slots import RestingSlots
from kvtier.agent.report.metrics import AgentMetrics
from kvtier.api.config import HostTierConfig
from kvtier.api.pool_layout import (
    PoolGeometry,
    pool_geometry,
    staging_geometry,
)
from kvtier.api.stats import HostStats, StoreSkip, StoreSkips, Tally
from kvtier.client.protocol import StoreCode
from kvtier.shm.files import claim, close_directory
from kvtier.shm.pool import (
    SUM_CRC32,
    SUM_LANES,
    copy_summed,
    lent_stamps,
    open_staging,
    staging_path,
    trim,
)
from kvtier.shm.table import U64, TableWriter, index_path

log = logging.getLogger("kvtier.agent.host")

TIER = "host"
# Holders of the agent's own leases; ':' is never part of a client id (see protocol.py).
PROMOTER = "agent:promoter"  # slots being filled from a secondary tier
LENDER = "agent:peer"  # chunks being sent to other agents
# How far ahead of now a staging slot's deadline is believed (and stamped): a stamp further
# out is from before the node's clock restarted, or written by a client of the tier, and
# would keep its slot from being lent, and a shrunk area's tail from being cut, for as long.
_LONGEST_DEADLINE = 600.0
# FULL is the index's own count
_SKIP_REASONS: dict[int, StoreSkip] = {
    StoreCode.EXISTS: "exists",
    StoreCode.BUSY: "busy",
    StoreCode.STAGING_FULL: "staging",
}
# A sealed chunk to check again: its entry, length and checksum, read under the lock.
_Check = tuple[Entry, int, int]


class HostTier:
    def __init__(
        self,
        config: HostTierConfig,
        pool_path: Path,
        metrics: AgentMetrics,
        lease_seconds: float,
        boot: int = 0,
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.lease_seconds = lease_seconds
        geometry = pool_geometry(config.capacity, config.chunk_bytes)
        close_directory(pool_path.parent)
        for path in (pool_path, staging_path(pool_path), index_path(pool_path)):
            for owner in claim(path):
                log.warning("removed %s, made by uid %d and not by this agent", path, owner)
        self.pool, opened = open_pool(pool_path, geometry, populate=config.prefault)
        staging = staging_geometry(geometry)
        # A staging slot's stamp is its lease's deadline (ns on CLOCK_MONOTONIC, which every
        # process of the node shares), 0 once it is free again: slots an earlier agent had
        # lent may still be written by its clients, so each rests until a lease's length
        # past that deadline, as a lease that expires under a living agent does; a shrunk
        # area or pool keeps its tail until the last of those rests ends (see pool.trim),
        # since a writer still copying into a cut tail would die of SIGBUS.
        lent = lent_stamps(staging_path(pool_path), staging)
        self.staging = open_staging(staging_path(pool_path), staging, populate=config.prefault)
        now, clock = time.monotonic(), time.monotonic_ns()
        self._staging_resting = RestingSlots()
        self._trim_at: float | None = now + lease_seconds
        for slot in np.flatnonzero(lent).tolist():
            ahead = min(max(int(lent[slot]) - clock, 0) / 1e9, _LONGEST_DEADLINE)
            until = now + ahead + lease_seconds
            self._trim_at = max(self._trim_at, until)
            if slot < staging.slot_count:
                self._staging_resting.add(slot, until)
        unlent = np.flatnonzero(self.staging.generations() == 0)  # grown slots read 0
        self._staging_free = [int(slot) for slot in unlent[::-1]]
        self._staged: dict[int, dict[int, int]] = {}  # store lease -> pool slot -> staging slot
        # Clients read it to answer lookups themselves; a fresh one per agent process (the
        # one it replaces is marked retired, so its readers reconnect).
        self.table = TableWriter(index_path(pool_path), geometry.slot_count, boot)
        self._index = HostIndex(
            geometry.slot_count,
            make_policy(config.policy, geometry.slot_count),
            boot,
            rest_seconds=lease_seconds,
            table=self.table,
        )
        self._lock = threading.Lock()
        self._promoting = 0  # slots reserved by promotions in flight (lock held)
        self._max_promoting = max(1, geometry.slot_count // 4)
        # Called with the lock held: after a chunk is sealed, and with the entries that
        # lookups hit. The secondary tiers use them to queue write-backs.
        self._on_sealed: Callable[[Entry], None] | None = None
        self._on_hits: Callable[[list[Entry]], None] | None = None
        self.corrupt = 0
        if opened.warm:
            self._reindex()
        # Copies of committed chunks into the pool, and checks of chunks a peer received
        # damaged, spread over the cores (numpy's copies, its sums and xxh3 release the GIL).
        self._copiers = ThreadPoolExecutor(os.cpu_count() or 1, thread_name_prefix="kvtier-copy")
        self._store_bytes = metrics.store_bytes.labels(TIER)
        self._load_bytes = metrics.load_bytes.labels(TIER)
        self._skipped: Tally[StoreSkips] = Tally(StoreSkips())
        self._bind_gauges()

    @property
    def geometry(self) -> PoolGeometry:
        return self.pool.geometry

    # --- the interface the agent's other parts use (no other module takes the lock or
    # reads the index; tests/test_architecture.py checks it) ------------------------------

    def subscribe(
        self, on_sealed: Callable[[Entry], None], on_hits: Callable[[list[Entry]], None]
    ) -> None:
        """Called with the tier's lock held: after a chunk is sealed, and with the entries
        lookups hit. The secondary tiers use them to queue write-backs, pinning what they
        queue with `pin_locked`."""
        self._on_sealed, self._on_hits = on_sealed, on_hits

    def pin_locked(self, entry: Entry) -> None:
        """Keep `entry`'s slot from reuse; only from a `subscribe` callback (lock held)."""
        self._index.pin(entry)

    def unpin(self, entry: Entry) -> None:
        with self._lock:
            self._index.unpin(entry)

    def events_since(self, namespace: str, after: int) -> EventBatch:
        """Chunks stored and evicted in `namespace` since event `after`."""
        with self._lock:
            return self._index.events.since(namespace, after)

    def held(self) -> dict[str, set[bytes]]:
        """Every sealed chunk's key, by namespace (a restarted agent's warm pool)."""
        with self._lock:
            return self._index.ready_keys()

    def sealed_headers(
        self, namespace: str, keys: list[bytes], slots: list[int]
    ) -> list[ChunkHeader | None]:
        """The headers of the sealed chunks a load leased (slot >= 0); None for the others."""
        with self._lock:
            sealed = self._index.sealed(slots)
        return [
            ChunkHeader(namespace, key, *found) if found is not None else None
            for key, found in zip(keys, sealed, strict=True)
        ]

    # --- requests (called by the server loop) ----------------------------------------------

    def lookup(self, namespace: str, keys: list[bytes], hashes: U64) -> tuple[list[bool], int]:
        """`hashes`: the keys' digests (the server logs the request by them too)."""
        with self._lock:
            return self._index.lookup(namespace, keys, hashes)

    def lookup_digests(self, namespace: str, digests: U64) -> list[bool]:
        """Lookups a client answered from the published index, by digest: counted, and
        the hits' recency refreshed, as if answered here."""
        with self._lock:
            hits = self._index.lookup_digests(namespace, digests)
            # now, not after the reply: a report carries several requests, and each must
            # reach the policy and the write-back admission as a lookup of its own
            self._hits_seen_locked()
        return hits

    def _hits_seen_locked(self) -> None:
        """The entries lookups hit since last time, to the policy's subscriber (lock held)."""
        touched = self._index.take_touched()
        if touched and self._on_hits is not None:
            self._on_hits(touched)

    def count_loaded(self, nbytes: int) -> None:
        """Bytes clients loaded from the pool without a lease (reported with lookups)."""
        if nbytes:
            self._load_bytes.inc(nbytes)

    def after_reply(self) -> None:
        """Bookkeeping that need not delay an answer: the policy's view of recent hits. The
        server calls it after each reply, before the next request."""
        with self._lock:
            self._hits_seen_locked()

    def allocate(
        self,
        client: str,
        namespace: str,
        keys: list[bytes],
        nbytes: int,
        parents: list[bytes | None] | None = None,
    ) -> Grant:
        """Reserve a pool slot and a staging slot per new key. Keys past the staging slots
        free right now get STAGING_FULL: the client stores them again once its earlier
        stores are committed. `parents`: each key's predecessor in its request, noted for the
        prefix policy before the store evicts anything."""
        if not 0 < nbytes <= self.geometry.payload_bytes:
            raise ValueError(
                f"nbytes {nbytes} does not fit a slot of {self.geometry.payload_bytes} bytes; "
                "the engine's row size must match the agent's host.chunkBytes"
            )
        staging = [-1] * len(keys)
        ahead = int(min(self.lease_seconds, _LONGEST_DEADLINE) * 1e9)
        with self._lock:
            deadline_ns = time.monotonic_ns() + ahead  # the staging slots' stamp
            lease, slots, generations, _ = self._index.allocate(
                client,
                namespace,
                keys,
                nbytes,
                time.monotonic() + self.lease_seconds,
                parents,
                limit=len(self._staging_free),
            )
            staged: dict[int, int] = {}
            for i, (slot, generation) in enumerate(zip(slots, generations, strict=True)):
                if slot >= 0:
                    self._claim(slot, namespace, keys[i], generation)
                    staging[i] = staged[slot] = self._staging_free.pop()
                    self.staging.set_generation(staging[i], deadline_ns)
            if lease:
                self._staged[lease] = staged
        for slot in slots:
            if slot in _SKIP_REASONS:
                self._skipped.add(_SKIP_REASONS[slot])
        return Grant(lease, slots, generations, tuple(staging))

    def commit(
        self,
        lease: int,
        client: str,
        staged_sums: list[int] | None = None,
        kinds: bytes = b"",
    ) -> None:
        """Copy a store lease's staged chunks into their pool slots, checksumming each block
        while it is hot, then seal and publish them: once this returns every client finds
        them, and no client can alter them. A slot whose header or generation is not the
        one its allocation wrote is dropped and counted, never published; so is one whose
        copy's staging sum is not the one its client made of the row it staged
        (`staged_sums`, in the grant's order of granted keys, each of its kind in `kinds`,
        all lane sums where empty; see shm/pool.py): the staging
        area is the tier group's to write, and bytes another process wrote into a client's
        staging slot meanwhile become a miss, not a chunk."""
        with self._lock:
            entries = self._index.begin_commit(lease, client)
            staged = self._staged.get(lease, {})
        try:
            expected: dict[int, int] | None = None
            kind_of = dict.fromkeys(staged, SUM_LANES)
            if kinds and staged_sums is None:
                raise ValueError("commit names sum kinds but no sums; send both, or neither")
            if staged_sums is not None:
                if len(staged_sums) != len(staged):
                    raise ValueError(
                        f"commit names {len(staged_sums)} staging sums for the {len(staged)} "
                        "chunks its lease staged; send one per granted key, in order"
                    )
                if kinds and (len(kinds) != len(staged) or max(kinds) > SUM_CRC32):
                    raise ValueError(
                        f"commit names {len(kinds)} sum kinds for {len(staged)} staging sums "
                        f"(each {SUM_LANES} or {SUM_CRC32}); send one per sum, or none"
                    )
                expected = dict(zip(staged, staged_sums, strict=True))
                if kinds:
                    kind_of.update(zip(staged, kinds, strict=True))
            work = [(e.slot, staged[e.slot], e.length, kind_of[e.slot]) for e in entries]
            digests: dict[int, int] = {}
            sums: dict[int, int] = {}
            for slot, (digest, summed) in self._copiers.map(
                lambda w: (w[0], self._copy_in(*w)), work
            ):
                digests[slot], sums[slot] = digest, summed
        except BaseException:
            with self._lock:
                self._index.abort(lease, client)
                self._free_staging(lease)
            raise

        def claimed(entry: Entry) -> bool:
            ns, key = entry.id
            header = ChunkHeader.unpack(self.pool.header(entry.slot).data)
            if (
                header == ChunkHeader(ns, key, 0, 0, SlotState.WRITING)
                and self.pool.generation(entry.slot) == entry.generation
            ):
                if expected is None or expected[entry.slot] == sums[entry.slot]:
                    return True
                self._count_corrupt(
                    f"slot {entry.slot}: its staged bytes changed after its client wrote them"
                )
                return False
            self._count_corrupt(f"slot {entry.slot} was overwritten during its store")
            return False

        with self._lock:
            self._free_staging(lease)
            kept = self._index.commit(lease, client, claimed)
            for entry in kept:
                self._seal(entry, digests[entry.slot])
        self._store_bytes.inc(sum(e.length for e in kept))

    def _copy_in(self, slot: int, staged: int, length: int, kind: int) -> tuple[int, int]:
        """Copy a staged chunk into its pool slot and return its checksum and its staging
        sum of `kind` (what its client's is compared with), each block hashed and summed
        right after it is copied, from cache (xxh3 streams: the same digest as one pass over
        the whole chunk)."""
        digest = xxhash.xxh3_64()
        summed = copy_summed(
            self.pool.payload(slot, length),
            self.staging.payload(staged, length),
            each_block=lambda block: digest.update(block.data),
            copy=np.copyto,  # lets go of the GIL: the copiers run side by side
            kind=kind,
        )
        return digest.intdigest(), summed

    def _free_staging(self, lease: int, rest_until: float | None = None) -> None:
        """Give back a store lease's staging slots (lock held): at once when its writer is
        done with them, else after `rest_until` (the lease expired mid-copy)."""
        for staged in self._staged.pop(lease, {}).values():
            if rest_until is None:
                self._release_staging(staged)
            else:
                self._staging_resting.add(staged, rest_until)

    def _release_staging(self, staged: int) -> None:
        self.staging.set_generation(staged, 0)
        self._staging_free.append(staged)

    def abort(self, lease: int, client: str) -> None:
        with self._lock:
            self._index.abort(lease, client)
            self._free_staging(lease)

    def begin_load(self, client: str, namespace: str, keys: list[bytes]) -> Grant:
        """Lend the ready chunks among `keys` for reading. No check on the way: clients map
        the pool read-only, so a sealed chunk's bytes are the ones its checksum was made of
        (see the module's docstring)."""
        deadline = time.monotonic() + self.lease_seconds
        with self._lock:
            grant = self._index.begin_load(client, namespace, keys, deadline)
            nbytes = self._index.lease_bytes(grant.lease)
        self._load_bytes.inc(nbytes)
        return grant

    def end_load(self, lease: int, client: str) -> None:
        with self._lock:
            self._index.end_load(lease, client)

    def reclaim(self, now: float, dead_clients: list[str]) -> int:
        """Release expired leases and those of dead clients; returns how many."""
        with self._lock:
            expired = self._index.expire(now)
            reclaimed = [lease for c in dead_clients for lease in self._index.release_client(c)]
            for gone in (*expired, *reclaimed):
                self._free_staging(gone.id, now + self.lease_seconds)
            if self._trim_at is not None and now >= self._trim_at:
                self._trim_at = None
                trim(self.pool.path, self.pool.geometry)
                trim(self.staging.path, self.staging.geometry)
            for staged in self._staging_resting.due(now):
                self._release_staging(staged)
        if expired:
            log.warning("released %d expired leases", len(expired))
        if reclaimed:
            log.warning("released %d leases of %d dead clients", len(reclaimed), len(dead_clients))
        return len(expired) + len(reclaimed)

    def stats(self) -> HostStats:
        skipped = self._skipped.read()
        with self._lock:
            c = self._index.counters
            skipped.full = c.full
            return HostStats(
                capacity_bytes=self.geometry.slot_count * self.geometry.payload_bytes,
                used_bytes=self._index.chunks * self.geometry.payload_bytes,
                slot_bytes=self.geometry.payload_bytes,
                slots=self.geometry.slot_count,
                free_slots=self._index.free_slots,
                resting_slots=self._index.resting_slots,
                staging_slots=self.staging.geometry.slot_count,
                free_staging_slots=len(self._staging_free),
                chunks=self._index.chunks,
                leases=self._index.leases,
                pinned_slots=self._index.pinned_slots(),
                lookups=c.lookups,
                hits=c.hits,
                evictions=c.evictions,
                store_skipped=skipped,
                leases_expired=c.leases_expired,
                leases_reclaimed=c.leases_reclaimed,
                corrupt=self.corrupt,
                index_published=self.table.entries,
                index_collisions=self.table.collisions,
                namespaces=dict(c.namespaces),
                policy=self._index.policy.stats(),
            )

    def close(self) -> None:
        self._copiers.shutdown(wait=True)
        with self._lock:
            self._index.table = None
            self.table.close()
        self.staging.close()
        self.pool.close()

    # --- internals -------------------------------------------------------------------------

    def _write_header(self, slot: int, header: ChunkHeader) -> None:
        raw = header.pack()
        self.pool.header(slot)[: len(raw)] = np.frombuffer(raw, dtype=np.uint8)

    def _claim(self, slot: int, namespace: str, key: bytes, generation: int) -> None:
        """Mark a slot as being written for a chunk, with its new generation (lock held).
        The stamp changes first: a reader that reads stamp, header, stamp and sees the same
        stamp twice read the header of the chunk that stamp belongs to."""
        self.pool.set_generation(slot, generation)
        self._write_header(slot, ChunkHeader(namespace, key, 0, 0, SlotState.WRITING))

    def _count_corrupt(self, why: str) -> None:
        self.corrupt += 1
        log.warning("dropped a chunk: %s", why)

    def _seal(self, entry: Entry, digest: int) -> None:
        """Write the SEALED header and hand the chunk to the write-back hook (lock held)."""
        entry.checksum = digest
        self._write_header(entry.slot, entry.header())
        if self._on_sealed is not None:
            self._on_sealed(entry)

    # --- hooks for the secondary tiers ----------------------------------------------------

    def held_header(self, entry: Entry) -> ChunkHeader | None:
        """The header of a pinned chunk, for writing it to a secondary tier; None once it
        was withdrawn (a peer received it damaged while the write-back waited)."""
        with self._lock:
            return entry.header() if self._index.holds(entry) else None

    def payload(self, entry: Entry) -> memoryview:
        """The bytes of a pinned chunk, for writing it to a secondary tier."""
        return self.pool.payload(entry.slot, entry.length).data

    def reverify(self, namespace: str, keys: list[bytes]) -> int:
        """Check these chunks against their checksums again (a peer received one damaged)
        and drop those that fail, so no client is served them; returns how many went.

        The checksums run without the lock, so stores and lookups go on meanwhile; a chunk
        that failed is dropped only if its slot still holds it (the same generation, still
        sealed) when they are done: a slot that went to another chunk meanwhile failed
        because its bytes changed, and the other chunk is left alone."""
        with self._lock:
            checks = [
                (e, e.length, e.checksum)
                for e in self._index.entries(namespace, keys)
                if e is not None and e.checksum is not None
            ]
        failed = [e for part in self._copiers.map(self._altered, _split(checks)) for e in part]
        damaged = 0
        with self._lock:
            for entry in failed:
                if not self._index.holds(entry):
                    continue
                self._index.remove(entry)
                self._count_corrupt(f"slot {entry.slot} of {namespace}: a peer received it damaged")
                damaged += 1
        return damaged

    def _altered(self, checks: list[_Check]) -> list[Entry]:
        """The chunks whose bytes no longer match the checksum they were sealed with."""
        return [
            entry
            for entry, length, digest in checks
            if checksum(self.pool.payload(entry.slot, length).data) != digest
        ]

    def missing(self, namespace: str, keys: list[bytes]) -> list[bytes]:
        with self._lock:
            return self._index.missing(namespace, keys)

    def promote(
        self,
        namespace: str,
        keys: list[bytes],
        fill: Callable[[list[bytes], list[memoryview]], list[ChunkHeader | None]],
    ) -> list[bool]:
        """Bring chunks into the pool from elsewhere: reserve a slot per key (within the
        promotions' share of the pool), let `fill` read and verify the bytes of those keys
        into those slots (no lock held meanwhile), then publish each filled one as sealed.
        Returns which keys are now in the pool."""
        held = [False] * len(keys)
        reserved: list[tuple[int, int, int]] = []  # (position in keys, lease, slot)
        # No expiry: `fill` may write into the slots until it returns, however long a tier
        # takes, so they must not go to another chunk before that; the share cap bounds them.
        deadline = math.inf
        with self._lock:
            for i, key in enumerate(keys):
                if self._promoting >= self._max_promoting:
                    break
                lease, slots, generations, _ = self._index.allocate(
                    PROMOTER, namespace, [key], self.geometry.payload_bytes, deadline
                )
                if slots[0] >= 0:
                    self._claim(slots[0], namespace, key, generations[0])
                    reserved.append((i, lease, slots[0]))
                    self._promoting += 1
                else:
                    held[i] = slots[0] == StoreCode.EXISTS
        if not reserved:
            return held
        headers: list[ChunkHeader | None] = [None] * len(reserved)
        try:
            headers = fill(
                [keys[i] for i, _, _ in reserved],
                [self.pool.payload(slot).data for _, _, slot in reserved],
            )
        finally:
            with self._lock:
                self._promoting -= len(reserved)
                for (i, lease, _), header in zip(reserved, headers, strict=True):
                    if header is None:
                        self._index.abort(lease, PROMOTER)
                        continue
                    for entry in self._index.commit(lease, PROMOTER):
                        entry.length = header.length
                        entry.checksum = header.checksum
                        self._write_header(entry.slot, entry.header())
                    held[i] = True
        return held

    def _reindex(self) -> None:
        """Rebuild the index from the pool after a restart, serving only verified chunks."""
        started = time.monotonic()
        for slot in range(self.geometry.slot_count):
            header = ChunkHeader.unpack(self.pool.header(slot).data)
            if header is not None and header.state == SlotState.WRITING:
                # A writer of the earlier agent process may still be copying into it.
                self._index.rest(slot, started + self.lease_seconds)
                continue
            if header is None or header.state != SlotState.SEALED:
                continue
            payload = self.pool.payload(slot).data
            if header.length > len(payload) or not header.verify(payload):
                self._write_header(slot, ChunkHeader("", b"", 0, 0, SlotState.FREE))
                self._count_corrupt(f"slot {slot} failed its checksum")
                continue
            if self._index.get(header.namespace, header.key) is None:
                self._index.adopt(header, slot, self.pool.generation(slot))
        log.info(
            "re-indexed pool: %d chunks, %d corrupt, %.2fs",
            self._index.chunks,
            self.corrupt,
            time.monotonic() - started,
        )

    def _bind_gauges(self) -> None:
        """Gauges read the index when scraped, so requests never pay for them."""
        m, g = self.metrics, self.geometry
        m.capacity_bytes.labels(TIER).set(g.slot_count * g.payload_bytes)
        m.free_slots.set_function(lambda: self._index.free_slots)
        m.leases.set_function(lambda: self._index.leases)
        m.chunks.labels(TIER).set_function(lambda: self._index.chunks)
        m.used_bytes.labels(TIER).set_function(lambda: self._index.chunks * g.payload_bytes)


def _split(items: list[_Check]) -> list[list[_Check]]:
    """One share per core: a task per chunk would cost more than checking a small chunk."""
    parts = min(len(items), os.cpu_count() or 1)
    return [items[i::parts] for i in range(parts)] if parts else []
