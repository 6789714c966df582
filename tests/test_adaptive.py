"""`adaptive`: one pool holding both LRU's and ARC's order, each the very policy it stands
for, and shadows that decide which of them evicts."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.agent.host.policy.adaptive import ARC, LRU, AdaptivePolicy, _Pool
from kvtier.bench.eviction import family_trace
from kvtier.traces.replay import load_trace, replay_direct


@pytest.fixture(scope="module")
def traces(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    into = tmp_path_factory.mktemp("families")
    return {f: family_trace(f, 2, 500, into) for f in ("rag", "tenants", "agentic")}


@pytest.mark.parametrize("family", ["rag", "tenants", "agentic"])
def test_the_pool_evicts_exactly_as_lru_and_as_arc(family: str, traces: dict[str, Path]) -> None:
    trace = load_trace(traces[family], 512)
    for fraction in (0.05, 0.35):
        blocks = max(8, int(trace.unique_blocks * fraction))
        for mode, reference in ((LRU, "lru"), (ARC, "arc")):
            mine = replay_direct(trace, _Pool(blocks, mode), blocks)
            theirs = replay_direct(trace, reference, blocks)
            assert (mine.hit_rate, mine.evictions) == (theirs.hit_rate, theirs.evictions)


def always(_chunk: object) -> bool:
    return True


def test_lru_takes_the_least_recent_leaf_of_both_lists() -> None:
    pool = _Pool(3, LRU)
    pool.on_inserts(["a"])
    pool.on_inserts(["b"])
    pool.on_hits(["a"])  # a moves to T2, more recent than b in T1
    pool.on_inserts(["c"])
    assert pool.evict(always) == "b"
    assert "b" in pool.b1  # remembered as ARC would have
    pool.mode = ARC
    pool.on_inserts(["d"])
    assert pool.evict(always) == "c"  # ARC: T1 first while it is over its target


def test_the_leader_changes_only_on_a_clear_lead() -> None:
    policy = AdaptivePolicy(64)
    assert policy.describe()["leader"] == "arc"
    policy.weight, policy.disagree, policy.ahead = 10_000.0, 100.0, -15.0  # 1.5 sigma
    policy._decide()
    assert policy.leader == ARC and policy.switches == 0
    policy.ahead = -25.0  # 2.5 sigma, 0.25% of the accesses
    policy._decide()
    assert policy.leader == LRU and policy.pool.mode == LRU and policy.switches == 1
    policy._decide()  # still ahead: no flip back
    assert policy.leader == LRU and policy.switches == 1


def test_follows_the_shadows_on_a_scan_and_reports_them(traces: dict[str, Path]) -> None:
    trace = load_trace(traces["rag"], 512)
    blocks = max(8, int(trace.unique_blocks * 0.05))
    policy = AdaptivePolicy(blocks)
    result = replay_direct(trace, policy, blocks)
    arc = replay_direct(trace, "arc", blocks)
    assert result.hit_rate is not None and arc.hit_rate is not None
    state = policy.describe()
    assert state["resident"] == blocks and state["leader"] in ("lru", "arc")
    assert state["hits"]["arc"] > state["hits"]["lru"]  # ARC's lead on RAG documents
    assert result.hit_rate >= arc.hit_rate - 0.02
