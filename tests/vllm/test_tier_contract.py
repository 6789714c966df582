"""The kvtier tier under the contract vLLM's `TieringOffloadingManager` holds a secondary tier
to (`vllm.v1.kv_offload.tiering.base`), driven the way the manager drives one: store and
load jobs on pinned rows of the engine's primary buffer, results taken from
`get_finished_jobs`, lookups repeated once per scheduler step until they settle, events and
stats collected after the step. Each test names the case of vLLM's own tier tests it answers
(test_vllm_published.py accounts for every one of those cases); the last ones cover what
vLLM's tests cannot: an agent restarted under a live engine, two engines storing one key at
once, one hash in two KV groups, and the stats as vLLM's metrics read them.
"""

from __future__ import annotations

import dataclasses
import glob
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.tiering.base import JobResult, TransferJob
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from kvtier.api.config import AgentConfig
from kvtier.bench.vllm_scheduler import (
    ROW,
    Engine,
    chunk_key,
    chunk_row,
    kvtier_extra_config,
    offloading_config,
)
from kvtier.client import connection
from kvtier.client import protocol as p
from kvtier.client.connection import AgentClient, AgentUnavailable
from kvtier.local.agent import AgentProcess
from kvtier.vllm import tier as plugin
from kvtier.vllm.tier import KVTierSecondaryTier
from tests.vllm.conftest import engine_of

HIT, MISS, RETRY, PENDING = (
    LookupResult.HIT,
    LookupResult.MISS,
    LookupResult.RETRY,
    LookupResult.HIT_PENDING,
)
ROWS = 16  # rows of the primary buffer the tests' engines have
StartAgent = Callable[[AgentConfig], AgentProcess]
MakeEngine = Callable[..., Engine]
_job_ids = itertools.count(1)


def job(
    keys: list[OffloadKey], chunks: list[int], ctx: ReqContext, promotion: bool = False
) -> TransferJob:
    """A job as the manager builds one: keys, and the pinned primary rows they go to or
    come from."""
    return TransferJob(
        job_id=next(_job_ids),
        keys=list(keys),
        chunk_ids=np.array(chunks, dtype=np.int64),
        is_promotion=promotion,
        req_context=ctx,
    )


class Driver:
    """One tier driven as `TieringOffloadingManager` drives a secondary tier."""

    def __init__(self, tier: KVTierSecondaryTier, rows: np.ndarray[Any, Any]) -> None:
        self.tier = tier
        self.rows = rows
        self.ctx = ReqContext(req_id="contract")

    def finished(self) -> list[JobResult]:
        """What vLLM's reset_cache does: drain, then take every result."""
        self.tier.drain_jobs()
        return list(self.tier.get_finished_jobs())

    def store(self, keys: list[OffloadKey], chunks: list[int]) -> JobResult:
        self.tier.submit_store(job(keys, chunks, self.ctx))
        (result,) = self.finished()
        return result

    def load(self, keys: list[OffloadKey], chunks: list[int], ctx: ReqContext) -> JobResult:
        self.tier.submit_load(job(keys, chunks, ctx, promotion=True))
        (result,) = self.finished()
        return result

    def step(self) -> None:
        self.tier.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))

    def lookup(self, keys: list[OffloadKey], ctx: ReqContext | None = None) -> list[LookupResult]:
        """Once per scheduler step until no answer is RETRY."""
        ctx = ctx or self.ctx
        deadline = time.monotonic() + 10
        while True:
            answers = [self.tier.lookup(k, ctx) for k in keys]
            if RETRY not in answers:
                return answers
            assert time.monotonic() < deadline, answers
            self.step()
            time.sleep(0.01)

    def events(self, want: int, seconds: float = 5.0) -> list[OffloadingEvent]:
        """Steps until `want` keys were reported (or `seconds` passed)."""
        events: list[OffloadingEvent] = []
        deadline = time.monotonic() + seconds
        while sum(len(e.keys) for e in events) < want and time.monotonic() < deadline:
            self.step()
            events += self.tier.take_events()
            time.sleep(0.05)
        return events


@pytest.fixture
def driver(agent_config: AgentConfig, agent_factory: StartAgent, engines: MakeEngine) -> Driver:
    """The tier of an engine vLLM's TieringOffloadingSpec built from the injected config."""
    agent_factory(agent_config)
    engine = engines(agent_config)
    return Driver(engine.tier, engine.rows)


@pytest.fixture
def bare_tiers(
    agent_config: AgentConfig, agent_factory: StartAgent, vllm_config: Any
) -> Iterator[Callable[..., Driver]]:
    """Tiers made by vLLM's SecondaryTierFactory for a spec whose engine-wide KV-events
    switch is `engine_events`, with the tier options given."""
    agent_factory(agent_config)
    made: list[KVTierSecondaryTier] = []

    def make(engine_events: bool = True, **options: Any) -> Driver:
        from vllm.config import set_current_vllm_config

        extra = kvtier_extra_config(agent_config, ROWS)
        config = offloading_config(extra, str(vllm_config.model_config.model), "float16")
        spec = TieringOffloadingSpec(
            dataclasses.replace(config, enable_kv_cache_events=engine_events)
        )
        rows = np.zeros((ROWS, ROW), np.uint8)
        tier_config = {**extra["secondary_tiers"][0], **options}
        with set_current_vllm_config(vllm_config):
            tier = SecondaryTierFactory.create_secondary_tier(tier_config, memoryview(rows), spec)
        assert isinstance(tier, KVTierSecondaryTier)
        made.append(tier)
        return Driver(tier, rows)

    yield make
    for tier in made:
        tier.shutdown()


def break_copies(
    tier: KVTierSecondaryTier,
    monkeypatch: pytest.MonkeyPatch,
    failing: set[OffloadKey],
    gate: threading.Event | None = None,
) -> list[list[bytes]]:
    """From now on the agent's copy of `failing` into vLLM's rows fails, as `load_into`
    reports a slot given to another chunk during the copy, while the agent keeps holding
    those keys (its index still says so). `gate`, when given, holds each load until set.
    Returns the keys of every load asked for."""
    real = tier._client.load_into
    asked: list[list[bytes]] = []

    def load_into(namespace: str, keys: list[bytes], outs: list[Any], *rest: Any) -> Any:
        asked.append(list(keys))
        if gate is not None:
            assert gate.wait(10)
        done = real(namespace, keys, outs, *rest)
        return [ok and OffloadKey(k) not in failing for k, ok in zip(keys, done, strict=True)]

    monkeypatch.setattr(tier._client, "load_into", load_into)
    return asked


def answer_through_the_agent(tier: KVTierSecondaryTier, monkeypatch: pytest.MonkeyPatch) -> None:
    """No published index to read (before the first hello, or while an agent restarts):
    every lookup goes to the agent through vLLM's async-lookup helper (RETRY first)."""
    monkeypatch.setattr(tier._client, "finder", lambda: lambda digest: None)
    tier.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))


# --- lookups, stores, loads -------------------------------------------------------------


def test_the_index_is_checked_once_a_step_and_again_after_an_outage(
    driver: Driver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step's lookups ask the client for its index's finder once (the liveness check is
    a system call), every step anew, and again after the agent was found unreachable."""
    tier, keys = driver.tier, [chunk_key(i) for i in range(4)]
    assert driver.store(keys[:2], [0, 1]).success
    made = []
    finder = tier._client.finder
    monkeypatch.setattr(tier._client, "finder", lambda: made.append(1) or finder())
    driver.step()
    for expected in (1, 2):
        assert [tier.lookup(k, driver.ctx) for k in keys] == [HIT, HIT, MISS, MISS]
        assert len(made) == expected
        driver.step()
    tier.lookup(keys[0], driver.ctx)
    tier._lost(AgentUnavailable("gone"))
    tier.lookup(keys[0], driver.ctx)
    assert len(made) == 4


def test_store_then_lookup_hits_and_a_load_leaves_the_chunk(driver: Driver) -> None:
    """vLLM: test_store_creates_file_and_lookup_succeeds, test_store_then_load_roundtrip."""
    keys = [chunk_key(1), chunk_key(2)]
    driver.rows[0], driver.rows[1] = chunk_row(1), chunk_row(2)
    stored = driver.store(keys, [0, 1])
    assert stored.success and stored.transfer_bytes == 2 * ROW
    assert driver.lookup(keys) == [HIT, HIT]
    loaded = driver.load(keys, [2, 3], driver.ctx)
    assert loaded.success and loaded.transfer_bytes == 2 * ROW
    assert np.array_equal(driver.rows[2], chunk_row(1))
    assert np.array_equal(driver.rows[3], chunk_row(2))
    # a load copies out: the chunks stay, for this request and a new one
    assert driver.lookup(keys) == [HIT, HIT]
    assert driver.lookup(keys, ReqContext(req_id="later")) == [HIT, HIT]


def test_lookups_answered_from_the_index_reach_the_agent_once_per_request_and_step(
    driver: Driver, agent_config: AgentConfig
) -> None:
    """A key the published index answers is reported to the agent once per request, and a
    request's keys of one step as one logged request: the agent counts and logs them as
    if it had answered them."""
    keys = [chunk_key(1), chunk_key(2), chunk_key(3)]
    driver.rows[0], driver.rows[1] = chunk_row(1), chunk_row(2)
    assert driver.store(keys[:2], [0, 1]).success
    with AgentClient(agent_config.endpoint) as client:
        before = client.stats().host
        assert driver.lookup(keys) == [HIT, HIT, MISS]  # the agent has no other tier
        assert driver.lookup(keys) == [HIT, HIT, MISS]  # asked again, reported once
        driver.step()
        deadline = time.monotonic() + 10
        while (after := client.stats().host).lookups < before.lookups + 3:
            assert time.monotonic() < deadline, after
            time.sleep(0.02)
        assert (after.lookups - before.lookups, after.hits - before.hits) == (3, 2)
        logged = client._call(p.AccessLog(0), p.AccessLogReply).requests
        assert [(len(r.ids), r.hits) for r in logged] == [(3, 2)]


def test_a_lookup_that_asks_the_agent_digests_its_key_once(
    make_config: Callable[..., AgentConfig],
    agent_factory: StartAgent,
    engines: MakeEngine,
    scratch: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A key the pool misses while the agent has a secondary tier goes to the agent: the
    digest the tier computed to ask the published index travels with it, and the client
    digests nothing again."""
    fs = {"name": "fs", "filesystem": {"path": str(scratch / "fs"), "capacity": "16Mi"}}
    config = make_config({"tiers": [fs]}, chunkBytes=ROW)
    agent_factory(config)
    engine = engines(config)
    driver = Driver(engine.tier, engine.rows)
    by_tier: list[bytes] = []
    by_client: list[bytes] = []
    one, many = plugin.digest, connection.digests
    monkeypatch.setattr(plugin, "digest", lambda ns, key: by_tier.append(key) or one(ns, key))
    monkeypatch.setattr(
        connection, "digests", lambda ns, keys: by_client.extend(keys) or many(ns, keys)
    )
    keys = [chunk_key(7), chunk_key(8)]
    assert driver.lookup(keys) == [MISS, MISS]  # the agent looked in its tier too
    assert set(by_tier) == {bytes(k) for k in keys}
    assert by_client == []


def test_a_requests_keys_are_digested_together_and_its_lookups_settled_once_a_step(
    driver: Driver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM records every key of a request with its position before it looks any up: the
    first lookup digests them all in one vectorised pass, the later ones find theirs kept.
    What the step looked up reaches the prefix chains, the agent's reports and the metrics
    at the end of the step, each key once per request."""
    stored = [chunk_key(i) for i in range(3)]
    driver.rows[:3] = 7
    assert driver.store(stored, [0, 1, 2]).success
    keys = [*stored, chunk_key(50), chunk_key(51)]
    ctx = ReqContext(req_id="positions")
    for i, key in enumerate(keys):
        ctx.set_offload_key_position(key, 32 * (i + 1))
    one_by_one: list[bytes] = []
    together: list[list[bytes]] = []
    one, many = plugin.digest, plugin.digests
    monkeypatch.setattr(plugin, "digest", lambda ns, k: one_by_one.append(k) or one(ns, k))
    monkeypatch.setattr(plugin, "digests", lambda ns, ks: together.append(list(ks)) or many(ns, ks))
    tier = driver.tier
    for _ in range(2):
        assert [tier.lookup(k, ctx) for k in keys] == [HIT, HIT, HIT, MISS, MISS]
    assert one_by_one == [] and together == [keys]
    assert tier._chains.parents([bytes(chunk_key(52))], ctx) is None  # not settled yet
    sent: list[p.Looked] = []
    real_take = tier._client.reports.take

    def take() -> list[p.Looked]:
        messages = real_take()
        sent.extend(messages)
        return messages

    monkeypatch.setattr(tier._client.reports, "take", take)
    tier.get_stats()  # what the store recorded
    driver.step()
    ctx.set_offload_key_position(chunk_key(52), 32 * 6)
    assert tier._chains.parents([bytes(chunk_key(52))], ctx) == [bytes(keys[-1])]
    counts = tier.get_stats().data["data"]
    assert sum(counts["vllm:kvtier_lookup_keys"].values()) == 5
    assert sum(counts["vllm:kvtier_lookup_hits"].values()) == 3
    tier._client.flush_reports()
    reported = [m for m in sent if m.sizes]
    assert [m.sizes for m in reported] == [[5]]  # one request of each key once
    tier.on_request_finished(ctx)


def test_a_refused_store_is_said_once_and_is_no_outage(
    make_config: Callable[..., AgentConfig],
    agent_factory: StartAgent,
    engines: MakeEngine,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An agent whose slots are smaller than vLLM's rows refuses every store: a configuration
    error, logged once and counted per job, while the agent stays available."""
    config = make_config(chunkBytes=ROW // 2)
    agent_factory(config)
    engine = engines(config)
    driver = Driver(engine.tier, engine.rows)
    said: list[str] = []
    monkeypatch.setattr(plugin.log, "error", lambda message, *args: said.append(message % args))
    for i in range(3):
        assert not driver.store([chunk_key(i)], [i]).success
    assert said and len(set(said)) == len(said) < 3, said  # each reason once
    assert all("chunkBytes" in message for message in said)
    assert driver.tier._available is not False
    stats = engine.manager.get_stats()
    assert stats is not None
    assert stats.data["data"]["vllm:kvtier_failed_jobs"] == {("store",): 3}


@pytest.mark.parametrize("batch", [0, 1, 2, 5])
def test_store_load_data_integrity(driver: Driver, batch: int) -> None:
    """vLLM: test_store_load_data_integrity (batches of any size, the empty one included),
    loading into rows disjoint from the stored ones."""
    rng = np.random.default_rng(batch)
    driver.rows[:] = rng.integers(0, 256, driver.rows.shape, dtype=np.uint8)
    expected = driver.rows[:batch].copy()
    keys = [chunk_key(100 + i) for i in range(batch)]
    assert driver.store(keys, list(range(batch))).success
    driver.rows[:] = 0  # what arrives is what the agent holds
    assert driver.load(keys, list(range(ROWS - batch, ROWS)), driver.ctx).success
    assert np.array_equal(driver.rows[ROWS - batch :], expected)


def test_partial_load_keeps_what_arrived(driver: Driver, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM: test_batched_partial_load_failure_keeps_loaded_blocks. The failed job names
    the keys that arrived; only the others are misses, for its request and a new one."""
    keys = [chunk_key(i) for i in (1, 2, 3)]
    assert driver.store(keys, [0, 1, 2]).success
    ctx = ReqContext(req_id="partial")
    assert driver.lookup(keys, ctx) == [HIT] * 3
    break_copies(driver.tier, monkeypatch, {keys[2]})
    result = driver.load(keys, [3, 4, 5], ctx)
    assert not result.success
    assert tuple(result.successful_keys or ()) == (keys[0], keys[1])
    assert [driver.tier.lookup(k, ctx) for k in keys] == [HIT, HIT, MISS]
    driver.tier.on_request_finished(ctx)
    assert driver.lookup(keys, ReqContext(req_id="fresh")) == [HIT, HIT, MISS]


def test_load_failing_whole_marks_every_key(
    driver: Driver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM: test_batched_load_first_block_fails_marks_whole_batch. kvtier keeps any key
    that arrived (not only a prefix); when none did, `successful_keys` is None and the
    whole job is a miss for the request."""
    keys = [chunk_key(i) for i in (1, 2, 3)]
    assert driver.store(keys, [0, 1, 2]).success
    ctx = ReqContext(req_id="whole")
    assert driver.lookup(keys, ctx) == [HIT] * 3
    break_copies(driver.tier, monkeypatch, set(keys))
    result = driver.load(keys, [3, 4, 5], ctx)
    assert not result.success and result.successful_keys is None
    assert [driver.tier.lookup(k, ctx) for k in keys] == [MISS] * 3


@pytest.mark.parametrize("path", ["index", "agent"])
def test_failed_load_is_a_miss_from_get_finished_jobs_on(
    driver: Driver, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    """vLLM: test_failed_load_corrects_verdict_and_removes_corrupt_file (the failed-load
    livelock, vLLM #49176). Once get_finished_jobs has reported a failed load, the same
    request's next lookup of the key is a MISS, before any scheduler step ends, and stays
    one, whether the published index or the agent answered it; a new request is a miss
    for FAILED_LOAD_SECONDS, then asks again."""
    monkeypatch.setattr(plugin, "FAILED_LOAD_SECONDS", 0.5)
    tier, k = driver.tier, chunk_key(1)
    if path == "agent":
        answer_through_the_agent(tier, monkeypatch)
    assert driver.store([k], [0]).success
    ctx = ReqContext(req_id="livelock")
    assert driver.lookup([k], ctx) == [HIT]
    assert driver.load([k], [1], ctx).success  # a good load changes nothing
    assert tier.lookup(k, ctx) is HIT

    break_copies(tier, monkeypatch, {k})
    assert not driver.load([k], [1], ctx).success
    answers = []
    for _ in range(6):
        answers.append(tier.lookup(k, ctx))
        driver.step()
        time.sleep(0.02)
    assert answers == [MISS] * 6
    assert driver.lookup([k], ReqContext(req_id="fresh")) == [MISS]
    time.sleep(0.6)
    assert tier.lookup(k, ctx) is MISS  # for the whole life of the request told so
    assert driver.lookup([k], ReqContext(req_id="later")) == [HIT]


@pytest.mark.parametrize("path", ["index", "agent"])
def test_failed_load_after_its_request_finished_spares_a_newer_lookup(
    driver: Driver, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    """vLLM: test_failed_load_after_abort_does_not_break_newer_probe. Request A's load
    fails after A finished and B looked the key up; B's next lookup is a MISS, and nothing
    raises on the scheduler thread (vLLM 0.32's async-lookup helper asserts when a probe
    in flight is forced to a verdict)."""
    tier, k = driver.tier, chunk_key(1)
    if path == "agent":
        answer_through_the_agent(tier, monkeypatch)
    assert driver.store([k], [0]).success
    ctx_a, ctx_b = ReqContext(req_id="A"), ReqContext(req_id="B")
    assert driver.lookup([k], ctx_a) == [HIT]
    gate = threading.Event()
    break_copies(tier, monkeypatch, {k}, gate)
    tier.submit_load(job([k], [1], ctx_a, promotion=True))
    tier.on_request_finished(ctx_a)
    assert tier.lookup(k, ctx_b) is (RETRY if path == "agent" else HIT)
    driver.step()  # B's probe goes out
    gate.set()
    assert [r.success for r in driver.finished()] == [False]
    time.sleep(0.2)  # B's probe answers
    assert tier.lookup(k, ctx_b) is MISS
    driver.step()
    assert tier.lookup(k, ctx_b) is MISS


def test_failed_promotion_is_not_issued_again(
    agent_config: AgentConfig,
    agent_factory: StartAgent,
    engines: MakeEngine,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM: test_failed_promotion_keeps_only_successful_chunks, through vLLM's manager.
    The chunk whose copy failed is recomputed (MISS), the others are promoted (HIT), and
    the failed promotion is asked for once: no livelock."""
    agent_factory(agent_config)
    engine = engines(agent_config)
    engine.store([1, 2, 3])
    engine.reset_primary()
    asked = break_copies(engine.tier, monkeypatch, {chunk_key(2)})
    answers, _ = engine.lookup([1, 2, 3], timeout=5)
    assert answers == [HIT, MISS, HIT]
    assert sum(bytes(chunk_key(2)) in keys for keys in asked) == 1
    rows = engine.read([1, 3])
    assert np.array_equal(rows[0], chunk_row(1)) and np.array_equal(rows[1], chunk_row(3))


# --- drain and shutdown -----------------------------------------------------------------


def test_reset_cache_waits_for_a_store_in_flight(
    agent_config: AgentConfig,
    agent_factory: StartAgent,
    engines: MakeEngine,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM: test_wait_idle_blocks_until_tasks_complete, test_reset_cache_drains_all_tiers.
    vLLM's reset_cache drains the tier before it reuses the primary rows: drain_jobs waits
    for the copy in flight and cuts none short."""
    agent_factory(agent_config)
    engine = engines(agent_config)
    tier = engine.tier
    gate = threading.Event()
    real_store = tier._client.store

    def held_store(*args: Any, **kwargs: Any) -> Any:
        assert gate.wait(10)
        return real_store(*args, **kwargs)

    monkeypatch.setattr(tier._client, "store", held_store)
    ctx, keys = engine.begin_store([1, 2])
    engine.manager.complete_store(keys, ctx)  # the cascade: a store job on the tier
    assert tier.has_pending_work()
    reset = threading.Thread(target=engine.reset_primary)
    reset.start()
    reset.join(0.3)
    assert reset.is_alive()  # waiting for the copy
    gate.set()
    reset.join(10)
    assert not reset.is_alive() and not tier.has_pending_work()
    with AgentClient(agent_config.endpoint) as client:
        assert client.stats().host.namespaces[tier.namespace] == 2  # stored whole


def test_shutdown_twice_then_the_manager_shuts_down_its_primary_tier(
    agent_config: AgentConfig, agent_factory: StartAgent, vllm_config: Any
) -> None:
    """vLLM: test_shutdown_discards_pending_tasks (whose fixture shuts the shut-down tier
    down again). Shutdown right after submitting returns with no thread of the tier left
    and every job's result queued (kvtier finishes queued copies rather than dropping
    them); a second shutdown does nothing, so vLLM's manager, shutting its tiers down,
    goes on to unmap its primary buffer."""
    agent_factory(agent_config)
    before = set(threading.enumerate())
    regions = set(glob.glob("/dev/shm/vllm_offload_*"))
    engine = engine_of(vllm_config, kvtier_extra_config(agent_config, ROWS))
    tier = engine.tier
    jobs = [job([chunk_key(i)], [i % 4], ReqContext(req_id="s")) for i in range(10)]
    for submitted in jobs:
        tier.submit_store(submitted)
    tier.shutdown()
    assert not [t for t in set(threading.enumerate()) - before if t.is_alive()]
    assert sorted(r.job_id for r in tier.get_finished_jobs()) == [j.job_id for j in jobs]
    tier.shutdown()
    assert set(glob.glob("/dev/shm/vllm_offload_*")) - regions  # the engine's buffer
    engine.close()  # the manager: its tiers' shutdown once more, then the primary tier's
    assert set(glob.glob("/dev/shm/vllm_offload_*")) == regions


# --- events -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("engine_events", "tier_events"), [(False, True), (True, False)], ids=["engine", "tier"]
)
def test_no_events_and_no_polls_unless_both_switches_are_on(
    bare_tiers: Callable[..., Driver],
    monkeypatch: pytest.MonkeyPatch,
    engine_events: bool,
    tier_events: bool,
) -> None:
    """vLLM: test_events_require_global_kv_events_flag, test_events_disabled_by_default.
    A tier's enable_kv_events takes effect only when the engine publishes KV events
    (kv_events_config.enable_kv_cache_events); otherwise nothing asks the agent for them."""
    driver = bare_tiers(engine_events, enable_kv_events=tier_events)
    polls: list[int] = []
    real_events = driver.tier._client.events
    monkeypatch.setattr(
        driver.tier._client, "events", lambda *a: polls.append(1) or real_events(*a)
    )
    driver.rows[0] = chunk_row(1)
    assert driver.store([chunk_key(1)], [0]).success
    assert driver.events(1, seconds=1.2) == []
    assert polls == []


@pytest.mark.parametrize(
    ("locality", "expected"), [(None, Locality.LOCAL), ("REMOTE", Locality.REMOTE)]
)
def test_stores_reach_vllm_as_events(
    bare_tiers: Callable[..., Driver], locality: str | None, expected: Locality
) -> None:
    """vLLM: test_successful_store_emits_stored_event, test_store_event_uses_configured_locality,
    test_load_job_emits_no_event, test_mixed_job_results_emit_event_only_for_successful_job.
    What the agent stored in the engine's namespace arrives as stored events (medium CPU,
    the configured locality, LOCAL when none is: the node's memory is the engine's node's);
    take_events drains them; loads and failed stores add none."""
    options = {} if locality is None else {"locality": locality}
    driver = bare_tiers(True, enable_kv_events=True, **options)
    assert driver.tier.locality is expected
    keys = [chunk_key(1), chunk_key(2)]
    assert driver.store(keys, [0, 1]).success
    events = driver.events(2)
    assert {k for e in events for k in e.keys} == set(keys)
    assert all(e.medium is Medium.CPU and e.locality is expected and not e.removed for e in events)
    assert list(driver.tier.take_events()) == []

    assert driver.load(keys, [2, 3], driver.ctx).success
    driver.tier.submit_store(job([chunk_key(3)], [ROWS + 1], driver.ctx))  # a row past the end
    driver.tier.submit_store(job([chunk_key(4)], [4], driver.ctx))
    assert sorted(r.success for r in driver.finished()) == [False, True]
    events = driver.events(2, seconds=1.2)
    assert [k for e in events for k in e.keys] == [chunk_key(4)]


def test_cascade_through_the_manager_surfaces_the_tiers_events(
    agent_config: AgentConfig, agent_factory: StartAgent, engines: MakeEngine
) -> None:
    """vLLM: test_cascade_store_emits_fs_event_through_tiering_manager,
    test_take_events_aggregates_tier_owned_events. A store vLLM cascades to the tier comes
    back through the manager's take_events, beside the primary tier's own events."""
    agent_factory(agent_config)
    engine = engines(agent_config)
    keys = engine.store([1, 2])
    events: list[OffloadingEvent] = []
    deadline = time.monotonic() + 5
    while len([e for e in events if e.locality is Locality.LOCAL]) < 1:
        assert time.monotonic() < deadline, events
        engine.step()
        events += engine.manager.take_events()
        time.sleep(0.05)
    ours = [e for e in events if e.locality is Locality.LOCAL]  # the primary tier's: None
    assert {k for e in ours for k in e.keys} == set(keys)
    assert all(e.medium is Medium.CPU and not e.removed for e in ours)


def test_the_factory_forwards_locality(
    bare_tiers: Callable[..., Driver],
) -> None:
    """vLLM: test_factory_forwards_locality_to_fs_tier (invalid values: run as published)."""
    assert bare_tiers(locality="REMOTE").tier.locality is Locality.REMOTE
    assert bare_tiers(locality="LOCAL").tier.locality is Locality.LOCAL
    assert bare_tiers().tier.locality is Locality.LOCAL


# --- beyond vLLM's tests ----------------------------------------------------------------


def test_agent_restarted_under_a_live_engine(
    agent_config: AgentConfig, agent_factory: StartAgent, engines: MakeEngine
) -> None:
    """A rolling update of the agent while the engine runs: during the outage lookups miss
    and stores fail as jobs, nothing raises; the restarted agent reloads its pool (warm),
    and the same tier, unrestarted, finds the chunks again, byte-identical, and stores
    new ones that other engines see."""
    agent = agent_factory(agent_config)
    engine = engines(agent_config, timeout_seconds=0.5)
    engine.store([1, 2, 3])
    engine.reset_primary()
    agent.stop()
    answers, _ = engine.lookup([1, 2, 3], timeout=10)
    assert answers == [MISS] * 3
    engine.store([9])  # the cascade to kvtier fails cleanly
    agent_factory(agent_config)
    engine.reset_primary()
    answers, _ = engine.lookup([1, 2, 3])
    assert answers == [HIT] * 3
    for i, row in zip([1, 2, 3], engine.read([1, 2, 3]), strict=True):
        assert np.array_equal(row, chunk_row(i))
    engine.store([4])
    assert engines(agent_config).lookup([4, 9])[0] == [HIT, MISS]


def test_two_engines_store_the_same_keys_at_once(
    agent_config: AgentConfig, agent_factory: StartAgent, engines: MakeEngine
) -> None:
    """vLLM: test_store_accepts_block_published_by_another_writer, for a node's engines.
    Both engines' jobs succeed, the agent holds one copy of each chunk, and a third engine
    reads it whole."""
    agent_factory(agent_config)
    first, second = engines(agent_config), engines(agent_config)
    keys = [chunk_key(i) for i in range(8)]
    for engine in (first, second):
        for i in range(8):
            engine.rows[i] = chunk_row(i)
    jobs = [job(keys, list(range(8)), ReqContext(req_id=f"both-{n}")) for n in range(2)]
    first.tier.submit_store(jobs[0])
    second.tier.submit_store(jobs[1])
    for engine in (first, second):
        engine.tier.drain_jobs()
        assert [r.success for r in engine.tier.get_finished_jobs()] == [True]
    with AgentClient(agent_config.endpoint) as client:
        assert client.stats().host.namespaces == {first.tier.namespace: 8}
    third = engines(agent_config)
    assert third.lookup(list(range(8)))[0] == [HIT] * 8
    for i, row in enumerate(third.read(list(range(8)))):
        assert np.array_equal(row, chunk_row(i))


def test_one_hash_in_two_kv_groups(driver: Driver) -> None:
    """A hybrid model's groups hash the same tokens alike: one block hash, two keys, two
    rows that must never be confused."""
    block_hash = b"\x07" * 32
    in_0, in_1 = make_offload_key(block_hash, 0), make_offload_key(block_hash, 1)
    driver.rows[0], driver.rows[1] = chunk_row(10), chunk_row(11)
    assert driver.store([in_0], [0]).success
    assert driver.lookup([in_0, in_1]) == [HIT, MISS]
    assert driver.store([in_1], [1]).success
    driver.rows[:] = 0
    assert driver.load([in_1, in_0], [2, 3], driver.ctx).success
    assert np.array_equal(driver.rows[2], chunk_row(11))
    assert np.array_equal(driver.rows[3], chunk_row(10))


def test_stats_as_vllms_metrics_read_them(
    agent_config: AgentConfig, agent_factory: StartAgent, engines: MakeEngine
) -> None:
    """vLLM: test_tiering_spec_collects_secondary_metric_definitions,
    test_tiering_manager_aggregates_secondary_stats. The manager's get_stats carries the
    tier's series; the spec declares each of them, so vLLM's Prometheus exporter takes
    them (labels as declared), the log line reduces them, and a second read is empty."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
        OffloadPromMetrics,
    )

    agent_factory(agent_config)
    engine = engines(agent_config)
    engine.store([1, 2])
    engine.reset_primary()
    assert engine.lookup([1, 2, 3])[0] == [HIT, HIT, MISS]
    stats = engine.manager.get_stats()
    assert stats is not None
    ours = {name: v for name, v in stats.data["data"].items() if name.startswith("vllm:kvtier_")}
    assert ours["vllm:kvtier_store_bytes"] == {(): 2 * ROW}
    assert ours["vllm:kvtier_load_bytes"] == {(): 2 * ROW}
    assert ours["vllm:kvtier_agent_available"] == {(): 1.0}
    declared = TieringOffloadingSpec.build_metric_definitions(engine.extra_config)
    for name, values in ours.items():
        assert all(len(labels) == len(declared[name].labelnames) for labels in values)

    registry = CollectorRegistry()
    prom = OffloadPromMetrics(
        SimpleNamespace(
            kv_transfer_config=SimpleNamespace(kv_connector_extra_config=engine.extra_config)
        ),
        {kind: partial(kind, registry=registry) for kind in (Counter, Gauge, Histogram)},
        ["model_name", "engine"],
        {0: ["tiny-llama", "0"]},
    )
    prom.observe(stats.data, 0)
    labels = {"model_name": "tiny-llama", "engine": "0"}
    assert registry.get_sample_value("vllm:kvtier_store_bytes_total", labels) == 2 * ROW
    assert registry.get_sample_value("vllm:kvtier_agent_available", labels) == 1.0
    assert registry.get_sample_value("vllm:kvtier_load_seconds_count", labels) == 1
    assert stats.reduce()["vllm:kvtier_load_bytes"] == 2 * ROW

    again = engine.manager.get_stats()
    assert again is None or not any(n.startswith("vllm:kvtier_") for n in again.data["data"])
