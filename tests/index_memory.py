"""What the agent's own index of a full pool takes in memory at steady state, measured in
a process of its own as the kernel counts it (the resident set's peak growth, allocator
slack included, transparent huge pages off): `python -m tests.index_memory POLICY SLOTS`
prints the bytes per slot.

The traffic is chained stores as the plug-in makes them: requests of 16 new chunks, half of
them extending an earlier request's chain (a later turn of a conversation), each store
naming its chunks' parents, for 20 pools' worth of new chunks, so that what each policy
remembers of evicted chunks reaches its bound (ARC's ghost lists one pool's worth, prefix's
history 16 pools')."""

from __future__ import annotations

import ctypes
import random
import sys

from kvtier.agent.host.events import ChunkEvents
from kvtier.agent.host.index import HostIndex
from kvtier.agent.host.policy import make_policy, prefix
from kvtier.api.pool_layout import PAGE

TURNS = 20
PR_SET_THP_DISABLE = 41


def _status(field: str) -> int:
    """A `/proc/self/status` figure in bytes (VmRSS: resident now, VmHWM: the peak)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) << 10
    raise LookupError(field)


def _no_huge_pages() -> None:
    """Where transparent huge pages are `always`, the resident set grows in 2 MiB steps."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_THP_DISABLE, 1, 0, 0, 0)


def steady_index(policy: str, slots: int) -> HostIndex:
    rng = random.Random(7)
    made, chains = 0, []
    index = HostIndex(slots, make_policy(policy, slots))
    index.events = ChunkEvents(per_namespace=1)  # a ring of bounded size, not per slot
    while made < TURNS * slots:
        head = rng.choice(chains) if chains and rng.random() < 0.5 else []
        keys = head + [i.to_bytes(32, "little") for i in range(made, made + 16)]
        made += 16
        _, hit = index.lookup("ns", keys)
        todo = keys[hit:]
        parents = [keys[hit - 1] if hit else None, *todo[:-1]]
        lease = index.allocate("c", "ns", todo, PAGE, float("inf"), parents)[0]
        if lease:
            index.commit(lease, "c")
        chains.append(keys[-48:])
        del chains[:-512]
    assert len(index.policy) == slots, "the pool never filled"
    return index


def main(policy: str, slots: int) -> None:
    # prefix remembers 16 pools' worth of evicted chunks but at least 65,536; a small
    # pool is given the ratio of a large one
    prefix.HISTORY_MIN = 16 * slots
    _no_huge_pages()
    before = _status("VmRSS")
    index = steady_index(policy, slots)
    print((_status("VmHWM") - before) / slots)  # the peak: a limit is hit at its peak
    del index


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
