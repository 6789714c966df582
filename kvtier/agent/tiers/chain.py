"""The secondary tiers as one ordered chain behind the host pool.

Write-back: when the host tier seals a chunk (or, with `admitAfterHits`, when a chunk has
been hit often enough) it is queued for each tier, pinned in the pool until written, on a
bounded per-tier queue. A full queue drops the write and counts it, and so does a write that
would pin more than half the pool: a slow tier never holds up a client, neither by making
it wait nor by leaving it no slot to store into.

Lookup and promotion: keys missing from the pool are asked of the tiers in order, one batch
per tier; a found chunk is read straight into a reserved pool slot, verified, and published
there before a client may read it. Both have a time budget, counted from the request's
arrival: what is not answered in time is a miss, so no client waits past its own timeout.
Promotions hold at most a share of the pool (see host_tier.py).

Health: a tier whose last FAILURES_TO_UNHEALTHY operations failed or timed out is marked
unhealthy (metric kvtier_tier_healthy, `healthy` in its stats): it answers no lookups and
takes no write-backs, so a dead endpoint costs neither time nor false hits (an object store
would otherwise keep answering "present" from its cache of known objects). The upkeep thread
probes it each interval and marks it healthy again once a probe succeeds.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from itertools import compress
from operator import not_
from typing import Any, Literal

from kvtier.agent.chunk import ChunkHeader
from kvtier.agent.host.events import RESIDENCY_OF_KIND, NodeEvents
from kvtier.agent.host.index import Entry
from kvtier.agent.host.tier import HostTier
from kvtier.agent.report.metrics import AgentMetrics
from kvtier.agent.tiers.base import CorruptChunk, SecondaryTier
from kvtier.agent.tiers.factory import TierContext, build_tier
from kvtier.api.config import TierConfig
from kvtier.api.stats import Tally, TierCount, TierCounts, TierStats
from kvtier.client.protocol import Where

log = logging.getLogger("kvtier.agent.tiers.chain")

FAILURES_TO_UNHEALTHY = 3


@dataclass
class _Tier:
    """One tier with its queue, workers and counters."""

    config: TierConfig
    backend: SecondaryTier
    queue: queue.Queue[Entry | None]
    counts: Tally[TierCounts] = field(default_factory=lambda: Tally(TierCounts()))

    @property
    def name(self) -> str:
        return self.config.name

    lock: threading.Lock = field(default_factory=threading.Lock)
    failures: int = 0  # operations failed or timed out in a row
    healthy: bool = True

    def outcome(self, ok: bool) -> bool:
        """Record an operation's outcome; True when it turned the tier unhealthy."""
        with self.lock:
            self.failures = 0 if ok else self.failures + 1
            turned = self.healthy and self.failures >= FAILURES_TO_UNHEALTHY
            if turned:
                self.healthy = False
            return turned


class SecondaryTiers:
    def __init__(
        self,
        configs: list[TierConfig],
        host: HostTier,
        metrics: AgentMetrics,
        budget_seconds: float,
        context: TierContext,
        maintain_seconds: float = 1.0,
        events: NodeEvents | None = None,
    ) -> None:
        self.host = host
        self.metrics = metrics
        self.budget = budget_seconds
        self._pins = 0  # pool slots pinned by queued or running write-backs
        self._pins_lock = threading.Lock()
        self._max_pins = max(1, host.geometry.slot_count // 2)
        self.tiers = [
            _Tier(c, build_tier(c, context), queue.Queue(maxsize=c.queue_depth)) for c in configs
        ]
        if events is not None:
            for t in self.tiers:
                self._report_holdings(t, events)
        self._io = ThreadPoolExecutor(32, thread_name_prefix="kvtier-tier-io")
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(
                target=self._write_loop, args=(t,), name=f"kvtier-wb-{t.name}", daemon=True
            )
            for t in self.tiers
            for _ in range(t.config.workers)
        ]
        self._threads.append(
            threading.Thread(
                target=self._maintain_loop,
                args=(maintain_seconds,),
                name="kvtier-tier-upkeep",
                daemon=True,
            )
        )
        for thread in self._threads:
            thread.start()
        for t in self.tiers:
            self._bind_gauges(t)
        host.subscribe(self._on_sealed, self._on_hits)

    @staticmethod
    def _report_holdings(tier: _Tier, events: NodeEvents) -> None:
        """What a tier comes to hold and lets go of, to the node's KV events (the peer
        tier's none: its chunks are in other nodes' pools, on their streams)."""
        residency = RESIDENCY_OF_KIND.get(tier.backend.kind)
        if residency is None:
            return
        events.add_tier(tier.name, residency)

        def holdings(namespace: str, keys: list[bytes], removed: bool) -> None:
            events.record(tier.name, namespace, keys, removed)

        tier.backend.report_holdings(holdings)

    def peers(self) -> list[str]:
        """The other agents the tiers work with, in tier order."""
        return [peer for t in self.tiers for peer in t.backend.peers()]

    def ask_source(self, source: str, namespace: str, keys: list[bytes]) -> None:
        """A request's `kvtier_source`: the agent it names holds `keys`; told to every tier,
        those that can read from it take note."""
        for t in self.tiers:
            t.backend.ask_source(source, namespace, keys)

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.tiers]

    # --- write-back (called by the host tier with its lock held) -------------------------

    def _on_sealed(self, entry: Entry) -> None:
        for tier in self.tiers:
            if tier.config.admit_after_hits == 0:
                self._enqueue(tier, entry)

    def _on_hits(self, entries: list[Entry]) -> None:
        for tier in self.tiers:
            n = tier.config.admit_after_hits
            if n:
                for entry in entries:
                    if entry.hits == n and entry.checksum is not None:
                        self._enqueue(tier, entry)

    def _enqueue(self, tier: _Tier, entry: Entry) -> None:
        dropped: TierCount | None = None
        if not tier.healthy:
            dropped = "dropped_unhealthy"
        elif self._pins >= self._max_pins:
            dropped = "dropped_pool_pressure"
        else:
            try:
                tier.queue.put_nowait(entry)
            except queue.Full:
                dropped = "dropped_queue_full"
        if dropped is not None:
            tier.counts.add(dropped)
            return
        self.host.pin_locked(entry)  # released by the writer: the slot cannot be reused meanwhile
        with self._pins_lock:
            self._pins += 1

    def _write_loop(self, tier: _Tier) -> None:
        while (entry := tier.queue.get()) is not None:
            started = time.perf_counter()
            try:
                if (header := self.host.held_header(entry)) is None:
                    continue  # found damaged meanwhile: counted corrupt, written nowhere
                tier.backend.write(header, self.host.payload(entry))
            except Exception as exc:
                tier.counts.add("write_errors")
                log.warning("tier %s: write failed: %s", tier.name, exc)
                self._outcome(tier, False)
            else:
                self._outcome(tier, True)
                tier.counts.add("writebacks")
                self.metrics.tier_seconds.labels(tier.name, "write").observe(
                    time.perf_counter() - started
                )
            finally:
                self.host.unpin(entry)
                with self._pins_lock:
                    self._pins -= 1

    # --- lookup and promotion (called on the agent's request workers) --------------------

    def locate(self, namespace: str, keys: list[bytes], deadline: float) -> list[int]:
        """For each key, the position (1-based) of the first healthy tier holding it, or
        MISS; what is not answered by `deadline` is a MISS."""
        where = [int(Where.MISS)] * len(keys)
        todo, batch = list(range(len(keys))), keys  # positions still missing, their keys
        for position, tier in enumerate(self.tiers, start=1):
            if not todo:
                break
            if not tier.healthy:
                continue
            # a tier whose own timeout ends within the budget is asked on this thread: the
            # hand-off to the I/O pool and back costs 50 to 100 µs of every lookup
            bound = tier.backend.exists_seconds
            inline = bound is not None and deadline - time.monotonic() >= bound
            found = self._timed(
                tier, "exists", deadline, tier.backend.exists, namespace, batch, inline=inline
            )
            if found is None:
                continue
            if len(found) != len(todo):
                raise ValueError(f"tier {tier.name} answered {len(found)} of {len(todo)} keys")
            hits = list(compress(todo, found))
            for i in hits:
                where[i] = position
            tier.counts.add("hits", len(hits))
            tier.counts.add("misses", len(todo) - len(hits))
            if hits:
                todo = list(compress(todo, map(not_, found)))
                batch = [keys[i] for i in todo]
        return where

    def promote(self, namespace: str, keys: list[bytes], deadline: float) -> dict[bytes, int]:
        """Copy chunks into the pool from the first healthy tier that has them, tier by
        tier: a tier that reads in batches gets every key still missing in one call, the
        others one read per key, in parallel. Returns the tier position each key came from
        (absent keys are left out); what has not arrived by `deadline` is left out too."""
        found: dict[bytes, int] = {}
        todo = list(keys)
        for position, tier in enumerate(self.tiers, start=1):
            if not todo or time.monotonic() >= deadline:
                break
            if not tier.healthy:
                continue
            batches = [todo] if tier.backend.reads_in_batches else [[key] for key in todo]
            jobs = [self._io.submit(self._promote_batch, tier, namespace, b) for b in batches]
            wait_futures(jobs, timeout=max(0.0, deadline - time.monotonic()))
            for job in jobs:
                if not job.done():
                    tier.counts.add("read_timeouts")
                    self._outcome(tier, False)
                elif job.exception() is None:
                    found.update((key, position) for key in job.result())
            todo = [key for key in todo if key not in found]
        return found

    def _promote_batch(self, tier: _Tier, namespace: str, keys: list[bytes]) -> list[bytes]:
        """Read `keys` from one tier into the pool; returns those now there."""
        started = time.perf_counter()

        def fill(wanted: list[bytes], outs: list[memoryview]) -> list[ChunkHeader | None]:
            headers: list[ChunkHeader | None] = []
            for result in tier.backend.read_many(namespace, wanted, outs):
                if isinstance(result, CorruptChunk):
                    tier.counts.add("corrupt")
                    log.warning("tier %s: dropped a corrupt chunk: %s", tier.name, result)
                    result = None
                headers.append(result)
            return headers

        try:
            held = self.host.promote(namespace, keys, fill)
        except Exception as exc:
            tier.counts.add("read_errors")
            log.warning("tier %s: read failed: %s", tier.name, exc)
            self._outcome(tier, False)
            return []
        self._outcome(tier, True)
        promoted = [key for key, ok in zip(keys, held, strict=True) if ok]
        if promoted:
            tier.counts.add("promotions", len(promoted))
            self.metrics.tier_seconds.labels(tier.name, "read").observe(
                time.perf_counter() - started
            )
        return promoted

    def _timed(
        self,
        tier: _Tier,
        op: Literal["exists", "probe"],
        deadline: float,
        fn: Any,
        *args: Any,
        inline: bool = False,
    ) -> Any | None:
        """Run one tier call on the I/O pool within the deadline (`inline`: on this thread,
        for a call known to return by then); None on error or timeout."""
        started = time.perf_counter()
        try:
            if inline:
                result = fn(*args)
            else:
                result = self._io.submit(fn, *args).result(
                    timeout=max(0.0, deadline - time.monotonic())
                )
        except Exception as exc:
            tier.counts.add("exists_errors" if op == "exists" else "probe_errors")
            log.warning("tier %s: %s failed or timed out: %s", tier.name, op, type(exc).__name__)
            self._outcome(tier, False)
            return None
        self._outcome(tier, True)
        self.metrics.tier_seconds.labels(tier.name, op).observe(time.perf_counter() - started)
        return result

    def _outcome(self, tier: _Tier, ok: bool) -> None:
        if tier.outcome(ok):
            self.metrics.tier_healthy.labels(tier.name).set(0)
            log.warning(
                "tier %s: %d operations in a row failed; it answers no lookups until a probe "
                "succeeds",
                tier.name,
                FAILURES_TO_UNHEALTHY,
            )

    def _probe(self, tier: _Tier) -> None:
        """Try an unhealthy tier with a cheap request; healthy again if it answers."""
        deadline = time.monotonic() + self.budget
        if self._timed(tier, "probe", deadline, tier.backend.probe) is None:
            return
        with tier.lock:
            tier.healthy, tier.failures = True, 0
        self.metrics.tier_healthy.labels(tier.name).set(1)
        log.info("tier %s: a probe succeeded; it answers lookups again", tier.name)

    # --- upkeep and reporting ------------------------------------------------------------

    def _maintain_loop(self, interval: float) -> None:
        while not self._stop.wait(interval):
            for tier in self.tiers:
                if not tier.healthy:
                    self._probe(tier)
                try:
                    evicted = tier.backend.maintain()
                except Exception as exc:
                    tier.counts.add("maintain_errors")
                    log.warning("tier %s: upkeep failed: %s", tier.name, exc)
                    continue
                if evicted:
                    tier.counts.add("evictions", evicted)

    def _bind_gauges(self, tier: _Tier) -> None:
        m, backend = self.metrics, tier.backend
        m.tier_healthy.labels(tier.name).set(1)
        m.capacity_bytes.labels(tier.name).set_function(lambda: backend.usage().capacity_bytes)
        m.used_bytes.labels(tier.name).set_function(lambda: backend.usage().used_bytes)
        m.chunks.labels(tier.name).set_function(lambda: backend.usage().objects)

    def stats(self) -> list[TierStats]:
        out = []
        for tier in self.tiers:
            usage = tier.backend.usage()
            counts = tier.counts.read()
            common = TierStats(
                name=tier.name,
                kind=tier.backend.kind,
                capacity_bytes=usage.capacity_bytes,
                used_bytes=usage.used_bytes,
                chunks=usage.objects,
                queued=tier.queue.qsize(),
                healthy=tier.healthy,
                counts=counts,
            )
            out.append(tier.backend.stats(common))
        return out

    def close(self) -> None:
        self._stop.set()
        for tier in self.tiers:
            for _ in range(tier.config.workers):
                try:
                    tier.queue.put(None, timeout=5)
                except queue.Full:
                    break
        for thread in self._threads:
            thread.join(timeout=10)
        for tier in self.tiers:
            tier.backend.close()
        self._io.shutdown(wait=False, cancel_futures=True)
