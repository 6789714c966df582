"""The index the agent publishes for clients, with real agents and processes: lookups
answered by clients race stores that evict, in several processes, and never lead to a
wrong slot; an agent SIGKILLed while stores evict never leaves an entry naming a slot that
does not hold that entry's chunk, whole; hits answered by clients still reach the agent's
counters; and a client notices an agent that died or restarted without asking it."""

from __future__ import annotations

import multiprocessing as mp
import random
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from kvtier.api.config import AgentConfig
from kvtier.client.connection import ALIVE_SECONDS, AgentClient, AgentUnavailable
from kvtier.local import wait as polling
from kvtier.local.agent import AgentProcess
from kvtier.shm.table import digests, index_path
from tests import index_race
from tests.helpers import NS, key, row, wait_settled

NBYTES = 4096
StartAgent = Callable[[AgentConfig], AgentProcess]


def small_pool(make_config: Callable[..., AgentConfig]) -> AgentConfig:
    return make_config(capacity=64 * (NBYTES + 4096) + 4096, chunkBytes=NBYTES)


def test_lookups_racing_evicting_stores_never_use_a_wrong_slot(
    make_config: Callable[..., AgentConfig], agent_factory: StartAgent
) -> None:
    config = small_pool(make_config)
    agent_factory(config)
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()  # type: ignore[type-arg]
    seconds = 6.0
    procs = [
        ctx.Process(target=index_race.churn, args=(config.endpoint, NBYTES, seconds, seed))
        for seed in (1, 2)
    ] + [
        ctx.Process(target=index_race.look, args=(config.endpoint, NBYTES, seconds, out))
        for _ in (1, 2)
    ]
    for proc in procs:
        proc.start()
    results = [out.get(timeout=120) for _ in range(2)]
    for proc in procs:
        proc.join(60)
        assert proc.exitcode == 0
    assert sum(wrong for wrong, _, _ in results) == 0
    assert sum(checked for _, checked, _ in results) > 0
    assert sum(loaded for _, _, loaded in results) > 0


def test_agent_killed_while_stores_evict_leaves_no_entry_on_a_torn_slot(
    make_config: Callable[..., AgentConfig], agent_factory: StartAgent
) -> None:
    config = small_pool(make_config)
    ctx = mp.get_context("spawn")
    rng = random.Random(7)
    for attempt in range(3):
        agent = agent_factory(config)
        writers = [
            ctx.Process(target=index_race.churn, args=(config.endpoint, NBYTES, 60.0, seed))
            for seed in (attempt, attempt + 10)
        ]
        for proc in writers:
            proc.start()
        time.sleep(rng.uniform(1.0, 2.0))  # the writers connect, fill the pool, then evict
        agent.kill()
        for proc in writers:
            proc.join(30)
        entries, problems = index_race.check_left_table(
            config.pool_path, index_path(config.pool_path), NBYTES
        )
        assert problems == []
        assert entries > 0


def test_lookups_answered_by_the_client_are_counted_by_the_agent(
    make_config: Callable[..., AgentConfig], agent_factory: StartAgent
) -> None:
    config = small_pool(make_config)
    agent_factory(config)
    with AgentClient(config.endpoint) as client:
        client.store(NS, [key(i) for i in range(4)], [row(i, NBYTES) for i in range(4)])
        assert client.index is not None
        before = client.stats()
        result = client.lookup(NS, [key(i) for i in range(6)])
        assert result.hits == [True] * 4 + [False] * 2 and result.prefix == 4
        deadline = time.monotonic() + 10
        while (stats := client.stats()).host.lookups < before.host.lookups + 6:
            assert time.monotonic() < deadline, stats
            time.sleep(0.02)
        assert stats.host.hits == before.host.hits + 4


def test_a_client_notices_a_dead_or_restarted_agent_without_asking(
    make_config: Callable[..., AgentConfig], agent_factory: StartAgent
) -> None:
    config = small_pool(make_config)
    first = agent_factory(config)
    client = AgentClient(config.endpoint, timeout=0.5).connect()
    client.store(NS, [key(0)], [row(0, NBYTES)])
    wait_settled(client)
    assert client.lookup(NS, [key(0)]).prefix == 1
    first.kill()
    try:
        client.lookup(NS, [key(0)])
        raise AssertionError("a dead agent's index answered")
    except AgentUnavailable:
        pass
    agent_factory(config)  # re-indexes the pool and publishes a new index
    client.timeout = 5
    deadline = time.monotonic() + 10
    while True:
        try:
            if client.lookup(NS, [key(0)]).prefix == 1:
                break
        except AgentUnavailable:
            pass
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert client.index is not None and not client.index.retired
    out = np.zeros(NBYTES, np.uint8)
    assert client.load_into(NS, [key(0)], [out]) == [True]
    assert np.array_equal(out, row(0, NBYTES))
    client.close()


def test_an_idle_client_lets_go_of_a_restarted_agents_index(
    make_config: Callable[..., AgentConfig], agent_factory: StartAgent
) -> None:
    """The tier's volume has room for two published indexes: an engine that sits idle
    across agent restarts must not keep each one mapped (its pages would stay allocated)."""
    config = small_pool(make_config)
    first = agent_factory(config)
    client = AgentClient(config.endpoint, timeout=0.5).connect()
    client.lookup(NS, [key(0)])  # answered from the index: reported, so reporting runs
    old = client.index
    assert old is not None
    first.kill()
    agent_factory(config)  # retires the index it replaces
    polling.wait_for(lambda: client.index is None, 10, interval=0.05)  # with no call made
    assert old.retired
    client.close()


def test_the_index_answers_a_key_alone_only_where_the_agent_has_nothing_to_add(
    make_config: Callable[..., AgentConfig], agent_factory: StartAgent, scratch: Path
) -> None:
    """`find`, the plug-in's per-key question: a held key is held; a key the pool lacks is a
    miss only when the agent has no secondary tier, else only the agent can say (None);
    and nothing is answered from the index of an agent that is gone. `finder`, made once
    per scheduler step, answers alike: one made after the agent went answers nothing, and
    one made before stops answering the moment a restarted agent retires the index."""
    fs = {"name": "fs", "filesystem": {"path": str(scratch / "fs"), "capacity": "64Mi"}}
    for tiers, absent in (([], False), ([fs], None)):
        config = make_config(
            {
                "name": f"find-{len(tiers)}",
                "runDir": str(scratch / f"run-{len(tiers)}"),
                "tiers": tiers,
            },
            capacity=64 * (NBYTES + 4096) + 4096,
            chunkBytes=NBYTES,
        )
        agent = agent_factory(config)
        client = AgentClient(config.endpoint, timeout=0.5).connect()
        client.store(NS, [key(0)], [row(0, NBYTES)])
        wait_settled(client)
        held, missing = digests(NS, [key(0), key(1)]).tolist()
        assert (client.find(held), client.find(missing)) == (True, absent)
        step = client.finder()
        assert (step(held), step(missing)) == (True, absent)
        agent.kill()
        time.sleep(2 * ALIVE_SECONDS)
        assert (client.find(held), client.find(missing)) == (None, None)
        assert client.finder()(held) is None
        # A finder made while the agent ran answers from its index until a restarted agent
        # retires it (or this client's hello goes): then it answers nothing.
        assert step(held) is True
        agent_factory(config)
        polling.wait_for(lambda step=step, held=held: step(held) is None, 10, interval=0.01)
        assert step(missing) is None
        client.close()
