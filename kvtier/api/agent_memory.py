"""What an agent holds in memory: its pool (a tmpfs file charged to its cgroup) and the page
tables that map it, a fixed overhead, and what it keeps per slot of the pool: its index of
the chunks, which depends on the eviction policy, and the rest of its per-chunk state. The
operator requests (and limits the agent to) their sum, so an agent with a large pool of
small chunks is not OOM-killed for outgrowing a fixed overhead. Standard library only: the
operator imports it.
"""

from __future__ import annotations

from kvtier.api.pool_layout import SLOT_HEADER_BYTES, pool_slot_count, slot_payload_bytes

# The process, the staging area (up to 64 MiB), the bounded logs (events, access log), the
# write-back buffers, and what a policy remembers whatever the pool's size (prefix: at
# least 65,536 evicted chunks, about 27 MiB).
OVERHEAD = 512 << 20

# The pool is mapped with 4 KiB pages: 8 bytes of page table per page, charged to the
# agent's cgroup like the pool (2 MiB per GiB; all of OVERHEAD for a 256 GiB pool).
PAGE_TABLE_SHARE = 512

# Bytes of the agent's index per pool slot at steady state (every slot filled, the chunks
# each policy remembers after eviction remembered: none for lru, ARC's ghost lists of up to
# one pool's worth, prefix's history of 16 pools' worth), with a margin over what
# tests/test_agent_memory.py measures on the agent's own index, which fails if it outgrows
# them.
INDEX_BYTES_PER_SLOT = {"lru": 1024, "arc": 2048, "prefix": 12288}

# The rest of what the agent keeps per slot, whatever the policy (measured by hand on the
# agent's parts, 32-byte keys): the published index, twice while readers still map the
# one it replaces (48-96 bytes each), the chunks it announces when KV events are on (about
# 180), the peer tier's record of what it holds and its share of the node directory (about
# 530), and the copies of these made while they are sent or caught up (200-300).
AGENT_BYTES_PER_SLOT = 1536


def slot_bytes(policy: str) -> int:
    """What the agent keeps per slot of its pool under `policy`, besides the slot."""
    return INDEX_BYTES_PER_SLOT[policy] + AGENT_BYTES_PER_SLOT


def state_bytes(policy: str, slots: int) -> int:
    """The most the agent's per-slot state takes for `slots` slots under `policy`."""
    return slots * slot_bytes(policy)


def agent_memory(capacity: int, chunk_bytes: int, policy: str) -> int:
    """What an agent with this pool needs: the pool and its page tables, the overhead, and
    its per-slot state."""
    slots = pool_slot_count(capacity, chunk_bytes)
    return capacity + capacity // PAGE_TABLE_SHARE + OVERHEAD + state_bytes(policy, slots)


def largest_capacity(memory: int, chunk_bytes: int, policy: str) -> int:
    """The largest `host.capacity` whose agent fits in `memory`; 0 when no pool of even one
    slot does."""
    stride = SLOT_HEADER_BYTES + slot_payload_bytes(chunk_bytes)
    per_slot = slot_bytes(policy)
    # memory = c + c / PAGE_TABLE_SHARE + OVERHEAD + (c / stride) * per_slot, solved for c
    share = PAGE_TABLE_SHARE * stride
    # (rounded down, and agent_memory's own terms round down, so the result fits)
    denominator = share + stride + PAGE_TABLE_SHARE * per_slot
    capacity = max(0, (memory - OVERHEAD) * share // denominator)
    return capacity if pool_slot_count(capacity, chunk_bytes) else 0
