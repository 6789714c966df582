"""Code that runs in client processes spawned by the tests (it must be importable by name)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from kvtier.api.stats import AgentStats
from kvtier.client.connection import AgentClient
from kvtier.local.wait import wait_for

NS = "model-a-fp16-b256"


def key(i: int) -> bytes:
    return b"chunk-%08d" % i


def row(i: int, nbytes: int) -> np.ndarray:
    """Distinct, position-dependent content, so a row copied to the wrong slot or offset fails."""
    return (np.arange(nbytes, dtype=np.uint32) * 2654435761 + i).astype(np.uint8)


def wait_settled(client: AgentClient, timeout: float = 10.0) -> AgentStats:
    """Wait until no slot is pinned (stores sealed, leases ended); the stats then."""

    def settled() -> AgentStats | None:
        stats = client.stats()
        return stats if not (stats.host.pinned_slots or stats.host.leases) else None

    return wait_for(settled, timeout, "agent settled (no pinned slot, no lease)")


def store_and_verify(
    endpoint: str,
    worker: int,
    keys: list[int],
    all_keys: list[int],
    nbytes: int,
    barrier: Any,
    results: Any,
) -> None:
    with AgentClient(endpoint) as client:
        stored = client.store(NS, [key(i) for i in keys], [row(i, nbytes) for i in keys])
        barrier.wait(timeout=60)
        outs = [np.zeros(nbytes, np.uint8) for _ in all_keys]
        loaded = client.load_into(NS, [key(i) for i in all_keys], outs)
        exact = sum(
            bool(ok) and np.array_equal(out, row(i, nbytes))
            for i, ok, out in zip(all_keys, loaded, outs, strict=True)
        )
        results.put((worker, stored.stored, sum(loaded), exact))


def hold_leases(endpoint: str, nbytes: int, ready: Any) -> None:
    """Take a load lease and a store lease, then hang until killed."""
    client = AgentClient(endpoint).connect()
    client.begin_load(NS, [key(0), key(1)])
    client.allocate(NS, [key(1000), key(1001)], nbytes)
    ready.set()
    time.sleep(600)


def loaned_chunk(client: AgentClient, nbytes: int) -> Any:
    """One chunk stored and sealed, and a load lease on it (the grant)."""
    client.store(NS, [key(0)], [row(0, nbytes)])
    wait_settled(client)
    return client.begin_load(NS, [key(0)])
