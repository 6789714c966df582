"""Bytes altered in the pool after sealing are never served: every client of a tier maps the
pool writable, so the agent checks each sealed chunk against its checksum before lending it.
An altered chunk is a miss, counted (`kvtier_corrupt_chunks_total{tier="host"}`) and dropped,
its slot free for the next store; its neighbours are served intact."""

from __future__ import annotations

import numpy as np

from kvtier.agent.client import AgentClient
from kvtier.agent.process import AgentProcess
from tests.conftest import ROW
from tests.helpers import NS, key, row, wait_settled
from tests.pool_access import alter_slot, sealed_slots
from tests.test_agent import scrape


def test_chunks_altered_after_sealing_are_misses_counted_and_dropped(
    agent: AgentProcess,
) -> None:
    ids = list(range(8))
    with AgentClient(agent.config.endpoint) as client:
        client.store(NS, [key(i) for i in ids], [row(i, ROW) for i in ids])
        wait_settled(client)  # sealed: every chunk has its checksum
        slots = sealed_slots(agent.config.pool_path, NS)
        altered = [1, 3, 5, 7]
        for i in altered:
            alter_slot(agent.config.pool_path, slots[key(i)])
        outs = [np.zeros(ROW, np.uint8) for _ in ids]
        loaded = client.load_into(NS, [key(i) for i in ids], outs)
        assert loaded == [i not in altered for i in ids]
        for i in ids:
            if i not in altered:
                assert np.array_equal(outs[i], row(i, ROW)), i
        stats = client.stats()
        assert client.lookup(NS, [key(i) for i in altered]).prefix == 0  # dropped
        metrics = scrape(stats["metrics_port"])
        assert metrics['kvtier_corrupt_chunks_total{tier="host"}'] == len(altered)
        # The slots are rewritten by the next stores and served intact again.
        client.store(NS, [key(i) for i in altered], [row(i, ROW) for i in altered])
        wait_settled(client)
        back = [np.zeros(ROW, np.uint8) for _ in altered]
        assert client.load_into(NS, [key(i) for i in altered], back) == [True] * len(altered)
        assert all(np.array_equal(b, row(i, ROW)) for b, i in zip(back, altered, strict=True))
