"""The agent's memory as the operator sizes it: the pool, a fixed overhead, and its index of
the pool's chunks under its policy. The index's share is held to what the agent's own index
takes at steady state (`tests/index_memory.py`: every slot filled, the pool turned over
many times, what each policy remembers of evicted chunks at its bound, the process's
resident set as the kernel counts it): a pod limited to less is OOM-killed on a real node,
which no test here can run."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvtier.api.agent_memory import (
    INDEX_BYTES_PER_SLOT,
    OVERHEAD,
    agent_memory,
    index_bytes,
    largest_capacity,
)
from kvtier.api.pool_layout import PAGE, pool_slot_count
from kvtier.operator.builders import agent_resources

SLOTS = 8192


@pytest.mark.parametrize("policy", sorted(INDEX_BYTES_PER_SLOT))
def test_the_index_stays_within_what_the_agent_is_given(policy: str) -> None:
    """Measured on a pool of 8,192 slots, where what the index keeps whatever the pool's
    size (up to 8,192 chunks refused or announced) still counts per slot: a larger pool
    takes less per slot (prefix's 7.5 KiB here is 5.1 KiB at 65,536 slots)."""
    run = [sys.executable, "-m", "tests.index_memory", policy, str(SLOTS)]
    done = subprocess.run(run, capture_output=True, text=True, check=True)
    per_slot = float(done.stdout)
    assert per_slot > 0, done.stdout
    assert per_slot <= INDEX_BYTES_PER_SLOT[policy], (policy, per_slot)


def test_the_operator_requests_the_index_of_small_chunks() -> None:
    """64Gi of 64Ki chunks under prefix: nearly a million slots, whose index alone is
    more than the fixed overhead many times over."""
    spec = {"host": {"capacity": "64Gi", "chunkSize": "64Ki", "policy": "prefix"}}
    slots = pool_slot_count(64 << 30, 64 << 10)
    memory = int(agent_resources(spec)["limits"]["memory"])
    assert memory == (64 << 30) + OVERHEAD + slots * INDEX_BYTES_PER_SLOT["prefix"]
    assert index_bytes("prefix", slots) > 10 * OVERHEAD
    lru = int(agent_resources({"host": {**spec["host"], "policy": "lru"}})["limits"]["memory"])
    assert lru < memory


@pytest.mark.parametrize("policy", sorted(INDEX_BYTES_PER_SLOT))
@pytest.mark.parametrize("chunk", [64 << 10, 2 << 20, 33 << 20])
def test_the_largest_capacity_that_fits_is_the_largest(policy: str, chunk: int) -> None:
    for memory in (600 << 20, 23820416 << 10, 512 << 30):
        capacity = largest_capacity(memory, chunk, policy)
        assert agent_memory(capacity, chunk, policy) <= memory
        stride = PAGE + chunk
        assert agent_memory(capacity + stride, chunk, policy) > memory
    assert largest_capacity(OVERHEAD, chunk, policy) == 0
