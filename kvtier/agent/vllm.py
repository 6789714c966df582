"""kvtier as a secondary tier of vLLM's tiered KV offloading.

vLLM loads this module inside its scheduler process from the `--kv-transfer-config`
(`"type": "KVTierSecondaryTier", "module_path": "kvtier.agent.vllm"`). Everything here runs
in vLLM's own environment and imports only what vLLM already has (numpy, pyzmq, msgspec).

Nothing blocks the scheduler: a key the node's pool holds is a HIT in the same scheduler step,
found in the index the agent publishes in shared memory (and so is a MISS when the agent has
no secondary tiers); the keys looked up that way reach the agent once per step in one one-way
report. Other lookups are batched into one agent round trip per scheduler step on vLLM's
async-lookup thread (answering RETRY until the batch returns), and stores and
loads copy rows between vLLM's primary host buffer and the agent's shared pool on worker
threads, reporting through `get_finished_jobs`. An agent that is unreachable or restarting
turns lookups into misses and stores into dropped jobs, counted and logged once per outage.
"""

from __future__ import annotations

import bisect
import logging
import queue
import sys
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any, ClassVar

import numpy as np
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingGaugeMetadata,
    OffloadingHistogramMetadata,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from kvtier.agent.client import AgentClient, AgentRefused, AgentUnavailable
from kvtier.agent.fingerprint import describe, engine_fingerprint, with_hash_seed
from kvtier.agent.shm_index import digest

# A child of vLLM's own logger: vLLM configures only "vllm" (its handler, format and
# VLLM_LOGGING_LEVEL), so this is how the plug-in's lines reach a vLLM user's output.
log = logging.getLogger("vllm.kvtier")

EVENTS_POLL_SECONDS = 0.5
FAILED_LOAD_SECONDS = 5.0  # a key whose load failed is a miss this long (no retry livelock)


class Metrics:
    """Names of the Prometheus series this tier adds to vLLM's."""

    LOOKUPS = "vllm:kvtier_lookup_keys"
    HITS = "vllm:kvtier_lookup_hits"
    STORE_BYTES = "vllm:kvtier_store_bytes"
    LOAD_BYTES = "vllm:kvtier_load_bytes"
    STORE_SECONDS = "vllm:kvtier_store_seconds"
    LOAD_SECONDS = "vllm:kvtier_load_seconds"
    FAILED_JOBS = "vllm:kvtier_failed_jobs"
    AGENT_AVAILABLE = "vllm:kvtier_agent_available"


_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)


def engine_vllm_config(model: str) -> Any | None:
    """The VllmConfig of the engine creating this tier, or None.

    vLLM hands a tier only its normalised OffloadingConfig, which names the model but not
    the config vLLM resolved for it (hf_overrides applied) nor where its weights are. The
    tier is created inside the offloading connector's scheduler constructor, whose
    `vllm_config` argument is on the stack; vLLM's current config, when one is set, is the
    other place to find it. A config for another model is never taken.
    """
    from vllm import config as vllm_config_module

    candidates = []
    frame = sys._getframe(1)
    while frame is not None:
        candidates.append(frame.f_locals.get("vllm_config"))
        frame = frame.f_back  # type: ignore[assignment]
    current = getattr(vllm_config_module, "get_current_vllm_config_or_none", None)
    if current is not None:
        candidates.append(current())
    for candidate in candidates:
        if (
            isinstance(candidate, vllm_config_module.VllmConfig)
            and getattr(candidate.model_config, "model", None) == model
        ):
            return candidate
    return None


SOURCE_PARAM = "kvtier_source"


def source_of(req_context: Any) -> str:
    """Direct mode: the request's kv_transfer_params may name the peer endpoint of the agent
    that holds its chunks (the prefill side in P/D), which is then asked directly."""
    params = getattr(req_context, "kv_transfer_params", None) or {}
    return str(params.get(SOURCE_PARAM) or "")


class _AgentLookup(AsyncLookupManager):
    """vLLM's async-lookup helper: one batch per scheduler step, on its own thread."""

    def __init__(self, tier: KVTierSecondaryTier) -> None:
        super().__init__(tier_type=tier.tier_type)
        self._tier = tier

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        return self._tier.agent_lookup(keys, source_of(req_context))


class KVTierSecondaryTier(SecondaryTierManager):
    """The node's kvtier agent as one secondary tier of vLLM's TieringOffloadingSpec."""

    medium: ClassVar[Medium] = Medium.CPU

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        return {
            Metrics.LOOKUPS: OffloadingCounterMetadata("Chunk keys looked up in the agent."),
            Metrics.HITS: OffloadingCounterMetadata("Chunk keys the agent held."),
            Metrics.STORE_BYTES: OffloadingCounterMetadata("Bytes copied into the agent."),
            Metrics.LOAD_BYTES: OffloadingCounterMetadata("Bytes copied from the agent."),
            Metrics.STORE_SECONDS: OffloadingHistogramMetadata(
                "Duration of one store job into the agent.", buckets=_SECONDS_BUCKETS
            ),
            Metrics.LOAD_SECONDS: OffloadingHistogramMetadata(
                "Duration of one load job from the agent.", buckets=_SECONDS_BUCKETS
            ),
            Metrics.FAILED_JOBS: OffloadingCounterMetadata(
                "Store or load jobs that failed (agent unavailable or refused).", ("op",)
            ),
            Metrics.AGENT_AVAILABLE: OffloadingGaugeMetadata(
                "1 while the node agent answers, 0 during an outage."
            ),
        }

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        agent: str,
        timeout_seconds: float = 2.0,
        copy_threads: int = 4,
        enable_kv_events: bool = False,
        locality: str | None = None,
        scope: str | None = None,
        backpressure_detector: Any = None,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.locality = Locality(locality) if locality is not None else Locality.LOCAL
        self._rows = np.asarray(primary_kv_view).view(np.uint8)
        self._row_bytes = self._rows.shape[1]
        self._client = AgentClient(agent, timeout=timeout_seconds)
        self._copiers = ThreadPoolExecutor(copy_threads, thread_name_prefix="kvtier-copy")
        self._running: set[Future[None]] = set()
        self._running_lock = threading.Lock()
        self._finished: queue.SimpleQueue[JobResult] = queue.SimpleQueue()
        self._failed_loads: queue.SimpleQueue[list[OffloadKey]] = queue.SimpleQueue()
        self._events: list[OffloadingEvent] | None = [] if enable_kv_events else None
        self._events_lock = threading.Lock()
        self._events_after = 0
        self._events_poll: Future[None] | None = None
        self._next_events_poll = 0.0
        self._stats_lock = threading.Lock()
        # Per request and KV group: the chunk keys seen at each end-token position, so a
        # store can name each chunk's predecessor (the agent's `prefix` policy keeps the
        # prefix tree with them).
        self._chains: dict[str, dict[bytes, dict[int, bytes]]] = {}
        self._chains_lock = threading.Lock()
        self._stats: list[tuple[str, str, float, tuple[str, ...]]] = []
        self._vllm_config = engine_vllm_config(offloading_spec.config.model.name)
        self._fingerprint = engine_fingerprint(
            offloading_spec.config, self._vllm_config, self._row_bytes, scope
        )
        self._namespace: str | None = None
        self._available: bool | None = None
        self._refusals: set[str] = set()
        self._connect_lock = threading.Lock()
        self._lookup = _AgentLookup(self)
        # Lookups answered from the published index this step, per request (reported once
        # per step), and the keys each request already reported (each key once).
        self._looked: dict[str, list[int]] = {}
        self._reported: dict[str, set[OffloadKey]] = {}
        self._failed_until: dict[OffloadKey, float] = {}
        log.info("kvtier tier %s: agent %s, rows of %d bytes", tier_type, agent, self._row_bytes)
        if self._vllm_config is None:
            log.warning(
                "kvtier: vLLM's model config for %s was not found; without it the weights "
                "and config cannot be fingerprinted, so this engine shares no chunks",
                offloading_spec.config.model.name,
            )
        log.info(
            "kvtier fingerprint (the hash seed is added on the first request): %s",
            describe(self._fingerprint),
        )

    # --- the agent connection (worker threads only) ---------------------------------------

    @property
    def namespace(self) -> str:
        """Computed on first use: the hash seed exists only once the engine core runs."""
        if self._namespace is None:
            fingerprint = with_hash_seed(self._fingerprint, self._vllm_config)
            self._namespace = fingerprint.namespace
            log.info("kvtier namespace %s: %s", self._namespace, describe(fingerprint))
        return self._namespace

    def _connected(self) -> AgentClient:
        with self._connect_lock:  # copy threads and the lookup thread share the client
            if self._client.hello is None:
                self._client.connect()
                if self._client.slot_bytes < self._row_bytes:
                    raise AgentRefused(
                        f"agent slots hold {self._client.slot_bytes} bytes but vLLM rows are "
                        f"{self._row_bytes}; set the KVCacheTier's chunk size "
                        f"(host.chunkBytes) to at least {self._row_bytes}"
                    )
        return self._client

    def _set_available(self, available: bool, reason: str = "") -> None:
        if available != self._available:
            if available:
                log.info("kvtier agent %s is available", self._client.endpoint)
            else:
                log.warning(
                    "kvtier agent %s unavailable, serving misses: %s", self._client.endpoint, reason
                )
            self._available = available
        self._record("gauge", Metrics.AGENT_AVAILABLE, 1.0 if available else 0.0)

    def agent_lookup(self, keys: list[OffloadKey], source: str = "") -> list[bool]:
        try:
            client = self._connected()
            hits = client.lookup(self.namespace, [bytes(k) for k in keys], source).hits
        except AgentUnavailable as exc:
            self._client.hello = None
            self._set_available(False, str(exc))
            return [False] * len(keys)
        self._set_available(True)
        self._record("counter", Metrics.LOOKUPS, len(keys))
        self._record("counter", Metrics.HITS, sum(hits))
        return hits

    # --- SecondaryTierManager -------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        self._note_positions([key], req_context)
        local = self._local_lookup(key, req_context)
        if local is not None:
            return local
        found = self._lookup.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def _local_lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult | None:
        """HIT when the pool holds the key (and MISS when it does not and the agent has no
        other tier), from the published index, in this scheduler step; None when only the
        agent can say (no index yet, a source to ask, secondary tiers to look in)."""
        hello = self._client.hello
        if hello is None or source_of(req_context) or key in self._failed_until:
            return None
        namespace = self.namespace
        held = self._client.find(namespace, bytes(key))
        if held is None or (not held and hello.tiers):
            return None
        req_id = req_context.req_id
        reported = self._reported.setdefault(req_id, set())
        if key not in reported:
            reported.add(key)
            self._looked.setdefault(req_id, []).append(digest(namespace, bytes(key)))
            self._record("counter", Metrics.LOOKUPS, 1)
            if held:
                self._record("counter", Metrics.HITS, 1)
        return LookupResult.HIT if held else LookupResult.MISS

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookup.cleanup(req_context.req_id)
        self._reported.pop(req_context.req_id, None)
        with self._chains_lock:
            self._chains.pop(req_context.req_id, None)

    def _note_positions(self, keys: Iterable[OffloadKey], req_context: Any) -> None:
        position_of = getattr(req_context, "get_offload_key_position", None)
        req_id = getattr(req_context, "req_id", None)
        if position_of is None or req_id is None:
            return
        with self._chains_lock:
            groups = self._chains.setdefault(req_id, {})
            for key in keys:
                position = position_of(key)
                if position is not None:
                    groups.setdefault(bytes(key[-4:]), {})[position] = bytes(key)

    def parents_of(self, keys: list[bytes], req_context: Any) -> list[bytes | None] | None:
        """Each key's predecessor: the key of the same request and KV group at the nearest
        earlier position vLLM recorded, where there is one."""
        self._note_positions([OffloadKey(k) for k in keys], req_context)
        position_of = getattr(req_context, "get_offload_key_position", None)
        req_id = getattr(req_context, "req_id", None)
        if position_of is None or req_id is None:
            return None
        parents: list[bytes | None] = []
        with self._chains_lock:
            groups = self._chains.get(req_id, {})
            ordered = {g: sorted(chain) for g, chain in groups.items()}
            for key in keys:
                position = position_of(OffloadKey(key))
                group = key[-4:]
                known = ordered.get(group)
                if position is None or not known:
                    parents.append(None)
                    continue
                i = bisect.bisect_left(known, position)
                parents.append(groups[group][known[i - 1]] if i else None)
        return parents if any(p is not None for p in parents) else None

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        now = time.monotonic()
        while True:
            try:
                failed = self._failed_loads.get_nowait()
            except queue.Empty:
                break
            self._lookup.mark_miss(failed)
            for key in failed:
                self._failed_until[key] = now + FAILED_LOAD_SECONDS
        if self._failed_until:
            self._failed_until = {k: t for k, t in self._failed_until.items() if t > now}
        self._lookup.flush()
        self._report_lookups()
        if (
            self._events is not None
            and now >= self._next_events_poll
            and (self._events_poll is None or self._events_poll.done())
        ):
            self._next_events_poll = now + EVENTS_POLL_SECONDS
            self._events_poll = self._copiers.submit(self._poll_events)

    def _report_lookups(self) -> None:
        """The lookups answered here this step, one request each, to the agent: one
        one-way message (it counts them, refreshes recency, logs the requests)."""
        looked, self._looked = self._looked, {}
        if looked and self._namespace is not None:
            for digests in looked.values():
                self._client.report(self._namespace, np.array(digests, np.uint64))
        self._client.flush_reports(block=False)  # and the bytes loaded without a lease

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit(self._store, job_metadata)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit(self._load, job_metadata)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        results = []
        while True:
            try:
                results.append(self._finished.get_nowait())
            except queue.Empty:
                return results

    def has_pending_work(self) -> bool:
        with self._running_lock:
            return bool(self._running)

    def drain_jobs(self) -> None:
        """Wait for every copy in flight; none is ever cut short."""
        with self._running_lock:
            running = list(self._running)
        wait_futures(running)

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self._events is None:
            return []
        with self._events_lock:
            events, self._events = self._events, []
        return events

    def get_stats(self) -> Any:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
            OffloadingConnectorStats,
        )

        with self._stats_lock:
            observations, self._stats = self._stats, []
        if not observations:
            return None
        stats = OffloadingConnectorStats()
        for kind, name, value, labels in observations:
            if kind == "counter":
                stats.increase_counter(name, value, labels)
            elif kind == "gauge":
                stats.set_gauge(name, value, labels)
            else:
                stats.observe_histogram(name, value, labels)
        return stats

    def shutdown(self) -> None:
        self.drain_jobs()
        if self._events_poll is not None:
            wait_futures([self._events_poll])
        self._copiers.shutdown(wait=True)
        self._lookup.shutdown()
        self._client.close()
        del self._rows  # vLLM can only unmap its buffer once no view of it is left

    # --- jobs (worker threads) ------------------------------------------------------------

    def _submit(self, work: Any, job: TransferJob) -> None:
        future = self._copiers.submit(self._run_job, work, job)
        with self._running_lock:
            self._running.add(future)
        future.add_done_callback(self._job_done)

    def _run_job(self, work: Any, job: TransferJob) -> None:
        """Every job ends with a result, whatever happens: vLLM waits for it."""
        try:
            work(job)
        except Exception as exc:
            log.exception("kvtier job %s failed unexpectedly", job.job_id)
            if job.is_promotion:
                self._failed_loads.put(list(job.keys))
            self._job_failed(job, "load" if job.is_promotion else "store", exc)

    def _job_done(self, future: Future[None]) -> None:
        with self._running_lock:
            self._running.discard(future)

    def _store(self, job: TransferJob) -> None:
        started = time.perf_counter()
        keys = [bytes(k) for k in job.keys]
        try:
            client = self._connected()
            try:
                parents = self.parents_of(keys, job.req_context)
            except Exception:  # only an eviction hint: never a reason to fail the store
                log.debug("kvtier: no parents for store job %s", job.job_id, exc_info=True)
                parents = None
            rows = [self._rows[int(chunk)] for chunk in job.chunk_ids]
            # into the agent's staging area; it copies them into the pool and seals them
            result = client.store(self.namespace, keys, rows, parents)
        except AgentUnavailable as exc:
            self._job_failed(job, "store", exc)
            return
        self._set_available(True)
        seconds = time.perf_counter() - started
        nbytes = result.stored * self._row_bytes
        self._record("counter", Metrics.STORE_BYTES, nbytes)
        self._record("histogram", Metrics.STORE_SECONDS, seconds)
        self._finished.put(JobResult(job.job_id, True, None, seconds, nbytes))

    def _load(self, job: TransferJob) -> None:
        started = time.perf_counter()
        keys = list(job.keys)
        try:
            client = self._connected()
            # pool hits straight from the read-only pool (no lease); others via the agent
            done = client.load_into(
                self.namespace,
                [bytes(k) for k in keys],
                [self._rows[int(chunk)] for chunk in job.chunk_ids],
                source_of(job.req_context),
            )
        except AgentUnavailable as exc:
            self._failed_loads.put(keys)
            self._job_failed(job, "load", exc)
            return
        self._set_available(True)
        # A chunk evicted, or its slot given to another chunk, during the copy is not loaded.
        loaded = [k for k, ok in zip(keys, done, strict=True) if ok]
        seconds = time.perf_counter() - started
        nbytes = len(loaded) * self._row_bytes
        self._record("counter", Metrics.LOAD_BYTES, nbytes)
        self._record("histogram", Metrics.LOAD_SECONDS, seconds)
        if len(loaded) == len(keys):
            self._finished.put(JobResult(job.job_id, True, None, seconds, nbytes))
            return
        # Evicted between lookup and load: keep what arrived, recompute the rest.
        arrived = set(loaded)
        self._failed_loads.put([k for k in keys if k not in arrived])
        self._record("counter", Metrics.FAILED_JOBS, 1, ("load",))
        self._finished.put(JobResult(job.job_id, False, tuple(loaded) or None, seconds, nbytes))

    def _poll_events(self) -> None:
        """Fetch what the agent stored or evicted in this namespace, from every engine on
        the node, as vLLM KV events (medium CPU)."""
        try:
            batch = self._connected().events(self.namespace, self._events_after)
        except AgentUnavailable:
            return
        if batch.truncated:
            log.warning("kvtier KV events fell behind the agent's log; some were lost")
        self._events_after = batch.seq
        new = [
            OffloadingEvent(
                keys=[OffloadKey(k) for k in keys],
                medium=self.medium,
                removed=removed,
                locality=self.locality,
            )
            for keys, removed in ((batch.stored, False), (batch.evicted, True))
            if keys
        ]
        if new and self._events is not None:
            with self._events_lock:
                self._events.extend(new)

    def _job_failed(self, job: TransferJob, op: str, exc: Exception) -> None:
        if isinstance(exc, AgentRefused):
            if str(exc) not in self._refusals:  # a configuration error: say it once
                self._refusals.add(str(exc))
                log.error("kvtier agent refused a %s: %s", op, exc)
        else:
            self._client.hello = None
            self._set_available(False, str(exc))
        self._record("counter", Metrics.FAILED_JOBS, 1, (op,))
        self._finished.put(JobResult(job.job_id, False))

    def _record(self, kind: str, name: str, value: float, labels: tuple[str, ...] = ()) -> None:
        with self._stats_lock:
            self._stats.append((kind, name, value, labels))


__all__ = ["KVTierSecondaryTier", "engine_vllm_config"]
