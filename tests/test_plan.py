"""`kvtier plan`: the hit-rate curve of a trace, its knee, and capacity recommendations."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.cli import main
from kvtier.plan import Point, capacity_for, grid, knee, rate_at, recommend
from kvtier.tracegen import multi_turn

GI = 1 << 30


def points(rates: list[float]) -> list[Point]:
    """LRU below the host policy, both equal once every chunk fits (the last point)."""
    last = len(rates) - 1
    return [Point(2**i, 2**i * GI, r, r if i == last else r * 0.9) for i, r in enumerate(rates)]


def test_grid_spans_the_working_set() -> None:
    sizes = grid(100_000, 12)
    assert sizes[0] == 24 and sizes[-1] == 100_000 and sizes == sorted(set(sizes))
    assert grid(5, 12) == [5]


def test_knee_where_the_curve_bends() -> None:
    # steep gains up to 8 GiB, then little (capacity on a linear axis)
    curve = points([0.02, 0.10, 0.20, 0.30, 0.32, 0.33, 0.34])
    assert knee(curve).capacity_bytes == 8 * GI


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
    high = recommend(curve, 0.33, None)  # past the knee: host to the knee, the rest on disk
    assert high["host_capacity_bytes"] == 8 * GI
    assert high["secondary_capacity_bytes"] > 8 * GI
    assert high["hit_rate_with_secondary"] >= 0.33 - 1e-9
    out = recommend(curve, 0.9, None)
    assert not out["reachable"] and "at most 34.0%" in out["note"]
    budget = recommend(curve, None, 16 * GI)
    assert budget["past_knee"] and budget["host_hit_rate"] == pytest.approx(0.32)


def test_cli_on_a_multi_turn_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in multi_turn(7, 400)))
    plot = tmp_path / "plan.png"
    argv = ["plan", str(path), "--bytes-per-token", "128Ki", "--points", "6", "--json"]
    assert main([*argv, "--target-hit-rate", "0.3", "--plot", str(plot)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["trace"]["block_bytes"] == 64 << 20
    rates = [p["host"] for p in report["curve"]]
    assert rates == sorted(rates) and rates[-1] > 0.3
    assert report["reachable"] and report["hit_rate_with_secondary"] >= 0.3 - 1e-6
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    assert main(["plan", str(path), "--bytes-per-token", "128Ki", "--points", "4"]) == 0
    text = capsys.readouterr().out
    assert "knee" in text and "host capacity per node" in text


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
