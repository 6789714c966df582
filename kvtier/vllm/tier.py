"""kvtier as a secondary tier of vLLM's tiered KV offloading.

vLLM loads this module inside its scheduler process from the `--kv-transfer-config`
(`"type": "KVTierSecondaryTier", "module_path": "kvtier.vllm.tier"`). Everything here runs
in vLLM's own environment and imports only what vLLM already has (numpy, pyzmq, msgspec).

Nothing blocks the scheduler: a key the node's pool holds is a HIT in the same scheduler step,
found in the index the agent publishes in shared memory (and so is a MISS when the agent has
no secondary tiers); the keys looked up that way reach the agent once per step in one one-way
report. Other lookups are batched into one agent round trip per scheduler step on vLLM's
async-lookup thread (answering RETRY until the batch returns), and stores (into the agent's
staging area) and loads (out of the pool) copy rows of vLLM's primary host buffer on worker
threads (`jobs.py`), reporting through `get_finished_jobs`. An agent that is unreachable or
restarting turns lookups into misses and stores into dropped jobs, counted and logged once
per outage. A key whose load failed is a miss from the moment `get_finished_jobs` reports
the failure: for the rest of every request that asks for it within `FAILED_LOAD_SECONDS`,
and for any request in that time, so vLLM never issues the failed promotion again.
"""

from __future__ import annotations

import itertools
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from kvtier.api.fingerprint import describe, engine_fingerprint, with_hash_seed
from kvtier.client.connection import AgentClient, AgentError, AgentRefused, AgentUnavailable
from kvtier.shm.table import digest, digests
from kvtier.vllm.chains import PrefixChains
from kvtier.vllm.events import EventFeed
from kvtier.vllm.jobs import JobRunner
from kvtier.vllm.metrics import Metrics, Observations, metric_definitions

# A child of vLLM's own logger: vLLM configures only "vllm" (its handler, format and
# VLLM_LOGGING_LEVEL), so this is how the plug-in's lines reach a vLLM user's output.
log = logging.getLogger("vllm.kvtier")

HIT, MISS, RETRY = LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY  # no enum lookups
FAILED_LOAD_SECONDS = 5.0  # a key whose load failed is a miss this long (no retry livelock)


@dataclass
class _FailedLoad:
    """A key whose load failed: a miss until `until` for every request, and for as long as
    they live for the requests that were told so (the one whose load failed included)."""

    until: float
    requests: set[str] = field(default_factory=set)

    def holds(self, req_id: str, now: float) -> bool:
        if req_id in self.requests:
            return True
        if now < self.until:
            self.requests.add(req_id)  # this request keeps the miss it was given
            return True
        return False


def engine_publishes_events(offloading_spec: Any) -> bool:
    """vLLM's engine-wide switch (`--kv-events-config` enable_kv_cache_events): without it
    nothing drains `take_events`, so a tier must stay inert whatever its own flag says."""
    events_config = getattr(offloading_spec, "kv_events_config", None)
    if events_config is None:  # a spec without it: the offloading config carries the flag
        events_config = getattr(offloading_spec, "config", None)
    return getattr(events_config, "enable_kv_cache_events", False) is True


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
    """vLLM's async-lookup helper: one batch per scheduler step, on its own thread.

    The index digests the tier computed for the keys it asks about go along with them
    (`KVTierSecondaryTier.digest_of`), so that a key is digested once; a key whose digest
    the tier no longer keeps is digested by the client."""

    def __init__(self, tier: KVTierSecondaryTier) -> None:
        super().__init__(tier_type=tier.tier_type)
        self._tier = tier

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        found = self._tier.digests_of(keys)
        key_digests = None if None in found else np.array(found, np.uint64)
        return self._tier.agent_lookup(keys, source_of(req_context), key_digests)


DIGESTS_KEPT = 1 << 16  # keys whose index digest the tier keeps (twice this at most)


@dataclass(eq=False)
class _Asked:
    """One request's lookups in this tier (scheduler thread). What the scheduler step
    looked up is told to the prefix chains, reported to the agent and counted once, at the
    end of the step (`KVTierSecondaryTier._settle_asked`), not per key."""

    context: ReqContext
    source: str
    answered: set[OffloadKey] = field(default_factory=set)  # answered from the index
    noted: list[OffloadKey] = field(default_factory=list)  # for the chains, this step
    report: list[int] = field(default_factory=list)  # digests to report, this step
    hits: int = 0  # among `report`
    digested: int = 0  # how many of the context's keys were digested ahead


class KVTierSecondaryTier(SecondaryTierManager):
    """The node's kvtier agent as one secondary tier of vLLM's TieringOffloadingSpec."""

    medium: ClassVar[Medium] = Medium.CPU

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        return metric_definitions()

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
        # The node's host memory is on the engine's node: LOCAL unless configured otherwise
        # (vLLM's base class and its fs tier leave an unconfigured locality None).
        self.locality = Locality(locality) if locality is not None else Locality.LOCAL
        self._rows = np.asarray(primary_kv_view).view(np.uint8)
        self._row_bytes = self._rows.shape[1]
        self._client = AgentClient(agent, timeout=timeout_seconds)
        self._jobs = JobRunner(copy_threads)
        self._events: EventFeed | None = None
        if enable_kv_events and engine_publishes_events(offloading_spec):
            self._events = EventFeed(self.medium, self.locality)
        elif enable_kv_events:
            log.warning(
                "kvtier tier %s: enable_kv_events is set but the engine publishes no KV "
                "events (kv_events_config.enable_kv_cache_events is off); none are fetched",
                tier_type,
            )
        self._observed = Observations()
        self._chains = PrefixChains()  # each stored chunk's parent, for the prefix policy
        self._vllm_config = engine_vllm_config(offloading_spec.config.model.name)
        self._fingerprint = engine_fingerprint(
            offloading_spec.config, self._vllm_config, self._row_bytes, scope
        )
        self._namespace: str | None = None
        self._available: bool | None = None
        self._refusals: set[str] = set()
        self._connect_lock = threading.Lock()
        self._lookup = _AgentLookup(self)
        # Each request's lookups (each key reported once; a request's keys of one step
        # are reported as one request), those of this step's requests still to settle,
        # and the keys' index digests (two generations of at most DIGESTS_KEPT).
        self._asked: dict[str, _Asked] = {}
        self._unsettled: list[_Asked] = []
        self._digests: dict[OffloadKey, int] = {}
        self._older_digests: dict[OffloadKey, int] = {}
        # The published index's probe for this step's lookups (`AgentClient.finder`),
        # made by the step's first lookup.
        self._find: Callable[[int], bool | None] = self._first_find
        # Load jobs in flight, and the keys whose load failed (both on vLLM's side only).
        self._loads: dict[int, TransferJob] = {}
        self._failed: dict[OffloadKey, _FailedLoad] = {}
        self._shut_down = False
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

    def agent_lookup(
        self,
        keys: list[OffloadKey],
        source: str = "",
        key_digests: npt.NDArray[np.uint64] | None = None,
    ) -> list[bool]:
        try:
            client = self._connected()
            raw = [bytes(k) for k in keys]
            hits = client.lookup(self.namespace, raw, source, key_digests).hits
        except AgentError as exc:
            self._lost(exc)
            return [False] * len(keys)
        self._set_available(True)
        self._record("counter", Metrics.LOOKUPS, len(keys))
        self._record("counter", Metrics.HITS, sum(hits))
        return hits

    # --- SecondaryTierManager -------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """On vLLM's scheduler thread, per key: a key the published index answers for costs
        a dict lookup of its digest (kept: `_digest`), a probe of the index and a few list and
        set operations; what is told to others waits for the end of the step."""
        if self._failed:
            failed = self._failed.get(key)
            if failed is not None and failed.holds(req_context.req_id, time.monotonic()):
                return MISS
        asked = self._asked.get(req_context.req_id)
        if asked is None or asked.context is not req_context:
            asked = self._asking(req_context, asked)
        if not asked.noted:
            self._unsettled.append(asked)
        asked.noted.append(key)
        if asked.source:  # direct mode: the agent asks the source
            found = self._lookup.lookup(key, req_context)
        else:
            key_digest = self._digests.get(key)
            if key_digest is None:
                key_digest = self._digest(key, asked)
            held = self._find(key_digest)
            if held is not None:
                if key not in asked.answered:
                    asked.answered.add(key)
                    asked.report.append(key_digest)
                    if held:
                        asked.hits += 1
                return HIT if held else MISS
            found = self._lookup.lookup(key, req_context)
        if found is None:
            return RETRY
        return HIT if found else MISS

    def _first_find(self, key_digest: int) -> bool | None:
        """The step's first probe of the index: it makes the probe the step's other
        lookups use (whether the index is live and answers alone, asked once a step)."""
        self._find = self._client.finder()
        return self._find(key_digest)

    def _asking(self, req_context: ReqContext, asked: _Asked | None) -> _Asked:
        """The request's record, made on its first lookup (or taken over by a new context
        of the same request id)."""
        if asked is None:
            asked = self._asked[req_context.req_id] = _Asked(req_context, source_of(req_context))
        else:
            asked.context, asked.source = req_context, source_of(req_context)
            asked.digested = 0
        return asked

    def _digest(self, key: OffloadKey, asked: _Asked) -> int:
        """The index digest of a key not kept yet. vLLM records every key of a request
        with its position in the request's context before it looks any up: those not
        digested yet are digested together (vectorised), so the request's later lookups
        find theirs kept. A key the context does not name is digested alone."""
        kept, older = self._digests, self._older_digests
        key_digest = older.get(key)
        if key_digest is None:
            positions = getattr(asked.context, "_offload_key_positions", None)
            if isinstance(positions, dict) and len(positions) > asked.digested:
                ahead = [
                    k
                    for k in itertools.islice(positions, asked.digested, None)
                    if k not in kept and k not in older
                ]
                asked.digested = len(positions)
                if len(ahead) > 1:
                    kept.update(zip(ahead, digests(self.namespace, ahead).tolist(), strict=True))
                    key_digest = kept.get(key)
            if key_digest is None:
                key_digest = digest(self.namespace, bytes(key))
        kept[key] = key_digest
        if len(kept) > DIGESTS_KEPT:
            self._older_digests, self._digests = kept, {}
        return key_digest

    def digests_of(self, keys: list[OffloadKey]) -> list[int | None]:
        """The kept index digests of `keys` (None for a key not kept); any thread."""
        kept, older = self._digests, self._older_digests
        return [kept.get(k) or older.get(k) for k in keys]

    def _settle_asked(self) -> None:
        """This step's lookups: to the prefix chains, and those answered from the index to
        the agent (each request's keys as one request) and to the metrics."""
        unsettled, self._unsettled = self._unsettled, []
        lookups = hits = 0
        for asked in unsettled:
            if asked.noted:
                self._chains.note(asked.noted, asked.context)
                asked.noted = []
            if asked.report:
                self._client.reports.request(self.namespace, np.array(asked.report, np.uint64))
                lookups += len(asked.report)
                hits += asked.hits
                asked.report, asked.hits = [], 0
        if lookups:
            self._record("counter", Metrics.LOOKUPS, lookups)
            if hits:
                self._record("counter", Metrics.HITS, hits)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookup.cleanup(req_context.req_id)
        asked = self._asked.pop(req_context.req_id, None)
        if asked is not None and asked.noted:
            self._settle_asked()  # before the chains forget the request
        self._chains.forget(req_context.req_id)
        for failed in self._failed.values():
            failed.requests.discard(req_context.req_id)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._find = self._first_find
        now = time.monotonic()
        if self._failed:
            self._failed = {k: f for k, f in self._failed.items() if f.requests or f.until > now}
        self._lookup.flush()
        # the lookups answered here this step, one request each, to the agent in one
        # one-way message (it counts them, refreshes recency, logs the requests), and the
        # bytes loaded without a lease
        self._settle_asked()
        self._client.flush_reports(block=False)
        if self._events is not None and self._events.due(now):
            self._events.polling(self._jobs.run_soon(self._poll_events))

    def submit_store(self, job_metadata: TransferJob) -> None:
        if self._unsettled:  # the chains know the keys looked up before it asks parents
            self._settle_asked()
        self._jobs.submit(lambda: self._run_job(self._store, job_metadata))

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._loads[job_metadata.job_id] = job_metadata
        self._jobs.submit(lambda: self._run_job(self._load, job_metadata))

    def get_finished_jobs(self) -> Iterable[JobResult]:
        """The jobs finished since last asked. A failed load's keys (all of them, or those
        not among its `successful_keys`) are misses from here on, before vLLM sees the
        failure: its next lookup must not answer HIT for a promotion that just failed."""
        results: list[JobResult] = self._jobs.finished()
        now = time.monotonic()
        for result in results:
            job = self._loads.pop(result.job_id, None)
            if job is None or result.success:
                continue
            arrived = set(result.successful_keys or ())
            for key in job.keys:
                if key not in arrived:
                    failed = self._failed.get(key) or _FailedLoad(0.0)
                    failed.until = now + FAILED_LOAD_SECONDS
                    failed.requests.add(job.req_context.req_id)
                    self._failed[key] = failed
        return results

    def has_pending_work(self) -> bool:
        return self._jobs.pending()

    def drain_jobs(self) -> None:
        """Wait for every copy in flight; none is ever cut short."""
        self._jobs.drain()

    def take_events(self) -> Iterable[OffloadingEvent]:
        return self._events.take() if self._events is not None else []

    def get_stats(self) -> Any:
        return self._observed.stats()

    def shutdown(self) -> None:
        """Idempotent: vLLM may shut a tier down twice, and an error here would keep it from
        shutting down its primary tier (whose shared-memory buffer then stays mapped)."""
        if self._shut_down:
            return
        self._shut_down = True
        self.drain_jobs()
        poll = self._events.running() if self._events is not None else None
        if poll is not None:
            wait_futures([poll])
        self._jobs.shutdown()
        self._lookup.shutdown()
        self._client.close()
        # vLLM can only unmap its buffer once no view of it is left
        self._rows = np.empty((0, self._row_bytes), np.uint8)

    # --- jobs (worker threads) ------------------------------------------------------------

    def _run_job(self, work: Any, job: TransferJob) -> None:
        """Every job ends with a result, whatever happens: vLLM waits for it."""
        try:
            work(job)
        except Exception as exc:
            log.exception("kvtier job %s failed unexpectedly", job.job_id)
            self._lost(exc)
            self._job_failed(job, "load" if job.is_promotion else "store")

    def _store(self, job: TransferJob) -> None:
        started = time.perf_counter()
        keys = [bytes(k) for k in job.keys]
        try:
            client = self._connected()
            try:
                parents = self._chains.parents(keys, job.req_context)
            except Exception:  # only an eviction hint: never a reason to fail the store
                log.debug("kvtier: no parents for store job %s", job.job_id, exc_info=True)
                parents = None
            rows = [self._rows[int(chunk)] for chunk in job.chunk_ids]
            # into the agent's staging area; it copies them into the pool and seals them
            result = client.store(self.namespace, keys, rows, parents)
        except AgentRefused as exc:
            self._refused("store", exc)
            self._job_failed(job, "store")
            return
        except AgentUnavailable as exc:
            self._lost(exc)
            self._job_failed(job, "store")
            return
        self._set_available(True)
        seconds = time.perf_counter() - started
        nbytes = result.stored * self._row_bytes
        self._record("counter", Metrics.STORE_BYTES, nbytes)
        self._record("histogram", Metrics.STORE_SECONDS, seconds)
        self._jobs.finish(JobResult(job.job_id, True, None, seconds, nbytes))

    def _load(self, job: TransferJob) -> None:
        started = time.perf_counter()
        keys = list(job.keys)
        try:
            client = self._connected()
            # pool hits straight from the read-only pool (no lease); others via the agent
            raw = [bytes(k) for k in keys]
            source = source_of(job.req_context)  # direct mode: the agent asks the source
            done = client.load_into(
                self.namespace,
                raw,
                [self._rows[int(chunk)] for chunk in job.chunk_ids],
                source,
                None if source else self._load_digests(raw, self.digests_of(keys)),
            )
        except AgentRefused as exc:
            self._refused("load", exc)
            self._job_failed(job, "load")
            return
        except AgentUnavailable as exc:
            self._lost(exc)
            self._job_failed(job, "load")
            return
        self._set_available(True)
        # A chunk evicted, or its slot given to another chunk, during the copy is not loaded.
        loaded = [k for k, ok in zip(keys, done, strict=True) if ok]
        seconds = time.perf_counter() - started
        nbytes = len(loaded) * self._row_bytes
        self._record("counter", Metrics.LOAD_BYTES, nbytes)
        self._record("histogram", Metrics.LOAD_SECONDS, seconds)
        if len(loaded) == len(keys):
            self._jobs.finish(JobResult(job.job_id, True, None, seconds, nbytes))
            return
        # Evicted between lookup and load: keep what arrived, recompute the rest.
        self._record("counter", Metrics.FAILED_JOBS, 1, ("load",))
        self._jobs.finish(JobResult(job.job_id, False, tuple(loaded) or None, seconds, nbytes))

    def _load_digests(self, raw: list[bytes], kept: list[int | None]) -> list[int]:
        """The index digests of a load's keys: those kept from their lookups, the others
        digested one by one in plain integers (vectorised, numpy would let go of the GIL
        and wait to take it back: `AgentClient.load_into`)."""
        namespace = self.namespace
        return [digest(namespace, k) if d is None else d for k, d in zip(raw, kept, strict=True)]

    def _poll_events(self) -> None:
        """What the agent stored or evicted in this namespace, as vLLM KV events."""
        assert self._events is not None
        try:
            self._events.poll(self._connected(), self.namespace)
        except AgentError:
            return

    def _lost(self, exc: Exception) -> None:
        """The agent did not answer: misses until it does (the next call says hello)."""
        self._client.disconnected()
        self._find = self._first_find
        self._set_available(False, str(exc))

    def _refused(self, op: str, exc: AgentRefused) -> None:
        """A configuration error, not an outage: said once."""
        if str(exc) not in self._refusals:
            self._refusals.add(str(exc))
            log.error("kvtier agent refused a %s: %s", op, exc)

    def _job_failed(self, job: TransferJob, op: str) -> None:
        self._record("counter", Metrics.FAILED_JOBS, 1, (op,))
        self._jobs.finish(JobResult(job.job_id, False))

    def _record(self, kind: str, name: str, value: float, labels: tuple[str, ...] = ()) -> None:
        self._observed.record(kind, name, value, labels)


__all__ = ["KVTierSecondaryTier", "engine_vllm_config"]
