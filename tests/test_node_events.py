"""The node's KV events: every tier's stores and removals (the pool, the filesystem and
object store), one residency per (medium, locality), a removal only for a chunk the node no
longer holds there, and the Events request that engines forward to vLLM."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier.agent.chunk import ChunkHeader, checksum
from kvtier.agent.host.events import (
    ALL_NAMESPACES,
    POOL,
    STORAGE,
    ChunkEvents,
    NodeEvents,
)
from kvtier.agent.tiers.base import CorruptChunk, blob_path, namespace_dir
from kvtier.agent.tiers.filesystem import FilesystemTier
from kvtier.agent.tiers.objectstore import ObjectStoreTier
from kvtier.api.config import AgentConfig, FilesystemTierConfig, ObjectStoreTierConfig
from kvtier.client import protocol as p
from kvtier.client.connection import AgentClient
from kvtier.local.agent import AgentProcess
from tests.agent_helpers import (
    load_exact,
    store,
    store_written,
    tier_stats,
    wait_for,
    write_backs_done,
)
from tests.conftest import ROW
from tests.helpers import NS, key, row

Held = dict[tuple[str, str], set[bytes]]  # (medium, locality) -> keys


def test_pool_events_of_every_namespace_in_order() -> None:
    log = ChunkEvents()
    log.record("a", b"1", removed=False)
    log.record("b", b"2", removed=False)
    log.record("a", b"1", removed=True)
    log.record("a", b"1", removed=False)
    batch = log.since(ALL_NAMESPACES, 1)
    assert batch.seq == 4
    assert batch.items == [("b", False, b"2"), ("a", True, b"1"), ("a", False, b"1")]
    assert log.since("a", 0).items == [("a", False, b"1"), ("a", True, b"1"), ("a", False, b"1")]


def test_tiers_of_one_residency_count_once() -> None:
    events = NodeEvents("node-a")
    events.add_tier("fs", STORAGE)
    events.add_tier("s3", STORAGE)
    events.record("fs", NS, [b"k"], False)
    events.record("fs", NS, [b"k"], False)  # reported twice: one event
    events.record("s3", NS, [b"k"], False)  # the residency already holds it
    events.record("fs", NS, [b"k"], True)  # still in s3: no removal
    events.record("fs", NS, [b"other"], True)  # never held: nothing
    assert [(e.residency, e.removed, e.key) for e in events.tail(0)[0]] == [(STORAGE, False, b"k")]
    events.record("s3", NS, [b"k"], True)
    assert [(e.residency, e.removed) for e in events.tail(1)[0]] == [(STORAGE, True)]
    events.record("host", NS, [b"k"], False)
    batch = events.since(NS, 0)
    assert [(r.medium, r.locality, r.removed, r.keys) for r in batch.runs] == [
        ("STORAGE", "LOCAL", False, [b"k"]),
        ("STORAGE", "LOCAL", True, [b"k"]),
        ("CPU", "LOCAL", False, [b"k"]),
    ]
    assert events.since("another", 0).runs == []
    assert events.snapshot()[1] == {POOL: {NS: {b"k"}}, STORAGE: {}}


def test_a_pool_log_overrun_is_resynchronised_from_what_the_pool_holds() -> None:
    pool = ChunkEvents(per_namespace=4)
    events = NodeEvents("node-a")
    held = {NS: set()}  # type: dict[str, set[bytes]]
    for i in range(3):
        pool.record(NS, key(i), removed=False)
        held[NS].add(key(i))
    events.pump(pool.since, lambda: held)
    for i in range(3, 12):  # more than the pool's log keeps; 0 and 1 leave
        pool.record(NS, key(i), removed=False)
        held[NS].add(key(i))
    for i in (0, 1):
        pool.record(NS, key(i), removed=True)
        held[NS].discard(key(i))
    events.pump(pool.since, lambda: held)
    assert events.snapshot()[1][POOL] == held


def _write(tier: Any, namespace: str, i: int) -> None:
    data = row(i, ROW)
    tier.write(ChunkHeader(namespace, key(i), ROW, checksum(data.data)), data.data)


def _recorder(tier: Any) -> Callable[[], set[tuple[str, bytes]]]:
    held: set[tuple[str, bytes]] = set()

    def holdings(namespace: str, keys: list[bytes], removed: bool) -> None:
        for k in keys:
            assert (namespace, k) in held if removed else (namespace, k) not in held
            (held.discard if removed else held.add)((namespace, k))

    tier.report_holdings(holdings)
    return lambda: set(held)


def _files(root: Path) -> set[tuple[str, bytes]]:
    return {
        (p.parts[-4], bytes.fromhex(p.name))
        for p in root.rglob("*")
        if p.is_file() and p.parts[-4] != ".quarantine" and len(p.name) > 20
        if not p.name.startswith((".tmp", "manifest"))
    }


def test_filesystem_tier_reports_writes_evictions_quarantine_and_other_agents(
    tmp_path: Path,
) -> None:
    config = FilesystemTierConfig.model_validate(
        {"path": tmp_path, "capacity": 8 * (ROW + 4096), "fsync": False}
    )
    tier, other = FilesystemTier("fs", config), FilesystemTier("fs", config)
    held = _recorder(tier)
    for i in range(4):
        _write(tier, NS, i)
    assert held() == {(NS, key(i)) for i in range(4)}
    _write(other, NS, 10)  # another node's agent on the shared volume
    _write(other, "weird/namespace", 11)  # a hashed namespace directory: its manifest names it
    tier.maintain()  # the first upkeep scans
    every = {(NS, key(i)) for i in (0, 1, 2, 3, 10)} | {("weird/namespace", key(11))}
    assert held() == every
    path = tmp_path / blob_path(NS, key(1))
    path.write_bytes(path.read_bytes()[:-1] + b"\0")  # damaged: quarantined when read
    with pytest.raises(CorruptChunk):
        tier.read_into(NS, key(1), np.zeros(ROW, np.uint8).data)
    assert held() == every - {(NS, key(1))}
    (tmp_path / blob_path(NS, key(2))).unlink()  # gone under the tier (another agent evicted it)
    for i in range(20, 30):  # past the high watermark: evicted down to the low one
        _write(tier, NS, i)
    tier._next_scan = 0.0
    tier.maintain()
    named = {NS: NS, namespace_dir("weird/namespace"): "weird/namespace"}
    assert held() == {(named[d], k) for d, k in _files(tmp_path)}
    assert (NS, key(2)) not in held() and len(held()) < 10


def test_object_store_reports_writes_evictions_corruption_and_listing(
    s3_bucket: dict[str, Any],
) -> None:
    fields = {k: v for k, v in s3_bucket.items() if k != "client"}
    config = ObjectStoreTierConfig.model_validate({**fields, "capacity": 4 * (ROW + 4096)})
    tier = ObjectStoreTier("s3", config)
    held = _recorder(tier)
    for i in range(6):  # two past capacity: the oldest go at upkeep
        _write(tier, NS, i)
    tier.maintain()
    assert held() == {(NS, key(i)) for i in range(2, 6)}
    s3 = tier.s3
    name = tier.blob_name(NS, key(3))
    body = s3.get_object(Bucket=config.bucket, Key=name)["Body"].read()
    s3.put_object(Bucket=config.bucket, Key=name, Body=body[:-1] + b"\1")
    with pytest.raises(CorruptChunk):
        tier.read_into(NS, key(3), np.zeros(ROW, np.uint8).data)
    assert held() == {(NS, key(i)) for i in (2, 4, 5)}
    s3.delete_object(Bucket=config.bucket, Key=tier.blob_name(NS, key(4)))
    assert tier.read_into(NS, key(4), np.zeros(ROW, np.uint8).data) is None
    assert held() == {(NS, key(i)) for i in (2, 5)}
    restarted = ObjectStoreTier("s3", config)  # lists what the bucket holds at its start
    again = _recorder(restarted)
    restarted.maintain()
    assert again() == {(NS, key(i)) for i in (2, 5)}


def _apply(held: Held, reply: p.EventsReply) -> None:
    for run in reply.runs:
        keys = held.setdefault((run.medium, run.locality), set())
        for k in run.keys:
            assert (k in keys) == run.removed, "a removal of what is not held, or a re-store"
            (keys.discard if run.removed else keys.add)(k)


def test_engines_read_every_tiers_events_through_the_agent(
    make_config: Callable[..., AgentConfig],
    agent_factory: Callable[[AgentConfig], AgentProcess],
    scratch: Path,
) -> None:
    fs_root = scratch / "fs"
    config = make_config(
        {
            "tiers": [
                {
                    "name": "fs",
                    "filesystem": {
                        "path": str(fs_root),
                        "capacity": 24 * (ROW + 4096),
                        "fsync": False,
                        "scanIntervalSeconds": 0.2,
                    },
                }
            ],
            "report": {"node": "node-a"},
        },
        capacity=16 * (ROW + 4096) + 4096,
    )
    agent_factory(config)
    held: Held = {}
    after = 0
    with AgentClient(config.endpoint) as client:

        def caught_up() -> bool:
            nonlocal after
            reply = client.events(NS, after)
            assert reply.owner == "node-a" and not reply.truncated
            after = reply.seq
            _apply(held, reply)
            where = client.lookup(NS, [key(i) for i in range(60)]).where
            pool = {key(i) for i, w in enumerate(where) if w == 0}
            disk = {k for ns, k in _files(fs_root) if ns == NS}
            return (
                held.get(("CPU", "LOCAL"), set()) == pool
                and held.get(("STORAGE", "LOCAL"), set()) == disk
            )

        store_written(client, range(10), "fs")
        wait_for(caught_up)
        written = tier_stats(client, "fs").counts.writebacks
        assert len(held[("STORAGE", "LOCAL")]) == written > 0
        store(client, range(10, 60))  # the pool evicts; the filesystem passes its watermark
        wait_for(lambda: write_backs_done(client, "fs") == 60)
        wait_for(lambda: caught_up() and len(held[("STORAGE", "LOCAL")]) < 24)
        assert 0 < len(held[("STORAGE", "LOCAL")]) < 24 and len(held[("CPU", "LOCAL")]) <= 16
        assert load_exact(client, [59]) == [True]
        gone = min(held[("STORAGE", "LOCAL")])  # one written (others may have been dropped)
        os.unlink(next(p for p in fs_root.rglob("*") if p.name == gone.hex()))
        wait_for(caught_up)  # the next scan finds it gone
        assert gone not in held[("STORAGE", "LOCAL")]


def test_a_peer_tier_reports_nothing_its_holders_report_their_pools(
    make_config: Callable[..., AgentConfig],
    agent_factory: Callable[[AgentConfig], AgentProcess],
    scratch: Path,
) -> None:
    """Peers' chunks are on the holders' events as their pools' (CPU LOCAL, their node the
    owner), never on the asker's as CPU REMOTE, whichever agent is their home in the
    directory: the asker reports a chunk only once a read brought it into its own pool."""
    from tests.peer_helpers import node_config, shared_between

    a = agent_factory(node_config(make_config, scratch, "node-a", None))
    b = agent_factory(node_config(make_config, scratch, "node-b", None))
    wait_for(lambda: len(list((scratch / "registry").glob("*.json"))) == 2)
    ids = list(range(16))  # homed on both agents: every key is on some home
    held: dict[str, Held] = {"node-a": {}, "node-b": {}}
    seen = {"node-a": 0, "node-b": 0}

    def read(agent: AgentProcess, node: str) -> Held:
        with AgentClient(agent.config.endpoint) as client:
            reply = client.events(NS, seen[node])
            assert reply.owner == node
            seen[node] = reply.seq
            _apply(held[node], reply)
        return held[node]

    with AgentClient(b.config.endpoint) as consumer:
        shared_between(a.config.endpoint, consumer, ids)
        assert read(a, "node-a") == {("CPU", "LOCAL"): {key(i) for i in ids}}
        assert read(b, "node-b") == {}  # found through peers, held by node-a
        assert load_exact(consumer, ids[:4]) == [True] * 4  # promoted into node-b's pool
        assert read(b, "node-b") == {("CPU", "LOCAL"): {key(i) for i in ids[:4]}}
