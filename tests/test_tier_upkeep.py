"""Secondary-tier upkeep under faults: quarantined files count and expire, a hung tier can
neither drain the pool nor stretch a call past the tier budget, and a tier that keeps failing
stops answering lookups until a probe finds it working again."""

from __future__ import annotations

import contextlib
import os
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier.agent.tiers.filesystem import QUARANTINE, FilesystemTier
from kvtier.api.config import AgentConfig, FilesystemTierConfig
from kvtier.client.connection import AgentClient, AgentUnavailable
from kvtier.local.agent import AgentProcess
from tests.agent_helpers import s3_tier, scrape, store, tier_stats, wait_for
from tests.conftest import ROW
from tests.faults import FaultProxy, Link
from tests.helpers import NS, key, row, wait_settled

StartAgent = Callable[[AgentConfig], AgentProcess]
SLOTS = 16


def test_quarantined_files_count_as_used_and_go_first(tmp_path: Path) -> None:
    tier = FilesystemTier("fs", FilesystemTierConfig(path=tmp_path, capacity=1 << 20, fsync=False))
    quarantine = tmp_path / QUARANTINE
    quarantine.mkdir()
    for i in range(15):  # 960 KiB of damaged files set aside, over the 90% watermark
        (quarantine / f"bad-{i}").write_bytes(b"\0" * (64 << 10))
    tier.maintain()
    on_disk = sum(p.stat().st_size for p in tmp_path.rglob("*") if p.is_file())
    assert tier.usage().used_bytes == on_disk
    assert on_disk <= 0.8 * (1 << 20)


def test_old_quarantined_files_expire(tmp_path: Path) -> None:
    tier = FilesystemTier("fs", FilesystemTierConfig(path=tmp_path, capacity=1 << 30))
    quarantine = tmp_path / QUARANTINE
    quarantine.mkdir()
    old, fresh = quarantine / "old", quarantine / "fresh"
    old.write_bytes(b"x")
    fresh.write_bytes(b"x")
    os.utime(old, (time.time() - 2 * 86400, time.time() - 2 * 86400))
    tier.maintain()
    assert not old.exists() and fresh.exists()


@pytest.fixture
def hung_s3() -> Iterator[FaultProxy]:
    proxy = FaultProxy(("127.0.0.1", 9))  # never forwarded: the link hangs
    proxy.set(Link.HUNG)
    yield proxy
    proxy.close()


def _pool(
    make_config: Callable[..., AgentConfig], tiers: list[dict[str, Any]], **top: Any
) -> AgentConfig:
    return make_config(
        {"tiers": tiers, "tierBudgetSeconds": 0.5, **top}, capacity=SLOTS * (ROW + 4096) + 4096
    )


def test_hung_tier_cannot_drain_the_pool_or_stretch_a_call(
    make_config: Callable[..., AgentConfig],
    agent_factory: StartAgent,
    s3_bucket: dict[str, Any],
    hung_s3: FaultProxy,
) -> None:
    tier = s3_tier(s3_bucket, endpoint=hung_s3.endpoint, timeoutSeconds=5, retries=0)
    config = _pool(make_config, [tier])
    agent_factory(config)
    with AgentClient(config.endpoint, timeout=5) as client:
        store(client, range(SLOTS))  # their write-backs hang: they stay pinned, not lost
    longest = [0.0]
    stop = time.monotonic() + 4

    def reader(n: int) -> None:
        with AgentClient(config.endpoint, timeout=5) as client:
            i = 0
            while time.monotonic() < stop:
                i += 1
                started = time.monotonic()
                ids = [10_000 * n + 100 * i + j for j in range(4)]
                outs = [np.zeros(ROW, np.uint8) for _ in ids]
                with contextlib.suppress(AgentUnavailable):
                    client.load_into(NS, [key(k) for k in ids], outs)
                longest[0] = max(longest[0], time.monotonic() - started)

    threads = [threading.Thread(target=reader, args=(n,)) for n in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    with AgentClient(config.endpoint) as client:
        chunks = client.stats().host.chunks
    assert chunks >= SLOTS * 3 // 4, f"a hung tier drained the pool to {chunks} chunks"
    assert longest[0] <= 0.5 + 0.5, f"a call took {longest[0]:.3f}s against a 0.5 s budget"


def test_failing_tier_stops_answering_lookups_until_a_probe_succeeds(
    make_config: Callable[..., AgentConfig],
    agent_factory: StartAgent,
    s3_bucket: dict[str, Any],
) -> None:
    target = urllib.parse.urlsplit(s3_bucket["endpoint"])
    proxy = FaultProxy((target.hostname or "127.0.0.1", target.port or 80))
    try:
        tier = s3_tier(s3_bucket, endpoint=proxy.endpoint, timeoutSeconds=1, retries=0)
        config = _pool(make_config, [tier])
        agent_factory(config)
        with AgentClient(config.endpoint, timeout=3) as client:
            for first in range(0, SLOTS, 4):  # within the write-backs' share of the pool
                store(client, range(first, first + 4))
                wait_for(lambda n=first + 4: tier_stats(client, "s3").counts.writebacks == n)
            store(client, range(SLOTS, 2 * SLOTS))  # the first chunks now live in S3 only
            wait_settled(client)
            ids = list(range(SLOTS))
            assert client.lookup(NS, [key(i) for i in ids]).where == [1] * SLOTS
            proxy.set(Link.DOWN)
            false_hits = []
            for _ in range(20):
                where = client.lookup(NS, [key(i) for i in ids]).where
                outs = [np.zeros(ROW, np.uint8) for _ in ids]
                loaded = client.load_into(NS, [key(i) for i in ids], outs)
                false_hits.append(
                    sum(w == 1 and not ok for w, ok in zip(where, loaded, strict=True))
                )
            assert sum(false_hits[5:]) == 0, f"false hits per round while S3 was down: {false_hits}"
            assert tier_stats(client, "s3").healthy is False
            assert scrape(client.stats().metrics_port)['kvtier_tier_healthy{tier="s3"}'] == 0
            proxy.set(Link.UP)
            wait_for(lambda: tier_stats(client, "s3").healthy)
            assert client.lookup(NS, [key(0)]).where == [1]
            outs = [np.zeros(ROW, np.uint8)]
            assert client.load_into(NS, [key(0)], outs) == [True]
            assert np.array_equal(outs[0], row(0, ROW))
    finally:
        proxy.close()
