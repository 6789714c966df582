"""The floor every policy stands on: LRU over the prefix tree, held to kvcache-simulator's
LRU on every trace family of the suite, and the fast replay held to the index's."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.bench.eviction import family_trace, simulator_lru
from kvtier.traces.replay import load_trace, replay, replay_direct

FAMILIES = ["conversation", "sharegpt", "rag", "agentic", "scan", "tenants"]
FRACTIONS = (0.02, 0.1, 0.35)


@pytest.fixture(scope="module")
def traces(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    into = tmp_path_factory.mktemp("families")
    return {f: family_trace(f, 2, 900, into) for f in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_lru_matches_the_simulators_lru(family: str, traces: dict[str, Path]) -> None:
    trace = load_trace(traces[family], 512)
    compared = 0
    for fraction in FRACTIONS:
        blocks = max(8, int(trace.unique_blocks * fraction))
        mine = replay_direct(trace, "lru", blocks).hit_rate
        reference = simulator_lru(traces[family], blocks)
        assert (mine is None) == (reference is None), (blocks, mine, reference)
        if mine is not None and reference is not None:
            assert abs(mine - reference) <= 0.001, (family, blocks, mine, reference)
            compared += 1
    assert compared


@pytest.mark.parametrize("policy", ["lru", "arc", "prefix", "adaptive", "optimal"])
def test_direct_replay_is_the_index_replay(policy: str, traces: dict[str, Path]) -> None:
    trace = load_trace(traces["tenants"], 512, 400)
    for blocks in (40, 300):
        through_index, direct = replay(trace, policy, blocks), replay_direct(trace, policy, blocks)
        assert (direct.hit_tokens, direct.hit_blocks, direct.evictions, direct.rejected) == (
            through_index.hit_tokens,
            through_index.hit_blocks,
            through_index.evictions,
            through_index.rejected,
        )


def test_every_policy_keeps_prefixes_whole(traces: dict[str, Path]) -> None:
    """No resident block past a missing one, under every policy: the blocks a request
    finds resident are its hit prefix (the scan family's blocks are all full, 512 tokens;
    a flat LRU on this trace keeps blocks no request can reach)."""
    trace = load_trace(traces["scan"], 512)
    assert set(trace.tokens) == {512}
    for policy in ("lru", "arc", "prefix"):
        result = replay_direct(trace, policy, max(8, trace.unique_blocks // 20))
        assert result.hit_blocks > 0
        assert result.hit_blocks == result.hit_tokens // 512, policy


def test_bench_eviction_runs_the_suite(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`kvtier bench eviction` sweeps every family (the sweep itself stubbed here: the
    suite's figures are docs/replay.md's) and prints a table per family."""
    import json

    from kvtier.bench import eviction
    from kvtier.cli.main import main

    swept: list[str] = []

    def sweep(path: Path) -> dict[str, object]:
        swept.append(path.name)
        row = {"fraction": 1.0, "blocks": 8, "lru": 0.1, "arc": 0.2, "adaptive": 0.2}
        row |= {"optimal": 0.3, "simulator_lru": 0.1, "adaptive_gap_closed": 0.5}
        return {"requests": 600, "unique_blocks": 8, "budgets": [row], "requests_per_s": 1.0}

    monkeypatch.setattr(eviction, "sweep", sweep)
    out = tmp_path / "eviction.json"
    assert main(["bench", "eviction", "--quick", "--out", str(out)]) == 0
    assert sorted(swept) == sorted(f"{f}-2.jsonl" for f in FAMILIES)
    text = capsys.readouterr().out
    assert "**tenants**, seed 2" in text and "| 8 | 10.0% | 20.0% | 20.0% | 30.0%" in text
    assert set(json.loads(out.read_text())["families"]) == {f"{f}/2" for f in FAMILIES}
