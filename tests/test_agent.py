"""A real agent process and real client processes over the ipc socket and shared pool."""

from __future__ import annotations

import json
import multiprocessing as mp
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import numpy as np
import pytest

from kvtier.api.config import AgentConfig
from kvtier.api.stats import StoreSkips
from kvtier.client.connection import AgentClient, AgentRefused, AgentUnavailable
from kvtier.local.agent import AgentProcess
from kvtier.shm.pool import PoolMap
from kvtier.shm.table import digests
from tests.agent_helpers import find_slot, scrape
from tests.conftest import ROW
from tests.helpers import NS, hold_leases, key, loaned_chunk, row, store_and_verify, wait_settled

StartAgent = Callable[[AgentConfig], AgentProcess]


def test_a_load_given_its_keys_digests_loads_the_same_and_refuses_a_wrong_count(
    agent: AgentProcess,
) -> None:
    """What the plug-in passes from its lookups (`key_digests`) gives what computing them
    gives; a list of another length is refused before anything is copied."""
    with AgentClient(agent.config.endpoint) as client:
        keys = [key(i) for i in range(4)]
        client.store(NS, keys[:3], [row(i, ROW) for i in range(3)])
        outs = [np.zeros(ROW, np.uint8) for _ in keys]
        given = digests(NS, keys).tolist()
        assert client.load_into(NS, keys, outs, key_digests=given) == [True] * 3 + [False]
        assert all(np.array_equal(outs[i], row(i, ROW)) for i in range(3))
        fresh = [np.zeros(ROW, np.uint8) for _ in keys]
        with pytest.raises(ValueError, match="one index digest per key"):
            client.load_into(NS, keys, fresh, key_digests=given[:3])
        assert not any(o.any() for o in fresh)


def test_store_lookup_load_roundtrip(agent: AgentProcess) -> None:
    with AgentClient(agent.config.endpoint) as client:
        keys = [key(i) for i in range(10)]
        assert client.store(NS, keys[:6], [row(i, ROW) for i in range(6)]).stored == 6
        result = client.store(NS, keys[4:8], [row(i, ROW) for i in range(4, 8)])
        assert (result.stored, result.skipped) == (2, 2)
        lookup = client.lookup(NS, keys)
        assert lookup.hits == [True] * 8 + [False] * 2 and lookup.prefix == 8
        assert client.lookup("another-fingerprint", keys).prefix == 0
        outs = [np.zeros(ROW, np.uint8) for _ in keys]
        assert client.load_into(NS, keys, outs) == [True] * 8 + [False] * 2
        for i in range(8):
            assert np.array_equal(outs[i], row(i, ROW))
        assert not outs[8].any()
        stats = wait_settled(client)
        assert stats.host.chunks == 8 and stats.host.namespaces == {NS: 8}
        assert stats.host.store_skipped == StoreSkips(exists=2)
        assert stats.metrics_port is not None
        metrics = scrape(stats.metrics_port)
    assert metrics['kvtier_store_skipped_total{reason="exists"}'] == 2
    assert metrics['kvtier_store_skipped_total{reason="full"}'] == 0


def test_four_client_processes_store_and_load_concurrently(agent: AgentProcess) -> None:
    """Overlapping key sets race on the same keys; every process then reads every chunk."""
    ctx = mp.get_context("spawn")
    workers = 4
    barrier, results = ctx.Barrier(workers), ctx.Queue()
    key_sets = [list(range(w * 12, w * 12 + 24)) for w in range(workers)]
    all_keys = sorted({k for ks in key_sets for k in ks})
    procs = [
        ctx.Process(
            target=store_and_verify,
            args=(agent.config.endpoint, w, key_sets[w], all_keys, ROW, barrier, results),
        )
        for w in range(workers)
    ]
    for p in procs:
        p.start()
    outcome = [results.get(timeout=90) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    assert sum(stored for _, stored, _, _ in outcome) == len(all_keys)  # each key written once
    for _worker, _stored, loaded, exact in outcome:
        assert loaded == exact == len(all_keys)


def test_agent_killed_and_restarted_serves_same_chunks(
    make_config: Callable[..., AgentConfig], agent_factory: StartAgent
) -> None:
    config = make_config()
    first = agent_factory(config)
    with AgentClient(config.endpoint) as client:
        client.store(NS, [key(i) for i in range(20)], [row(i, ROW) for i in range(20)])
        wait_settled(client)
    first.kill()

    agent_factory(config)
    with AgentClient(config.endpoint) as client:
        keys = [key(i) for i in range(20)]
        assert client.lookup(NS, keys).prefix == 20
        outs = [np.zeros(ROW, np.uint8) for _ in keys]
        assert all(client.load_into(NS, keys, outs))
        assert all(np.array_equal(outs[i], row(i, ROW)) for i in range(20))
        assert client.stats().host.corrupt == 0


def test_corrupted_slot_is_never_served(
    make_config: Callable[..., AgentConfig], agent_factory: StartAgent
) -> None:
    config = make_config()
    first = agent_factory(config)
    with AgentClient(config.endpoint) as client:
        client.store(NS, [key(i) for i in range(5)], [row(i, ROW) for i in range(5)])
        wait_settled(client)
    first.kill()

    pool = PoolMap.open(config.pool_path, populate=False)
    pool.payload(find_slot(config.pool_path, key(2)))[ROW // 2] ^= 0xFF  # one flipped byte
    pool.header(find_slot(config.pool_path, key(4)))[:4] = 0  # a torn header
    pool.close()

    agent = agent_factory(config)
    with AgentClient(config.endpoint) as client:
        keys = [key(i) for i in range(5)]
        assert client.lookup(NS, keys).hits == [True, True, False, True, False]
        outs = [np.zeros(ROW, np.uint8) for _ in keys]
        assert client.load_into(NS, keys, outs) == [True, True, False, True, False]
        assert not outs[2].any()
        stats = client.stats()
        assert stats.host.corrupt == 1 and stats.host.chunks == 3
        metrics = scrape(stats.metrics_port)
    assert metrics['kvtier_corrupt_chunks_total{tier="host"}'] == 1
    assert agent.proc is not None


def test_killed_client_does_not_leak_leases(agent: AgentProcess) -> None:
    endpoint = agent.config.endpoint
    with AgentClient(endpoint) as client:
        client.store(NS, [key(0), key(1)], [row(0, ROW), row(1, ROW)])
        wait_settled(client)
        ctx = mp.get_context("spawn")
        ready = ctx.Event()
        holder = ctx.Process(target=hold_leases, args=(endpoint, ROW, ready))
        holder.start()
        assert ready.wait(60)
        stats = client.stats()
        assert stats.host.leases == 2 and stats.host.pinned_slots == 4
        holder.kill()
        holder.join()
        # Lease timeout is 30 s: only the lock-file liveness check can free these in time.
        deadline = time.monotonic() + 5
        while client.stats().host.leases and time.monotonic() < deadline:
            time.sleep(0.05)
        stats = client.stats()
        assert stats.host.leases == 0 and stats.host.pinned_slots == 0
        assert stats.host.leases_reclaimed == 2
        assert client.lookup(NS, [key(1000)]).prefix == 0  # the half-written store is gone
        # Every slot can be used again: fill the whole pool without a FULL answer.
        n = stats.host.slots
        result = client.store(
            NS, [key(i) for i in range(2000, 2000 + n)], [row(i, ROW) for i in range(n)]
        )
        assert result.stored == n


def test_expired_lease_is_released(short_lease_client: AgentClient) -> None:
    client = short_lease_client
    grant = loaned_chunk(client, ROW)
    assert grant.lease and client.stats().host.leases == 1
    time.sleep(0.6)
    stats = client.stats()
    assert stats.host.leases == 0 and stats.host.leases_expired == 1
    client.end_load(grant.lease)  # ending a lease the agent already released is harmless


def test_metrics_endpoint(agent: AgentProcess) -> None:
    with AgentClient(agent.config.endpoint) as client:
        client.store(NS, [key(i) for i in range(3)], [row(i, ROW) for i in range(3)])
        client.lookup(NS, [key(0), key(1), key(99)])
        client.load_into(NS, [key(0)], [np.zeros(ROW, np.uint8)])
        port = client.stats().metrics_port
    m = scrape(port)
    assert m['kvtier_hits_total{tier="host"}'] == 2
    assert m["kvtier_misses_total"] == 1
    assert m["kvtier_lookups_total"] == 3
    assert m['kvtier_store_bytes_total{tier="host"}'] == 3 * ROW
    assert m['kvtier_load_bytes_total{tier="host"}'] == ROW
    assert m['kvtier_tier_capacity_bytes{tier="host"}'] == 64 * ROW
    assert m['kvtier_tier_chunks{tier="host"}'] == 3
    # answered by the client from the published index, reported in one one-way message
    assert m['kvtier_request_seconds_count{op="looked"}'] == 1


def test_row_larger_than_slot_is_refused(agent: AgentProcess) -> None:
    with (
        AgentClient(agent.config.endpoint) as client,
        pytest.raises(AgentRefused, match="chunkBytes"),
    ):
        client.store(NS, [key(0)], [np.zeros(ROW * 2, np.uint8)])


def test_unreachable_agent_is_a_timely_error(scratch: Path) -> None:
    client = AgentClient(f"ipc://{scratch}/nobody.sock", timeout=0.3)
    started = time.monotonic()
    with pytest.raises(AgentUnavailable):
        client.connect()
    assert time.monotonic() - started < 3
    client.close()


def test_client_reconnects_after_agent_restart(
    make_config: Callable[..., AgentConfig], agent_factory: StartAgent
) -> None:
    config = make_config()
    first = agent_factory(config)
    client = AgentClient(config.endpoint, timeout=0.5).connect()
    client.store(NS, [key(0)], [row(0, ROW)])
    wait_settled(client)
    first.kill()
    with pytest.raises(AgentUnavailable):
        client.lookup(NS, [key(0)])
    agent_factory(config)
    client.connect()
    assert client.lookup(NS, [key(0)]).prefix == 1
    client.close()


def test_stats_are_json_serialisable(agent: AgentProcess) -> None:
    with AgentClient(agent.config.endpoint) as client:
        document = json.loads(msgspec.json.encode(client.stats()))
    assert document["host"]["slots"] == 64 and document["tiers"] == []
