"""What an agent holds in memory: its pool (a tmpfs file charged to its cgroup), a fixed
overhead, and its own index of the pool's chunks, which grows with the slot count and
depends on the eviction policy. The operator requests (and limits the agent to) their sum,
so an agent whose index outgrows a fixed overhead is not OOM-killed on a large pool of small
chunks. Standard library only: the operator imports it.
"""

from __future__ import annotations

from kvtier.api.pool_layout import SLOT_HEADER_BYTES, pool_slot_count, slot_payload_bytes

OVERHEAD = 512 << 20  # the process, page tables, the staging area, write-back buffers

# Bytes of the agent's index per pool slot at steady state (every slot filled, the chunks
# each policy remembers after eviction remembered: none for lru, ARC's ghost lists of up to
# one pool's worth, prefix's history of 16 pools' worth), with a margin over what
# tests/test_agent_memory.py measures on the agent's own index, which fails if it outgrows
# them.
INDEX_BYTES_PER_SLOT = {"lru": 1024, "arc": 2048, "prefix": 12288}


def index_bytes(policy: str, slots: int) -> int:
    """The most the agent's index of `slots` slots takes under `policy`."""
    return slots * INDEX_BYTES_PER_SLOT[policy]


def agent_memory(capacity: int, chunk_bytes: int, policy: str) -> int:
    """What an agent with this pool needs: the pool, the overhead and its index."""
    return capacity + OVERHEAD + index_bytes(policy, pool_slot_count(capacity, chunk_bytes))


def largest_capacity(memory: int, chunk_bytes: int, policy: str) -> int:
    """The largest `host.capacity` whose agent fits in `memory` (0: none does)."""
    stride = SLOT_HEADER_BYTES + slot_payload_bytes(chunk_bytes)
    per_slot = INDEX_BYTES_PER_SLOT[policy]
    capacity = max(0, (memory - OVERHEAD) * stride // (stride + per_slot))
    while capacity and agent_memory(capacity, chunk_bytes, policy) > memory:
        capacity -= stride  # the slot count rounds down; at most a step or two
    return capacity
