"""The agent's memory as the operator sizes it: the pool, a fixed overhead, and its index of
the pool's chunks under its policy. The index's share is held to what the agent's own index
takes at steady state (`tests/index_memory.py`: every slot filled, the pool turned over
many times, what each policy remembers of evicted chunks at its bound, the process's
resident set as the kernel counts it): a pod limited to less is OOM-killed on a real node,
which no test here can run."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, get_args

import pytest

from kvtier.api.agent_memory import (
    AGENT_BYTES_PER_SLOT,
    INDEX_BYTES_PER_SLOT,
    OVERHEAD,
    PAGE_TABLE_SHARE,
    agent_memory,
    largest_capacity,
    state_bytes,
)
from kvtier.api.config import HostTierConfig
from kvtier.api.pool_layout import PAGE, pool_geometry, pool_slot_count
from kvtier.operator.builders import agent_resources
from kvtier.operator.diagnosis import capacity_warning, quantity
from kvtier.shm.pool import create

SLOTS = 8192


@pytest.mark.parametrize("policy", sorted(INDEX_BYTES_PER_SLOT))
def test_the_index_stays_within_what_the_agent_is_given(policy: str) -> None:
    """Measured on a pool of 8,192 slots, where what the index keeps whatever the pool's
    size (up to 8,192 chunks refused or announced) still counts per slot: a larger pool
    takes no more per slot (prefix's 7.3 KiB here is 5.1 KiB at 65,536 slots, arc's 1.4 KiB
    about the same)."""
    run = [sys.executable, "-m", "tests.index_memory", policy, str(SLOTS)]
    done = subprocess.run(run, capture_output=True, text=True, check=True)
    per_slot = float(done.stdout)
    assert per_slot > 0, done.stdout
    assert per_slot <= INDEX_BYTES_PER_SLOT[policy], (policy, per_slot)


def test_the_operator_requests_the_index_of_small_chunks() -> None:
    """64Gi of 64Ki chunks under prefix: nearly a million slots, whose state alone is
    more than the fixed overhead many times over."""
    spec = {"host": {"capacity": "64Gi", "chunkSize": "64Ki", "policy": "prefix"}}
    slots = pool_slot_count(64 << 30, 64 << 10)
    memory = int(agent_resources(spec)["limits"]["memory"])
    per_slot = INDEX_BYTES_PER_SLOT["prefix"] + AGENT_BYTES_PER_SLOT
    assert memory == (64 << 30) + (64 << 30) // 512 + OVERHEAD + slots * per_slot
    assert state_bytes("prefix", slots) > 10 * OVERHEAD
    lru = int(agent_resources({"host": {**spec["host"], "policy": "lru"}})["limits"]["memory"])
    assert lru < memory


def test_every_policy_a_tier_may_name_has_a_bound() -> None:
    """The operator sizes an agent for any policy the config model admits."""
    allowed = set(get_args(HostTierConfig.model_fields["policy"].annotation))
    assert allowed == set(INDEX_BYTES_PER_SLOT)


def test_a_node_too_small_for_one_chunk_says_to_lower_the_chunk_size() -> None:
    spec = {"host": {"capacity": "4Gi", "chunkSize": "1Gi", "policy": "arc"}}
    assert largest_capacity(600 << 20, 1 << 30, "arc") == 0
    warning = capacity_warning(spec, [node("small", "600Mi")])
    assert warning is not None and "lower spec.host.chunkSize" in warning, warning
    # under prefix, what lru would fit is named too
    spec = {"host": {"capacity": "64Gi", "chunkSize": "64Ki", "policy": "prefix"}}
    warning = capacity_warning(spec, [node("small", "64Gi")])
    assert warning is not None
    fits, lean = (
        largest_capacity(64 << 30, 64 << 10, "prefix"),
        largest_capacity(64 << 30, 64 << 10, "lru"),
    )
    assert f"at most {quantity(fits)} ({quantity(lean)} with host.policy lru)" in warning


def node(name: str, allocatable: str) -> dict[str, Any]:
    return {"metadata": {"name": name}, "status": {"allocatable": {"memory": allocatable}}}


@pytest.mark.parametrize("policy", sorted(INDEX_BYTES_PER_SLOT))
@pytest.mark.parametrize("chunk", [64 << 10, 2 << 20, 33 << 20])
def test_the_largest_capacity_that_fits_is_the_largest(policy: str, chunk: int) -> None:
    for memory in (600 << 20, 23820416 << 10, 512 << 30):
        capacity = largest_capacity(memory, chunk, policy)
        assert agent_memory(capacity, chunk, policy) <= memory
        stride = PAGE + chunk
        assert agent_memory(capacity + stride, chunk, policy) > memory
    assert largest_capacity(OVERHEAD, chunk, policy) == 0


def test_the_pools_page_tables_are_what_the_agent_is_given_for_them(tmp_path: Path) -> None:
    """The agent maps its whole pool populated, 4 KiB pages on tmpfs: 8 bytes of page
    table per page, charged to its cgroup beside the pool (in a process of its own, whose
    page tables start small)."""
    path = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="kvtier-pt-")) / "pool"
    try:
        geometry = pool_geometry(256 << 20, 2 << 20)
        create(path, geometry, 0o600)
        script = (
            "import sys\n"
            "from pathlib import Path\n"
            "from kvtier.shm.pool import PoolMap\n"
            "def pte():\n"
            "    for line in open('/proc/self/status'):\n"
            "        if line.startswith('VmPTE:'):\n"
            "            return int(line.split()[1]) << 10\n"
            "before = pte()\n"
            "pool = PoolMap.open(Path(sys.argv[1]))\n"
            "print(pte() - before)\n"
        )
        done = subprocess.run(
            [sys.executable, "-c", script, str(path)], capture_output=True, text=True, check=True
        )
        grown = int(done.stdout)
        assert grown > 0, done.stdout  # the mapping's pages were populated
        assert grown <= geometry.file_bytes // PAGE_TABLE_SHARE + (64 << 10), grown
    finally:
        shutil.rmtree(path.parent, ignore_errors=True)
