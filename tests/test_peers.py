"""Agents on different "nodes" sharing chunks through the peer tier: separate processes on
loopback, finding each other through a shared registry directory, authenticated with CURVE."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier.agent.tiers.peer.directory import by_home, homes
from kvtier.agent.tiers.peer.wire import write_keys
from kvtier.api.config import AgentConfig
from kvtier.client.connection import AgentClient
from kvtier.local.agent import AgentProcess
from kvtier.shm.pool import PoolMap
from tests import netns
from tests.agent_helpers import find_slot, load_exact, scrape, wait_for
from tests.conftest import ROW
from tests.helpers import NS, key, row, wait_settled
from tests.peer_helpers import free_port, node_config, peer_stats, shared_between

StartAgent = Callable[[AgentConfig], AgentProcess]


def moved_chunks(client: AgentClient) -> int:
    """Chunks that arrived from peers, over either data path."""
    counts = peer_stats(client).peer
    assert counts is not None
    return counts.nixl_reads + counts.stream_reads + counts.zmq_reads


READS = {"nixl": "nixl_reads", "tcp": "stream_reads", "zmq": "zmq_reads"}  # by dataPath


def test_chunks_stored_on_one_node_are_loaded_on_another(
    make_config: Callable[..., AgentConfig], agent_factory: StartAgent, scratch: Path
) -> None:
    keys = scratch / "curve"
    write_keys(keys)
    a = agent_factory(node_config(make_config, scratch, "node-a", keys))
    b_config = node_config(make_config, scratch, "node-b", keys)
    agent_factory(b_config)
    wait_for(lambda: len(list((scratch / "registry").glob("*.json"))) == 2)
    time.sleep(1.2)  # members are re-read every second

    with AgentClient(a.config.endpoint) as producer:
        producer.store(NS, [key(i) for i in range(8)], [row(i, ROW) for i in range(8)])
        wait_for(lambda: producer.stats().tiers[0].counts.writebacks == 8)

    with AgentClient(b_config.endpoint) as consumer:
        found = wait_for(
            lambda: (r := consumer.lookup(NS, [key(i) for i in range(9)])).prefix == 8 and r
        )
        assert found.where == [1] * 8 + [-1]
        assert load_exact(consumer, list(range(8))) == [True] * 8
        assert consumer.lookup(NS, [key(0)]).where == [0]  # now in node-b's own pool

    # Peers without the tier's key: test_peer_security.py, request by request.
    with AgentClient(a.config.endpoint) as producer:
        producer.store(NS, [key(i) for i in range(20, 24)], [row(i, ROW) for i in range(20, 24)])
        wait_for(lambda: producer.stats().tiers[0].counts.writebacks == 12)
    a.kill()  # the only holder dies: its chunks become misses, in time, nothing hangs
    with AgentClient(b_config.endpoint) as consumer:
        started = time.monotonic()
        assert load_exact(consumer, [20, 21, 22, 23]) == [False] * 4
        assert load_exact(consumer, [3]) == [True]  # promoted earlier: in node-b's own pool
        assert time.monotonic() - started < 10


@pytest.mark.parametrize(
    ("budget", "timeout", "rest_answered"),
    [(1.5, 0.5, True), (0.3, 1.0, False)],
    ids=["home-asked-on-the-request-thread", "home-asked-on-the-io-pool"],
)
def test_a_lookup_whose_keys_home_on_a_frozen_agent_answers_within_its_budget(
    make_config: Callable[..., AgentConfig],
    agent_factory: StartAgent,
    scratch: Path,
    budget: float,
    timeout: float,
    rest_answered: bool,
) -> None:
    """A lookup asks the keys' homes on its own thread where the peer timeout ends within
    the lookup's budget, else on the I/O pool, waiting no longer than the budget. Either
    way, with the other agent frozen (a partition, its process stopped), a lookup returns
    within its budget, every key homed on the frozen agent a miss; asked on its own thread,
    the keys homed here are still answered (their holder known). After the thaw every key
    is found again."""
    a = agent_factory(node_config(make_config, scratch, "node-a", None, timeoutSeconds=timeout))
    b_config = node_config(make_config, scratch, "node-b", None, timeoutSeconds=timeout)
    b_config = b_config.model_copy(update={"tier_budget_seconds": budget})
    agent_factory(b_config)
    wait_for(lambda: len(list((scratch / "registry").glob("*.json"))) == 2)
    ids = list(range(24))
    keys = [key(i) for i in ids]
    with AgentClient(b_config.endpoint) as consumer:
        shared_between(a.config.endpoint, consumer, ids)
        (frozen,) = consumer.stats().peers
        records = (scratch / "registry").glob("*.json")
        members = sorted(json.loads(r.read_text())["endpoint"] for r in records)
        home_of = [members[h] for h in homes(keys, members).tolist()]
        there = [home == frozen for home in home_of]
        assert 0 < sum(there) < len(ids)
        os.kill(a.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            found = consumer.lookup(NS, keys)
            elapsed = time.monotonic() - started
        finally:
            os.kill(a.pid, signal.SIGCONT)
        assert elapsed < budget + 0.5
        assert all(w == -1 for w, far in zip(found.where, there, strict=True) if far)
        if rest_answered:
            assert [w == -1 for w in found.where] == there
        wait_for(lambda: consumer.lookup(NS, keys).prefix == len(ids))


def test_an_agent_that_advertises_another_name_still_listens_on_its_bind(
    make_config: Callable[..., AgentConfig], agent_factory: StartAgent, scratch: Path
) -> None:
    """`advertise` is what peers are told to dial (a name that reaches the bound address),
    not a replacement for binding: the other agent dials the advertised name and loads."""
    port = free_port()
    advertised = f"tcp://localhost:{port}"
    producer = node_config(
        make_config, scratch, "node-a", None, bind=f"tcp://127.0.0.1:{port}", advertise=advertised
    )
    agent_factory(producer)
    consumer_config = node_config(make_config, scratch, "node-b", None)
    agent_factory(consumer_config)
    record = scratch / "registry" / "node-a.json"
    wait_for(record.is_file)
    assert json.loads(record.read_text())["endpoint"] == advertised
    ids = list(range(4))
    with AgentClient(consumer_config.endpoint) as consumer:
        shared_between(producer.endpoint, consumer, ids)
        assert load_exact(consumer, ids) == [True] * len(ids)
        assert moved_chunks(consumer) == len(ids)


def test_rendezvous_homes_move_only_for_changed_members() -> None:
    members = [f"tcp://10.0.0.{i}:5557" for i in range(10)]
    keys = [b"k%d" % i for i in range(2000)]
    before = dict(zip(keys, (members[i] for i in homes(keys, members)), strict=True))
    after = dict(zip(keys, (members[i] for i in homes(keys, members[:-1])), strict=True))
    moved = [k for k in keys if before[k] != after[k]]
    assert all(before[k] == members[-1] for k in moved)
    assert 100 < len(moved) < 320  # about a tenth of the keys


@pytest.mark.parametrize("count", [2, 3, 10])
def test_keys_grouped_by_home_in_order(count: int) -> None:
    """What a lookup sends each home: every position once, in order, under its key's home;
    a member homing none of the keys is not asked."""
    members = [f"tcp://10.0.0.{i}:5557" for i in range(count)]
    keys = [b"k%d" % i for i in range(1000)]
    home = homes(keys, members)
    grouped = by_home(keys, members)
    assert {m: [i for i in range(len(keys)) if members[home[i]] == m] for m in grouped} == grouped
    assert sorted(i for positions in grouped.values() for i in positions) == list(range(1000))
    assert list(by_home(keys[:1], members)) == [members[home[0]]]


@pytest.mark.parametrize("data_path", ["nixl", "tcp", "zmq"])
def test_direct_mode_fetches_from_the_named_source(
    make_config: Callable[..., AgentConfig],
    agent_factory: StartAgent,
    scratch: Path,
    data_path: str,
) -> None:
    """P/D: the decode side's request names the prefill side's agent (a live member of the
    tier), which is asked directly, before its announcements reach the keys' homes. Every data
    path moves the bytes."""
    prefill = agent_factory(node_config(make_config, scratch, "prefill", None, **paced(data_path)))
    decode_config = node_config(make_config, scratch, "decode", None, **paced(data_path))
    agent_factory(decode_config)
    record = json.loads((scratch / "registry" / "prefill.json").read_text())
    source = record["endpoint"]
    # Only the control endpoint is published; NIXL metadata goes over the control channel.
    assert "nixlMetadata" not in record
    with AgentClient(prefill.config.endpoint) as producer:
        producer.store(NS, [key(i) for i in range(4)], [row(i, ROW) for i in range(4)])
        wait_for(lambda: producer.stats().tiers[0].counts.writebacks == 4)
    with AgentClient(decode_config.endpoint) as consumer:
        keys = [key(i) for i in range(5)]
        assert consumer.lookup(NS, keys, source=source).where == [1, 1, 1, 1, -1]
        assert load_exact(consumer, [0]) == [True]  # and the connection to the source is up
        outs = [np.zeros(ROW, np.uint8) for _ in range(3)]
        assert consumer.load_into(NS, keys[1:4], outs, source=source) == [True] * 3
        assert all(np.array_equal(o, row(i + 1, ROW)) for i, o in enumerate(outs))
        moved = getattr(peer_stats(consumer).peer, READS[data_path])
        assert moved >= 3  # the first chunk may have come another way while NIXL connected
        metrics = scrape(consumer.stats().metrics_port)
        assert metrics[f'kvtier_peer_chunks_total{{path="{data_path}"}}'] == moved
    with AgentClient(prefill.config.endpoint) as producer:
        wait_for(lambda: peer_stats(producer).peer.lent == 0)  # every loan given back


def paced(data_path: str) -> dict[str, Any]:
    """Peer settings for tests that count which data path moved the chunks: a timeout long
    enough that a loaded CI machine does not turn a slow NIXL transfer into a ZMQ one."""
    return {"dataPath": data_path, "timeoutSeconds": 1.2}


def test_a_restarted_holder_is_read_through_its_new_nixl_agent(
    make_config: Callable[..., AgentConfig], agent_factory: StartAgent, scratch: Path
) -> None:
    """The holder restarts at the same address with a new NIXL agent (its pool survives):
    the first transfer after it notices the change and falls back to the sealed stream (its
    kept connection to the old process broken), the next ones use NIXL again; every chunk
    arrives intact."""
    holder_config = node_config(
        make_config, scratch, "node-a", None, dataPath="nixl", bind=f"tcp://127.0.0.1:{free_port()}"
    )
    holder = agent_factory(holder_config)
    consumer_config = node_config(make_config, scratch, "node-b", None, dataPath="nixl")
    agent_factory(consumer_config)
    wait_for(lambda: len(list((scratch / "registry").glob("*.json"))) == 2)
    time.sleep(1.2)
    with AgentClient(holder_config.endpoint) as producer:
        producer.store(NS, [key(i) for i in range(6)], [row(i, ROW) for i in range(6)])
        wait_for(lambda: producer.stats().tiers[0].counts.writebacks == 6)
    with AgentClient(consumer_config.endpoint) as consumer:
        wait_for(lambda: consumer.lookup(NS, [key(i) for i in range(6)]).prefix == 6)
        assert load_exact(consumer, [0, 1]) == [True, True]
        holder.stop()
        holder.start()
        assert load_exact(consumer, [2, 3]) == [True, True]
        assert load_exact(consumer, [4, 5]) == [True, True]
        counts = peer_stats(consumer).peer
    assert counts is not None
    assert counts.nixl_failures >= 1
    assert counts.stream_reads >= 1  # the transfer that found the old agent gone
    assert counts.stream_failures == 0
    assert counts.stream_reads + counts.nixl_reads == 6
    assert counts.nixl_reads >= 4


def test_an_overloaded_holder_sheds_load_instead_of_queueing(
    make_config: Callable[..., AgentConfig], agent_factory: StartAgent, scratch: Path
) -> None:
    """One node holds what two others want at once, and lends at most 4 slots at a time:
    requests past that are refused at once (misses for the askers, who recompute), nothing
    wrong arrives, nothing waits for the holder, and once the rush is over every chunk can
    be fetched."""
    holder_config = node_config(make_config, scratch, "hot", None, maxLentChunks=4)
    agent_factory(holder_config)
    askers = [node_config(make_config, scratch, f"asker-{i}", None) for i in range(2)]
    for config in askers:
        agent_factory(config)
    wait_for(lambda: len(list((scratch / "registry").glob("*.json"))) == 3)
    time.sleep(1.2)
    ids = list(range(24))
    with AgentClient(holder_config.endpoint) as producer:
        producer.store(NS, [key(i) for i in ids], [row(i, ROW) for i in ids])
        wait_for(lambda: peer_stats(producer).counts.writebacks == len(ids))

    def rush(config: AgentConfig, worker: int) -> tuple[list[bool], list[bool], float]:
        mine = ids[worker % 2 :: 2] + ids[(worker + 1) % 2 :: 2]
        with AgentClient(config.endpoint) as client:
            wait_for(lambda: client.lookup(NS, [key(i) for i in mine]).prefix == len(mine))
            outs = [np.zeros(ROW, np.uint8) for _ in mine]
            started = time.monotonic()
            loaded = client.load_into(NS, [key(i) for i in mine], outs)
            elapsed = time.monotonic() - started
        exact = [np.array_equal(o, row(i, ROW)) for i, o in zip(mine, outs, strict=True)]
        return loaded, exact, elapsed

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(rush, askers * 2, range(4)))
    for loaded, exact, elapsed in results:
        assert all(e for ok, e in zip(loaded, exact, strict=True) if ok)  # nothing wrong
        assert elapsed < 5  # refused at once, not queued until the budget ran out
    with AgentClient(holder_config.endpoint) as producer:
        assert peer_stats(producer).peer.refused > 0
        wait_for(lambda: peer_stats(producer).peer.lent == 0)
    for config in askers:  # the rush is over: what was refused is served now
        with AgentClient(config.endpoint) as client:
            assert wait_for(lambda client=client: all(load_exact(client, ids)))
            wait_settled(client)


def test_a_holder_killed_while_transfers_run_leaves_misses_and_no_leases(
    make_config: Callable[..., AgentConfig], agent_factory: StartAgent, scratch: Path
) -> None:
    """The asker keeps fetching (its small pool evicts, so every round goes to the peer)
    while the holder is frozen (a partition), thawed, then SIGKILLed: every load returns
    within the asker's budget, every chunk it reports loaded is intact, and no lease is
    left behind."""
    holder = agent_factory(node_config(make_config, scratch, "holder", None))
    small = {"capacity": 12 * (ROW + 4096) + 4096}
    asker_config = node_config(make_config, scratch, "asker", None, host=small)
    agent_factory(asker_config)
    wait_for(lambda: len(list((scratch / "registry").glob("*.json"))) == 2)
    time.sleep(1.2)
    ids = list(range(30))  # the write-backs pin at most half the pool at once
    with AgentClient(holder.config.endpoint) as producer:
        producer.store(NS, [key(i) for i in ids], [row(i, ROW) for i in ids])
        wait_for(lambda: peer_stats(producer).counts.writebacks == len(ids))
    stop = threading.Event()
    rounds: list[tuple[int, int, float]] = []  # (loaded, wrong, seconds)

    def keep_fetching() -> None:
        with AgentClient(asker_config.endpoint) as client:
            while not stop.is_set():
                for start in range(0, len(ids), 6):
                    batch = ids[start : start + 6]
                    outs = [np.zeros(ROW, np.uint8) for _ in batch]
                    began = time.monotonic()
                    loaded = client.load_into(NS, [key(i) for i in batch], outs)
                    wrong = sum(
                        ok and not np.array_equal(o, row(i, ROW))
                        for i, ok, o in zip(batch, loaded, outs, strict=True)
                    )
                    rounds.append((sum(loaded), wrong, time.monotonic() - began))

    fetcher = threading.Thread(target=keep_fetching)
    fetcher.start()
    try:
        wait_for(lambda: sum(r[0] for r in rounds) >= 60)
        os.kill(holder.pid, signal.SIGSTOP)  # partitioned: answers nothing
        time.sleep(2)
        os.kill(holder.pid, signal.SIGCONT)
        time.sleep(0.5)
        holder.kill()  # dies with transfers in flight
        after = len(rounds)
        wait_for(lambda: len(rounds) > after + 6)
    finally:
        stop.set()
        fetcher.join(timeout=30)
    assert not fetcher.is_alive()
    assert sum(r[1] for r in rounds) == 0  # nothing wrong was ever served
    assert max(r[2] for r in rounds) < 5  # budget 1.5 s: no load waited on the dead peer
    assert sum(r[0] for r in rounds[after + 3 :]) < 6 * len(rounds[after + 3 :])
    with AgentClient(asker_config.endpoint) as client:
        wait_settled(client)


@pytest.mark.skipif(netns.supported() is not None, reason=str(netns.supported()))
def test_nodes_with_their_own_addresses_share_through_the_directory(
    make_config: Callable[..., AgentConfig], scratch: Path
) -> None:
    """Three agents, each in its own network namespace with its own address on a bridge
    (three "machines"), authenticated with the cluster key: chunks stored on one node are
    found through their home and loaded on another across real interfaces. UCX runs with
    its defaults here (the chunks come over NIXL where it connects, else over ZMQ, every one
    through a peer); test_peer_netns.py pins UCX to TCP and requires NIXL."""
    keys = scratch / "curve"
    write_keys(keys)
    with netns.nodes(3) as machines, contextlib.ExitStack() as stack:
        configs = []
        for i, (namespace, address) in enumerate(machines):
            config = node_config(
                make_config, scratch, f"node-{i}", keys, bind=f"tcp://{address}:5557"
            )
            stack.enter_context(AgentProcess(config, prefix=["ip", "netns", "exec", namespace]))
            configs.append(config)
        records = wait_for(
            lambda: len(found := list((scratch / "registry").glob("*.json"))) == 3 and found
        )
        endpoints = sorted(json.loads(r.read_text())["endpoint"] for r in records)
        assert endpoints == [f"tcp://{address}:5557" for _, address in machines]
        ids = list(range(12))
        with AgentClient(configs[2].endpoint) as consumer:
            shared_between(configs[0].endpoint, consumer, ids)
            assert load_exact(consumer, ids) == [True] * len(ids)
            stats = peer_stats(consumer)
            assert moved_chunks(consumer) == len(ids)
            assert stats.counts.read_errors == 0
            assert sorted(consumer.stats().peers) == endpoints[:2]


def test_chunks_a_holder_evicts_stop_being_found_and_stale_entries_are_misses(
    make_config: Callable[..., AgentConfig], agent_factory: StartAgent, scratch: Path
) -> None:
    """The holder's small pool evicts what it announced: it withdraws the keys at their
    homes, so lookups elsewhere stop reporting them. A read racing the eviction (the entry
    still cached by the asker) is a plain miss, never a wrong chunk or an error."""
    small = {"capacity": 12 * (ROW + 4096) + 4096}
    holder = agent_factory(node_config(make_config, scratch, "holder", None, host=small))
    asker_config = node_config(make_config, scratch, "asker", None)
    agent_factory(asker_config)
    wait_for(lambda: len(list((scratch / "registry").glob("*.json"))) == 2)
    time.sleep(1.2)
    first = [key(i) for i in range(6)]
    with AgentClient(holder.config.endpoint) as producer:
        producer.store(NS, first, [row(i, ROW) for i in range(6)])
        wait_for(lambda: peer_stats(producer).counts.writebacks == 6)
        with AgentClient(asker_config.endpoint) as asker:
            assert wait_for(lambda: asker.lookup(NS, first).where == [1] * 6)
            later = list(range(100, 112))  # fills the holder's 12 slots: the first six go
            producer.store(NS, [key(i) for i in later], [row(i, ROW) for i in later])
            assert producer.lookup(NS, first).where == [-1] * 6
            assert wait_for(lambda: asker.lookup(NS, first).where == [-1] * 6)
            stats = peer_stats(asker)
    assert stats.counts.read_errors == 0 and stats.counts.corrupt == 0


def test_a_read_of_an_entry_gone_stale_is_a_miss(
    make_config: Callable[..., AgentConfig], agent_factory: StartAgent, scratch: Path
) -> None:
    """Direct mode names a holder that has evicted the chunk since it said it held it: the
    loan finds it absent and the load is a miss."""
    small = {"capacity": 12 * (ROW + 4096) + 4096}
    holder = agent_factory(node_config(make_config, scratch, "holder", None, host=small))
    asker_config = node_config(make_config, scratch, "asker", None)
    agent_factory(asker_config)
    source = json.loads((scratch / "registry" / "holder.json").read_text())["endpoint"]
    with (
        AgentClient(holder.config.endpoint) as producer,
        AgentClient(asker_config.endpoint) as asker,
    ):
        producer.store(NS, [key(i) for i in range(4)], [row(i, ROW) for i in range(4)])
        assert asker.lookup(NS, [key(i) for i in range(4)], source=source).where == [1] * 4
        later = list(range(100, 112))
        producer.store(NS, [key(i) for i in later], [row(i, ROW) for i in later])
        started = time.monotonic()
        outs = [np.zeros(ROW, np.uint8) for _ in range(4)]
        assert asker.load_into(NS, [key(i) for i in range(4)], outs) == [False] * 4
        assert time.monotonic() - started < 2
        assert peer_stats(asker).counts.read_errors == 0


@pytest.mark.parametrize("data_path", ["nixl", "tcp", "zmq"])
def test_a_chunk_damaged_in_the_holders_pool_is_never_served_by_a_peer(
    make_config: Callable[..., AgentConfig],
    agent_factory: StartAgent,
    scratch: Path,
    data_path: str,
) -> None:
    """One byte of a sealed chunk flips in the holder's memory. The asker checks every
    chunk that arrives against its checksum: it serves a miss for that one, the intact
    neighbour arrives, and it tells the holder, which checks its copy and drops it from its
    pool and the directory. A reader on the holder's node still holds the chunk (a load
    lease, as a write-back or another peer's transfer would): the chunk leaves every lookup
    at once all the same, and its slot goes back to use only when that lease ends."""
    holder = agent_factory(node_config(make_config, scratch, "holder", None, **paced(data_path)))
    asker_config = node_config(make_config, scratch, "asker", None, **paced(data_path))
    agent_factory(asker_config)
    source = json.loads((scratch / "registry" / "holder.json").read_text())["endpoint"]
    keys = [key(i) for i in range(3)]
    with AgentClient(holder.config.endpoint) as reader:
        reader.store(NS, keys, [row(i, ROW) for i in range(3)])
        wait_settled(reader)
        reading = reader.begin_load(NS, keys[1:2])
        assert reading.slots[0] >= 0
        with AgentClient(asker_config.endpoint) as asker:
            assert asker.lookup(NS, keys, source=source).where == [1, 1, 1]
            assert load_exact(asker, [0]) == [True]  # the connection to the holder is up
            pool = PoolMap.open(holder.config.pool_path, populate=False)
            pool.payload(find_slot(holder.config.pool_path, key(1)))[ROW // 3] ^= 0xFF
            before = moved_chunks(asker)
            outs = [np.zeros(ROW, np.uint8) for _ in range(2)]
            assert asker.load_into(NS, keys[1:], outs) == [False, True]
            assert np.array_equal(outs[1], row(2, ROW))
            assert moved_chunks(asker) == before + 1  # over NIXL, or TCP while NIXL connects
            # Nothing damaged entered the asker's pool; no client of either node is served
            # the bad bytes, though the holder's reader still has its lease.
            assert asker.lookup(NS, keys).where[1] != 0
            assert wait_for(lambda: asker.lookup(NS, keys).where == [0, -1, 0])
        assert wait_for(lambda: reader.lookup(NS, keys).where == [0, -1, 0])
        free = reader.stats().host.free_slots
        reader.end_load(reading.lease)
        assert reader.stats().host.free_slots == free + 1
    with AgentClient(holder.config.endpoint) as producer:
        assert producer.lookup(NS, keys).where == [0, -1, 0]
        assert (
            scrape(producer.stats().metrics_port)['kvtier_corrupt_chunks_total{tier="host"}'] == 1
        )
