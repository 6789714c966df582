"""Agent processes with secondary tiers: write-back, lookups and loads across tiers, shared
directories between agents, restarts with an empty pool, and faults that become misses."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvtier.api.config import AgentConfig
from kvtier.client.connection import AgentClient
from kvtier.local.agent import AgentProcess
from tests.agent_helpers import load_exact, s3_tier, scrape, store, tier_stats, wait_for
from tests.conftest import free_port
from tests.helpers import NS, key

StartAgent = Callable[[AgentConfig], AgentProcess]


def fs_tier(path: Path, **kw: Any) -> dict[str, Any]:
    return {
        "name": "shared-fs",
        "filesystem": {"path": str(path), "capacity": "64Mi", "fsync": False, **kw},
    }


def fs_file(root: Path, i: int) -> Path:
    h = key(i).hex()
    return root / NS / h[:2] / h[2:4] / h


def test_two_agents_share_a_filesystem_tier(
    make_config: Callable[..., AgentConfig], agent_factory: StartAgent, scratch: Path
) -> None:
    """Agent A (one node) stores; agent B (another node, its own pool) loads the chunks."""
    shared = scratch / "shared-fs"
    a = make_config(
        {"name": "node-a", "runDir": str(scratch / "run-a"), "tiers": [fs_tier(shared)]}
    )
    b = make_config(
        {"name": "node-b", "runDir": str(scratch / "run-b"), "tiers": [fs_tier(shared)]}
    )
    agent_factory(a)
    agent_factory(b)
    with AgentClient(a.endpoint) as ca:
        store(ca, range(10))
        wait_for(lambda: tier_stats(ca, "shared-fs").counts.writebacks == 10)
    with AgentClient(b.endpoint) as cb:
        assert cb.tiers == ["host", "shared-fs"]
        found = cb.lookup(NS, [key(i) for i in range(12)])
        assert found.where == [1] * 10 + [-1, -1] and found.prefix == 10
        assert load_exact(cb, list(range(10))) == [True] * 10
        assert cb.lookup(NS, [key(i) for i in range(10)]).where == [0] * 10  # promoted
        stats = cb.stats()
        assert stats.metrics_port is not None
        metrics = scrape(stats.metrics_port)
    counts = stats.tier("shared-fs").counts
    assert counts.promotions == 10 and counts.misses >= 2
    # /metrics reads the same counters the stats reply carries
    assert metrics['kvtier_promotions_total{tier="shared-fs"}'] == counts.promotions
    assert metrics['kvtier_tier_misses_total{tier="shared-fs"}'] == counts.misses
    assert metrics['kvtier_hits_total{tier="shared-fs"}'] == counts.hits
    assert metrics['kvtier_hits_total{tier="host"}'] == stats.host.hits > 0
    assert metrics["kvtier_lookups_total"] == stats.host.lookups


def written_to_fs_and_s3(client: AgentClient, chunks: int) -> None:
    """Store `chunks` chunks and wait until both secondary tiers hold them."""
    store(client, range(chunks))
    wait_for(lambda: all(t.counts.writebacks == chunks for t in client.stats().tiers))


@pytest.fixture
def fs_and_s3(
    make_config: Callable[..., AgentConfig],
    agent_factory: StartAgent,
    scratch: Path,
    s3_bucket: dict[str, Any],
) -> tuple[AgentConfig, AgentProcess]:
    """An agent with a filesystem tier (at scratch/fs) and an S3 tier behind its pool."""
    config = make_config({"tiers": [fs_tier(scratch / "fs"), s3_tier(s3_bucket)]})
    return config, agent_factory(config)


def test_restart_with_empty_pool_serves_from_filesystem_and_s3(
    fs_and_s3: tuple[AgentConfig, AgentProcess], agent_factory: StartAgent, scratch: Path
) -> None:
    config, first = fs_and_s3
    with AgentClient(config.endpoint) as client:
        written_to_fs_and_s3(client, 8)
    first.kill()
    config.pool_path.unlink()  # the node rebooted: host memory is gone
    for i in range(4, 8):  # and the filesystem lost half the chunks
        fs_file(scratch / "fs", i).unlink()

    agent_factory(config)
    with AgentClient(config.endpoint) as client:
        assert client.stats().host.chunks == 0
        assert client.lookup(NS, [key(i) for i in range(8)]).where == [1] * 4 + [2] * 4
        assert load_exact(client, list(range(8))) == [True] * 8


def test_one_request_served_from_three_tiers(
    fs_and_s3: tuple[AgentConfig, AgentProcess], scratch: Path
) -> None:
    config, _ = fs_and_s3
    with AgentClient(config.endpoint) as client:
        written_to_fs_and_s3(client, 6)
        for i in (4, 5):  # these two stay on S3 only
            fs_file(scratch / "fs", i).unlink()
        flush = range(100, 100 + client.stats().host.slots)
        store(client, flush)
        assert client.lookup(NS, [key(i) for i in flush]).prefix == len(flush)
        assert load_exact(client, [0, 1]) == [True, True]  # back into the pool
        ids = [0, 1, 2, 3, 4, 5, 999]
        found = client.lookup(NS, [key(i) for i in ids])
        assert found.where == [0, 0, 1, 1, 2, 2, -1]
        assert load_exact(client, ids) == [True] * 6 + [False]


def unreachable_s3(s3_bucket: dict[str, Any], timeout: float) -> dict[str, Any]:
    """An S3 tier whose endpoint nobody listens on: every operation fails after `timeout`."""
    endpoint = f"http://127.0.0.1:{free_port()}"
    return s3_tier(s3_bucket, endpoint=endpoint, timeoutSeconds=timeout, retries=0)


def test_unreachable_s3_degrades_to_misses_in_time(
    make_config: Callable[..., AgentConfig],
    agent_factory: StartAgent,
    s3_bucket: dict[str, Any],
) -> None:
    config = make_config({"tiers": [unreachable_s3(s3_bucket, 0.3)], "tierBudgetSeconds": 0.5})
    agent_factory(config)
    with AgentClient(config.endpoint, timeout=3) as client:
        store(client, range(5))
        started = time.monotonic()
        found = client.lookup(NS, [key(i) for i in range(10)])
        assert time.monotonic() - started < 2
        assert found.where == [0] * 5 + [-1] * 5
        assert load_exact(client, list(range(10))) == [True] * 5 + [False] * 5
        wait_for(lambda: tier_stats(client, "s3").counts.write_errors == 5)


def test_full_write_back_queue_drops_without_blocking(
    make_config: Callable[..., AgentConfig],
    agent_factory: StartAgent,
    s3_bucket: dict[str, Any],
) -> None:
    slow = {**unreachable_s3(s3_bucket, 1), "queueDepth": 1, "workers": 1}
    config = make_config({"tiers": [slow]})
    agent_factory(config)
    with AgentClient(config.endpoint, timeout=3) as client:
        started = time.monotonic()
        for i in range(20):
            store(client, [i])
        assert time.monotonic() - started < 3
        wait_for(lambda: tier_stats(client, "s3").counts.dropped > 0)
        assert client.lookup(NS, [key(i) for i in range(20)]).prefix == 20


def test_admission_after_hits(
    make_config: Callable[..., AgentConfig], agent_factory: StartAgent, scratch: Path
) -> None:
    config = make_config({"tiers": [{**fs_tier(scratch / "fs"), "admitAfterHits": 2}]})
    agent_factory(config)
    with AgentClient(config.endpoint) as client:
        store(client, range(3))
        time.sleep(0.3)
        assert tier_stats(client, "shared-fs").counts.writebacks == 0
        client.lookup(NS, [key(0), key(1)])
        client.lookup(NS, [key(0)])
        wait_for(lambda: tier_stats(client, "shared-fs").counts.writebacks == 1)
        time.sleep(0.3)
        assert tier_stats(client, "shared-fs").counts.writebacks == 1


def test_tier_directory_deleted_under_running_agent(
    make_config: Callable[..., AgentConfig], agent_factory: StartAgent, scratch: Path
) -> None:
    config = make_config({"tiers": [fs_tier(scratch / "fs")]})
    agent_factory(config)
    with AgentClient(config.endpoint) as client:
        store(client, range(4))
        wait_for(lambda: tier_stats(client, "shared-fs").counts.writebacks == 4)
        shutil.rmtree(scratch / "fs")
        assert client.lookup(NS, [key(i) for i in range(6)]).where == [0] * 4 + [-1] * 2
        store(client, [10])
        wait_for(lambda: tier_stats(client, "shared-fs").counts.writebacks == 5)
        assert (scratch / "fs" / NS / "manifest.json").exists()


def test_corrupt_file_is_never_loaded(
    make_config: Callable[..., AgentConfig], agent_factory: StartAgent, scratch: Path
) -> None:
    config = make_config({"tiers": [fs_tier(scratch / "fs")]})
    first = agent_factory(config)
    with AgentClient(config.endpoint) as client:
        store(client, range(3))
        wait_for(lambda: tier_stats(client, "shared-fs").counts.writebacks == 3)
    first.kill()
    config.pool_path.unlink()
    path = fs_file(scratch / "fs", 1)
    raw = bytearray(path.read_bytes())
    raw[-10] ^= 0x40
    path.write_bytes(bytes(raw))
    agent_factory(config)
    with AgentClient(config.endpoint) as client:
        assert load_exact(client, [0, 1, 2]) == [True, False, True]
        assert tier_stats(client, "shared-fs").counts.corrupt == 1
        assert client.lookup(NS, [key(1)]).where == [-1]
