"""The host-memory tier: the shared pool, its index, and the sealing of committed chunks.

Checksums are computed off the request path by a sealer thread: a commit returns as soon as
the chunk is indexed, and the chunk header turns SEALED once its checksum is written. Only
sealed slots survive an agent restart, so a slot whose write or checksum never finished is
dropped instead of served.

Each slot handed to a chunk gets the chunk's header (WRITING, naming namespace and key) and
a new generation stamp before any client may write it; a commit publishes only slots that
still carry both, and a reader checks the stamp after copying (see pool.py).

Promotions from secondary tiers hold at most a quarter of the pool at once: a tier that
hangs mid-read keeps its reserved slots until the read ends, and without a cap a few stuck
reads would evict every chunk clients can use.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.agent.chunk import ChunkHeader, SlotState, checksum
from kvtier.agent.config import HostTierConfig
from kvtier.agent.index import BUSY, EXISTS, FULL, MISS, Entry, HostIndex
from kvtier.agent.metrics import AgentMetrics
from kvtier.agent.policy import make_policy
from kvtier.agent.pool import create_or_reuse
from kvtier.agent.pool_layout import PoolGeometry, slot_payload_bytes
from kvtier.agent.shm_index import TableWriter, index_path

log = logging.getLogger("kvtier.agent.host")

TIER = "host"
# Holders of the agent's own leases; ':' is never part of a client id (see protocol.py).
PROMOTER = "agent:promoter"  # slots being filled from a secondary tier
LENDER = "agent:peer"  # chunks being sent to other agents
_SKIP_REASONS = {EXISTS: "exists", BUSY: "busy", FULL: "full"}


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
        geometry = PoolGeometry(slot_payload_bytes(config.chunk_bytes), config.slot_count)
        self.pool, reused = create_or_reuse(pool_path, geometry, populate=config.prefault)
        # Clients read it to answer lookups themselves; a fresh one per agent process (the
        # one it replaces is marked retired, so its readers reconnect).
        self.table = TableWriter(index_path(pool_path), geometry.slot_count, boot)
        self.index = HostIndex(
            geometry.slot_count,
            make_policy(config.policy, geometry.slot_count),
            boot,
            rest_seconds=lease_seconds,
            table=self.table,
        )
        self.lock = threading.Lock()
        self._promoting = 0  # slots reserved by promotions in flight (lock held)
        self._max_promoting = max(1, geometry.slot_count // 4)
        # Called with the lock held: after a chunk is sealed, and with the entries that
        # lookups hit. The secondary tiers use them to queue write-backs.
        self.on_sealed: Callable[[Entry], None] | None = None
        self.on_hits: Callable[[list[Entry]], None] | None = None
        self.corrupt = 0
        self._looked_up = self._found = 0
        if reused:
            self._reindex()
        self._seal_queue: queue.SimpleQueue[Entry | None] = queue.SimpleQueue()
        # Checksums of chunks about to be lent, spread over the cores (xxh3 releases the GIL).
        self._verifier = ThreadPoolExecutor(os.cpu_count() or 1, thread_name_prefix="kvtier-verify")
        self._sealer = threading.Thread(target=self._seal_loop, name="kvtier-sealer", daemon=True)
        self._sealer.start()
        self._hits = metrics.hits.labels(TIER)
        self._evictions = metrics.evictions.labels(TIER)
        self._store_bytes = metrics.store_bytes.labels(TIER)
        self._load_bytes = metrics.load_bytes.labels(TIER)
        self._skipped = {code: metrics.store_skipped.labels(r) for code, r in _SKIP_REASONS.items()}
        self._bind_gauges()

    @property
    def geometry(self) -> PoolGeometry:
        return self.pool.geometry

    # --- requests (called by the server loop) ----------------------------------------------

    def lookup(self, namespace: str, keys: list[bytes]) -> tuple[list[bool], int]:
        with self.lock:
            hits, prefix = self.index.lookup(namespace, keys)
        self._looked_up += len(keys)
        self._found += sum(hits)
        return hits, prefix

    def lookup_digests(self, namespace: str, digests: list[int]) -> list[bool]:
        """Lookups a client answered from the published index, by digest: counted, and
        the hits' recency refreshed, as if answered here."""
        with self.lock:
            hits = self.index.lookup_digests(namespace, digests)
        self._looked_up += len(digests)
        self._found += sum(hits)
        return hits

    def after_reply(self) -> None:
        """Bookkeeping that need not delay an answer: the policy's view of recent hits and
        the lookup counters. The server calls it after each reply, before the next request."""
        with self.lock:
            touched = self.index.take_touched()
            if touched and self.on_hits is not None:
                self.on_hits(touched)
        if self._looked_up:
            self.metrics.lookups.inc(self._looked_up)
            self._hits.inc(self._found)
            self.metrics.misses.inc(self._looked_up - self._found)
            self._looked_up = self._found = 0

    def allocate(
        self, client: str, namespace: str, keys: list[bytes], nbytes: int
    ) -> tuple[int, list[int], list[int]]:
        if not 0 < nbytes <= self.geometry.payload_bytes:
            raise ValueError(
                f"nbytes {nbytes} does not fit a slot of {self.geometry.payload_bytes} bytes; "
                "the engine's row size must match the agent's host.chunkBytes"
            )
        with self.lock:
            evictions = self.index.counters.evictions
            lease, slots, generations = self.index.allocate(
                client, namespace, keys, nbytes, time.monotonic() + self.lease_seconds
            )
            evicted = self.index.counters.evictions - evictions
            for key, slot, generation in zip(keys, slots, generations, strict=True):
                if slot >= 0:
                    self._claim(slot, namespace, key, generation)
        for slot in slots:
            if slot < 0:
                self._skipped[slot].inc()
        if evicted:
            self._evictions.inc(evicted)
        return lease, slots, generations

    def commit(self, lease: int, client: str) -> None:
        """Publish a store lease's chunks and queue them for sealing. A slot whose header or
        generation is not the one its allocation wrote was written over by someone else: it
        is dropped and counted, never published."""

        def claimed(entry: Entry) -> bool:
            ns, key = entry.id
            header = ChunkHeader.unpack(self.pool.header(entry.slot).data)
            if (
                header == ChunkHeader(ns, key, 0, 0, SlotState.WRITING)
                and self.pool.generation(entry.slot) == entry.generation
            ):
                return True
            self._count_corrupt(f"slot {entry.slot} was overwritten during its store")
            return False

        with self.lock:
            kept = self.index.commit(lease, client, claimed)
            for entry in kept:
                ns, key = entry.id
                self._write_header(
                    entry.slot, ChunkHeader(ns, key, entry.length, 0, SlotState.WRITING)
                )
                self.index.pin(entry)
        for entry in kept:
            self._seal_queue.put(entry)
        self._store_bytes.inc(sum(e.length for e in kept))

    def abort(self, lease: int, client: str) -> None:
        with self.lock:
            self.index.abort(lease, client)

    def begin_load(
        self, client: str, namespace: str, keys: list[bytes]
    ) -> tuple[int, list[int], list[int]]:
        """Lend the ready chunks among `keys` for reading. Every client of the tier maps the
        pool writable, so each sealed chunk is checked against its checksum before it is
        lent: one altered after sealing is a miss, counted and dropped (its slot is free for
        the next store), never served. The check runs outside the lock, on pinned slots."""
        deadline = time.monotonic() + self.lease_seconds
        with self.lock:
            lease, slots, generations = self.index.begin_load(client, namespace, keys, deadline)
            lent = [
                self.index.get(namespace, k) if s >= 0 else None
                for k, s in zip(keys, slots, strict=True)
            ]
            nbytes = self.index.lease_bytes(lease)
        sealed = [(i, e) for i, e in enumerate(lent) if e is not None and e.checksum is not None]
        altered = {i for part in self._verifier.map(self._altered, _split(sealed)) for i in part}
        if altered:
            with self.lock:
                self.index.end_load(lease, client)
                for i in sorted(altered):
                    entry = lent[i]
                    assert entry is not None
                    self.index.remove(entry)  # pinned by another reader: dropped at its next load
                    self._count_corrupt(f"slot {entry.slot} of {namespace} altered after sealing")
                kept = [k for i, k in enumerate(keys) if i not in altered]
                lease, kept_slots, kept_generations = self.index.begin_load(
                    client, namespace, kept, deadline
                )
                nbytes = self.index.lease_bytes(lease)
            granted = iter(zip(kept_slots, kept_generations, strict=True))
            pairs = [(MISS, 0) if i in altered else next(granted) for i in range(len(keys))]
            slots, generations = [s for s, _ in pairs], [g for _, g in pairs]
        self._load_bytes.inc(nbytes)
        return lease, slots, generations

    def _altered(self, chunks: list[tuple[int, Entry]]) -> list[int]:
        """Which of these pinned chunks no longer match their checksum."""
        return [i for i, e in chunks if checksum(self.payload(e)) != e.checksum]

    def end_load(self, lease: int, client: str) -> None:
        with self.lock:
            self.index.end_load(lease, client)

    def reclaim(self, now: float, dead_clients: list[str]) -> int:
        """Release expired leases and those of dead clients; returns how many."""
        with self.lock:
            expired = self.index.expire(now)
            reclaimed = [lease for c in dead_clients for lease in self.index.release_client(c)]
        if expired:
            self.metrics.leases_reclaimed.labels("expired").inc(len(expired))
            log.warning("released %d expired leases", len(expired))
        if reclaimed:
            self.metrics.leases_reclaimed.labels("client_gone").inc(len(reclaimed))
            log.warning("released %d leases of %d dead clients", len(reclaimed), len(dead_clients))
        return len(expired) + len(reclaimed)

    def stats(self) -> dict[str, Any]:
        with self.lock:
            c = self.index.counters
            return {
                "capacity_bytes": self.geometry.slot_count * self.geometry.payload_bytes,
                "used_bytes": self.index.chunks * self.geometry.payload_bytes,
                "slot_bytes": self.geometry.payload_bytes,
                "slots": self.geometry.slot_count,
                "free_slots": self.index.free_slots,
                "resting_slots": self.index.resting_slots,
                "chunks": self.index.chunks,
                "leases": self.index.leases,
                "pinned_slots": self.index.pinned_slots(),
                "lookups": c.lookups,
                "hits": c.hits,
                "evictions": c.evictions,
                "store_full": c.full,
                "leases_expired": c.leases_expired,
                "leases_reclaimed": c.leases_reclaimed,
                "corrupt": self.corrupt,
                "index_published": self.table.entries,
                "index_collisions": self.table.collisions,
                "namespaces": dict(c.namespaces),
                **self.index.policy.describe(),
            }

    def close(self) -> None:
        self._seal_queue.put(None)
        self._verifier.shutdown(wait=False)
        self._sealer.join(timeout=10)
        with self.lock:
            self.index.table = None
            self.table.close()
        self.pool.close()

    # --- internals -------------------------------------------------------------------------

    def _write_header(self, slot: int, header: ChunkHeader) -> None:
        raw = header.pack()
        self.pool.header(slot)[: len(raw)] = np.frombuffer(raw, dtype=np.uint8)

    def _claim(self, slot: int, namespace: str, key: bytes, generation: int) -> None:
        """Mark a slot as being written for a chunk, with its new generation (lock held)."""
        self._write_header(slot, ChunkHeader(namespace, key, 0, 0, SlotState.WRITING))
        self.pool.set_generation(slot, generation)

    def _count_corrupt(self, why: str) -> None:
        self.corrupt += 1
        self.metrics.corrupt.labels(TIER).inc()
        log.warning("dropped a chunk: %s", why)

    def _seal_loop(self) -> None:
        while (entry := self._seal_queue.get()) is not None:
            digest = checksum(self.pool.payload(entry.slot, entry.length).data)
            with self.lock:
                self._seal(entry, digest)
                self.index.unpin(entry)

    def _seal(self, entry: Entry, digest: int) -> None:
        """Write the SEALED header and hand the chunk to the write-back hook (lock held)."""
        entry.checksum = digest
        self._write_header(entry.slot, entry.header())
        if self.on_sealed is not None:
            self.on_sealed(entry)

    # --- hooks for the secondary tiers ----------------------------------------------------

    def payload(self, entry: Entry) -> memoryview:
        """The bytes of a pinned chunk, for writing it to a secondary tier."""
        return self.pool.payload(entry.slot, entry.length).data

    def reverify(self, namespace: str, keys: list[bytes]) -> int:
        """Check these chunks against their checksums again (a peer received one damaged)
        and drop those that fail, so no client is served them; returns how many went."""
        with self.lock:
            held = [self.index.get(namespace, key) for key in keys]
            sealed = [
                (i, e) for i, e in enumerate(held) if e is not None and e.checksum is not None
            ]
            damaged = [held[i] for i in self._altered(sealed)]
            for entry in damaged:
                assert entry is not None
                self.index.remove(entry)
                self._count_corrupt(f"slot {entry.slot} of {namespace}: a peer received it damaged")
        return len(damaged)

    def missing(self, namespace: str, keys: list[bytes]) -> list[bytes]:
        with self.lock:
            return self.index.missing(namespace, keys)

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
        with self.lock:
            for i, key in enumerate(keys):
                if self._promoting >= self._max_promoting:
                    break
                lease, slots, generations = self.index.allocate(
                    PROMOTER, namespace, [key], self.geometry.payload_bytes, deadline
                )
                if slots[0] >= 0:
                    self._claim(slots[0], namespace, key, generations[0])
                    reserved.append((i, lease, slots[0]))
                    self._promoting += 1
                else:
                    held[i] = slots[0] == EXISTS
        if not reserved:
            return held
        headers: list[ChunkHeader | None] = [None] * len(reserved)
        try:
            headers = fill(
                [keys[i] for i, _, _ in reserved],
                [self.pool.payload(slot).data for _, _, slot in reserved],
            )
        finally:
            with self.lock:
                self._promoting -= len(reserved)
                for (i, lease, _), header in zip(reserved, headers, strict=True):
                    if header is None:
                        self.index.abort(lease, PROMOTER)
                        continue
                    for entry in self.index.commit(lease, PROMOTER):
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
                self.index.rest(slot, started + self.lease_seconds)
                continue
            if header is None or header.state != SlotState.SEALED:
                continue
            payload = self.pool.payload(slot).data
            if header.length > len(payload) or not header.verify(payload):
                self._write_header(slot, ChunkHeader("", b"", 0, 0, SlotState.FREE))
                self._count_corrupt(f"slot {slot} failed its checksum")
                continue
            if self.index.get(header.namespace, header.key) is None:
                self.index.adopt(header, slot, self.pool.generation(slot))
        log.info(
            "re-indexed pool: %d chunks, %d corrupt, %.2fs",
            self.index.chunks,
            self.corrupt,
            time.monotonic() - started,
        )

    def _bind_gauges(self) -> None:
        """Gauges read the index when scraped, so requests never pay for them."""
        m, g = self.metrics, self.geometry
        m.capacity_bytes.labels(TIER).set(g.slot_count * g.payload_bytes)
        m.free_slots.set_function(lambda: self.index.free_slots)
        m.leases.set_function(lambda: self.index.leases)
        m.chunks.labels(TIER).set_function(lambda: self.index.chunks)
        m.used_bytes.labels(TIER).set_function(lambda: self.index.chunks * g.payload_bytes)


def _split(items: list[tuple[int, Entry]]) -> list[list[tuple[int, Entry]]]:
    """One share per core: a task per chunk would cost more than checking a small chunk."""
    parts = min(len(items), os.cpu_count() or 1)
    return [items[i::parts] for i in range(parts)] if parts else []
