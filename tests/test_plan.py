"""`kvtier plan`: the hit-rate curve of a trace, its knee, and capacity recommendations."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.cli.main import main
from kvtier.traces.plan import (
    Behind,
    Point,
    capacity_for,
    default_policy,
    grid,
    knee,
    rate_at,
    recommend,
)
from kvtier.traces.replay import load_trace, replay_direct
from kvtier.traces.tracegen import multi_turn, scan, write

GI = 1 << 30


def points(rates: list[float], behind: list[float] | None = None) -> list[Point]:
    """The host curve, and the hit rate with a secondary tier of each capacity behind the
    recommended host (by default the host curve itself)."""
    behind = behind or rates
    pairs = enumerate(zip(rates, behind, strict=True))
    return [Point(2**i, 2**i * GI, r, b) for i, (r, b) in pairs]


def test_grid_spans_the_working_set() -> None:
    sizes = grid(100_000, 12)
    assert sizes[0] == 24 and sizes[-1] == 100_000 and sizes == sorted(set(sizes))
    assert grid(5, 12) == [5]


def test_knee_where_the_curve_bends() -> None:
    # steep gains up to 8 GiB, then little (capacity on a linear axis)
    curve = points([0.02, 0.10, 0.20, 0.30, 0.32, 0.33, 0.34])
    assert knee(curve).capacity_bytes == 8 * GI


def test_a_curve_without_a_bend_has_no_knee_and_says_so() -> None:
    """Capacities doubling, the hit rate rising faster at each (a trace whose reuse lies
    beyond the smaller pools): on a linear axis the curve lies under its chord, and
    Kneedle's furthest point above it was the first one, recommended as a knee of the least
    memory while the curve still rose."""
    curve = points([0.0, 0.0, 0.001, 0.005, 0.02, 0.05, 0.115])
    assert knee(curve) is None
    chosen = recommend(curve, None, None)
    assert chosen["no_knee"] and chosen["host_capacity_bytes"] == curve[-1].capacity_bytes
    bent = points([0.02, 0.10, 0.20, 0.30, 0.32, 0.33, 0.34])
    assert "no_knee" not in recommend(bent, None, None)


def test_capacity_for_interpolates_on_log_scale() -> None:
    curve = points([0.0, 0.1, 0.2, 0.3])
    assert capacity_for(curve, 0.1, "host") == 2 * GI
    assert 2 * GI < (capacity_for(curve, 0.15, "host") or 0) < 4 * GI
    assert capacity_for(curve, 0.5, "host") is None
    assert rate_at(curve, 2 * GI, "host") == pytest.approx(0.1)
    assert rate_at(curve, 1 << 50, "host") == pytest.approx(0.3)


def test_recommendations() -> None:
    curve = points([0.02, 0.10, 0.20, 0.30, 0.32, 0.33, 0.34])
    low = recommend(curve, 0.15, None)  # the host reaches it before the knee
    assert low["reachable"] and low["secondary_capacity_bytes"] == 0
    assert 2 * GI < low["host_capacity_bytes"] < 4 * GI
    # past the knee: host to the knee, the rest from a secondary tier behind it
    high = recommend(curve, 0.33, None)
    assert high["host_capacity_bytes"] == 8 * GI
    assert high["secondary_capacity_bytes"] > 8 * GI
    assert high["hit_rate_with_secondary"] >= 0.33 - 1e-9
    assert high["secondary_adds"] == pytest.approx(0.33 - 0.30)
    out = recommend(curve, 0.9, None)
    assert not out["reachable"] and "at most 34.0%" in out["note"]
    budget = recommend(curve, None, 16 * GI)
    assert budget["past_knee"] and budget["host_hit_rate"] == pytest.approx(0.32)


def test_a_secondary_tier_that_adds_nothing_is_not_recommended() -> None:
    """Sized by what it adds behind the host tier: where the host tier alone reaches 95% of
    what the trace allows, no secondary tier, whatever it would reach on its own."""
    curve = points([0.10, 0.30, 0.33, 0.34], behind=[0.33, 0.33, 0.335, 0.34])
    out = recommend(curve, None, 4 * GI)
    assert out["host_hit_rate"] == pytest.approx(0.33)
    assert out["secondary_capacity_bytes"] == 0
    assert out["secondary_adds_at_most"] == pytest.approx(0.01)


def test_behind_the_host_tier(tmp_path: Path) -> None:
    """A secondary tier behind the host tier: of no size it adds nothing, as large as the
    working set it holds every chunk the host tier wrote (only first uses miss), and its
    hits are chunks the host tier evicted."""
    trace = load_trace(write(tmp_path / "chats.jsonl", multi_turn(3, 150)), 512)
    top = trace.unique_blocks
    behind = Behind(trace, [0, 20, top], trace.requests // 2)
    host = replay_direct(trace, "lru", 10, observe=behind)
    none, some, every = behind.rates()
    assert none == pytest.approx(host.hit_tokens / host.prompt_tokens)
    assert none < some < every
    alone = replay_direct(trace, "lru", top)
    assert every == pytest.approx(alone.hit_tokens / alone.prompt_tokens)


def test_cli_on_a_multi_turn_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in multi_turn(7, 400)))
    plot = tmp_path / "plan.png"
    argv = ["plan", str(path), "--bytes-per-token", "128Ki", "--points", "6", "--json"]
    assert main([*argv, "--target-hit-rate", "0.3", "--plot", str(plot)]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert report["policy"] == default_policy()  # what a tier runs unless told otherwise
    assert report["trace"]["block_bytes"] == 64 << 20
    rates = [p["host"] for p in report["curve"]]
    assert rates == sorted(rates) and rates[-1] > 0.3
    assert report["reachable"] and report["hit_rate_with_secondary"] >= 0.3 - 1e-6
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "plan: " in captured.err and "requests replayed" in captured.err  # progress

    assert main(["plan", str(path), "--bytes-per-token", "128Ki", "--points", "4"]) == 0
    text = capsys.readouterr().out
    assert "knee" in text and "host capacity per node" in text


def test_cli_capacity_is_decimal_and_names_a_better_policy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--capacity 4G` is 4 x 10^9 bytes: the output shows it in GiB and in chunks; on a
    scan-heavy trace LRU at that size is beaten, and the output says by which policy."""
    path = write(tmp_path / "scan.jsonl", scan(1, 600))
    argv = ["plan", str(path), "--block-bytes", "64Mi", "--points", "4", "--policy", "lru"]
    assert main([*argv, "--capacity", "4G"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "4G = 3.7 GiB, 59 chunks" in text
    assert "at this capacity" in text and "beats lru" in text
    assert main([*argv, "--capacity", "4G", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["host_blocks"] == 4 * 10**9 // (64 << 20)
    rates = report["policies_at_host_capacity"]
    assert set(rates) == {"lru", "arc", "prefix", "adaptive"}
    assert rates[report["better_policy"]] > rates["lru"]
    assert main([*argv, "--capacity", "1M"]) == 2


def test_cli_reads_an_exports_chunk_bytes_and_sample_rate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    records = multi_turn(8, 200)
    path = tmp_path / "export.jsonl"
    path.write_text(
        "".join(
            json.dumps({**r, "chunk_bytes": 1 << 20, "sample_rate": 0.25}) + "\n" for r in records
        )
    )
    assert main(["plan", str(path), "--points", "3", "--policy", "lru", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    top = report["curve"][-1]
    assert top["capacity_bytes"] == top["blocks"] * (1 << 20) * 4  # a quarter of the traffic
    assert main(["plan", str(path), "--points", "3", "--block-size", "512", "--policy", "x"]) == 2
