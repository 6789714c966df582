"""Processes of the published-index tests (importable by name, for spawned processes)."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.agent.chunk import ChunkHeader
from kvtier.client.connection import AgentClient, AgentUnavailable
from kvtier.shm.pool import PoolMap
from kvtier.shm.table import digest, digests
from tests.helpers import NS, key, row

KEYS = 240  # more than the pool's slots: stores evict all the time


def churn(endpoint: str, nbytes: int, seconds: float, seed: int) -> None:
    """Store random keys, a few at a time, until `seconds` pass or the agent is gone."""
    rng = random.Random(seed)
    deadline = time.monotonic() + seconds
    with AgentClient(endpoint, timeout=2) as client:
        while time.monotonic() < deadline:
            ids = rng.sample(range(KEYS), 4)
            try:
                client.store(NS, [key(i) for i in ids], [row(i, nbytes) for i in ids])
            except AgentUnavailable:
                return


def look(endpoint: str, nbytes: int, seconds: float, out: Any) -> None:
    """Look keys up in the published index and check every hit against the pool itself:
    when the slot's generation is the one the index gave before and after reading the
    slot's header, the header must name the key looked up. Then load the hits: whatever
    is reported loaded must be the key's own bytes."""
    wrong = checked = loaded_ok = 0
    keys = [key(i) for i in range(KEYS)]
    ds = digests(NS, keys)
    deadline = time.monotonic() + seconds
    with AgentClient(endpoint, timeout=5) as client:
        assert client.index is not None and client.pool is not None
        pool = client.pool
        while time.monotonic() < deadline:
            slots, gens = client.index.find(ds)
            for i in np.flatnonzero(slots >= 0).tolist():
                slot, gen = int(slots[i]), int(gens[i])
                before = pool.generation(slot)
                header = ChunkHeader.unpack(pool.header(slot).tobytes())
                after = pool.generation(slot)
                if before == after == gen:
                    checked += 1
                    wrong += header is None or (header.namespace, header.key) != (NS, keys[i])
            hits = [i for i in np.flatnonzero(slots >= 0).tolist()][:8]
            outs = [np.zeros(nbytes, np.uint8) for _ in hits]
            loaded = client.load_into(NS, [keys[i] for i in hits], outs)
            for i, ok, buf in zip(hits, loaded, outs, strict=True):
                if ok:
                    loaded_ok += 1
                    wrong += not np.array_equal(buf, row(i, nbytes))
    out.put((wrong, checked, loaded_ok))


def check_left_table(pool_path: Path, index_file: Path, nbytes: int) -> tuple[int, list[str]]:
    """Every whole entry of a table a dead agent left: its slot holds its chunk, whole."""
    from kvtier.shm.table import TableReader

    reader = TableReader(index_file)
    pool = PoolMap.open(pool_path, populate=False)
    problems = []
    try:
        ds, slots, gens = reader.entries()
        for d, slot, gen in zip(ds.tolist(), slots.tolist(), gens.tolist(), strict=True):
            header = ChunkHeader.unpack(pool.header(slot).tobytes())
            if header is None or header.namespace != NS or digest(NS, header.key) != d:
                problems.append(f"slot {slot}: header {header} is not the entry's chunk")
                continue
            if pool.generation(slot) != gen:
                problems.append(f"slot {slot}: generation {pool.generation(slot)} != {gen}")
            i = int(header.key.removeprefix(b"chunk-"))
            if not np.array_equal(pool.payload(slot, nbytes), row(i, nbytes)):
                problems.append(f"slot {slot}: bytes of {header.key!r} are torn")
        return len(ds), problems
    finally:
        pool.close()
        reader.close()
