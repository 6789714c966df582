"""Driving and inspecting a running agent from the tests: its /metrics page, the slot a
chunk sits in, a tier's stats, chunks stored and loaded back exactly, an S3 tier's config."""

from __future__ import annotations

import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from kvtier.agent.chunk import ChunkHeader
from kvtier.api.stats import TierStats
from kvtier.client.connection import AgentClient
from kvtier.local import wait as polling
from kvtier.shm.pool import PoolMap
from tests.conftest import ROW
from tests.helpers import NS, key, row


def find_slot(pool_path: Path, wanted: bytes) -> int:
    pool = PoolMap.open(pool_path, populate=False)
    try:
        for slot in range(pool.geometry.slot_count):
            header = ChunkHeader.unpack(memoryview(pool.header(slot)))
            if header is not None and header.key == wanted:
                return slot
    finally:
        pool.close()
    raise LookupError(wanted)


def scrape(port: int) -> dict[str, float]:
    """Samples of the agent's /metrics page, keyed like `name{label="v"}`."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples


def s3_tier(bucket: dict[str, Any], **kw: Any) -> dict[str, Any]:
    fields = {k: v for k, v in bucket.items() if k != "client"}
    return {"name": "s3", "objectStore": {**fields, **kw}}


def tier_stats(client: AgentClient, name: str) -> TierStats:
    return client.stats().tier(name)


def write_backs_done(client: AgentClient, name: str) -> int:
    """Write-backs to tier `name` written, failed or dropped: those no longer pending."""
    counts = tier_stats(client, name).counts
    return counts.writebacks + counts.write_errors + counts.dropped


def store_written(client: AgentClient, ids: range, name: str) -> None:
    """Store `ids` four at a time, each four once the last are written to tier `name`:
    a write-back that would pin more than half the pool is dropped, and a busy machine's
    writer can fall that far behind one store of many chunks."""
    done = write_backs_done(client, name)
    for start in range(ids.start, ids.stop, 4):
        batch = range(start, min(start + 4, ids.stop))
        store(client, batch)
        done += len(batch)
        wait_for(lambda n=done: write_backs_done(client, name) == n)


def wait_for(predicate: Callable[[], Any], timeout: float = 20.0) -> Any:
    return polling.wait_for(predicate, timeout)


def store(client: AgentClient, ids: range | list[int]) -> None:
    ids = list(ids)
    client.store(NS, [key(i) for i in ids], [row(i, ROW) for i in ids])


def load_exact(client: AgentClient, ids: list[int]) -> list[bool]:
    outs = [np.zeros(ROW, np.uint8) for _ in ids]
    loaded = client.load_into(NS, [key(i) for i in ids], outs)
    return [
        ok and np.array_equal(o, row(i, ROW)) for i, ok, o in zip(ids, loaded, outs, strict=True)
    ]
