"""`kvtier bench ttft`'s plumbing without an engine: the summary of synthetic samples (p50/p90
and the speedup over the recompute measured in the same run), the table and JSON it makes,
and the checks that fail a run whose KV did not come from the tier a row names."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvtier.bench import ttft
from kvtier.bench.runner import BENCHMARKS
from kvtier.cli.main import build_parser

BLOCK = 32


def sample(ttft_s: float, way: str, length: int, **counts: Any) -> dict[str, Any]:
    loads = way != ttft.RECOMPUTE
    secondary = length * 1024 if way not in (ttft.RECOMPUTE, ttft.VLLM_CPU) else None
    kvtier = length * 1024 if way in (ttft.KVTIER, ttft.KVTIER_SECOND) else None
    return {
        "ttft_s": ttft_s,
        "local_hit_tokens": 0,
        "external_hit_tokens": length if loads else 0,
        "secondary_read_bytes": secondary,
        "kvtier_load_bytes": kvtier,
        **counts,
    }


# Seconds per way at each length: recompute grows with the prompt, loads much less.
TTFTS = {
    ttft.RECOMPUTE: {1024: [1.0, 1.2, 1.1], 4096: [4.0, 4.4, 4.2]},
    ttft.VLLM_CPU: {1024: [0.5, 0.5, 0.5], 4096: [1.0, 1.0, 1.0]},
    ttft.VLLM_FS: {1024: [0.55, 0.5, 0.6], 4096: [1.4, 1.4, 1.4]},
    ttft.KVTIER: {1024: [0.25, 0.25, 0.25], 4096: [0.7, 0.7, 0.7]},
    ttft.KVTIER_SECOND: {1024: [0.5, 0.5, 0.5], 4096: [2.0, 2.0, 2.0]},
}


def samples() -> dict[str, dict[int, list[dict[str, Any]]]]:
    return {
        way: {n: [sample(t, way, n) for t in ts] for n, ts in by.items()}
        for way, by in TTFTS.items()
    }


def test_speedups_are_against_the_recompute_of_the_same_run() -> None:
    summary = ttft.summarize(samples(), BLOCK)
    assert summary["lengths"] == [1024, 4096]
    rows = {(r["tokens"], r["way"]): r for r in summary["rows"]}
    assert len(rows) == 2 * len(ttft.WAYS)
    assert rows[1024, ttft.RECOMPUTE]["ttft_p50_s"] == pytest.approx(1.1)
    assert rows[1024, ttft.RECOMPUTE]["ttft_p90_s"] == pytest.approx(1.18)
    assert rows[1024, ttft.RECOMPUTE]["speedup_vs_recompute"] == pytest.approx(1.0)
    assert rows[1024, ttft.KVTIER]["speedup_vs_recompute"] == pytest.approx(1.1 / 0.25)
    assert rows[4096, ttft.VLLM_FS]["speedup_vs_recompute"] == pytest.approx(4.2 / 1.4)
    kvtier = rows[4096, ttft.KVTIER]
    assert kvtier["speedup_vs_vllm_cpu"] == pytest.approx(1.0 / 0.7)
    assert kvtier["speedup_vs_vllm_fs"] == pytest.approx(1.4 / 0.7)
    assert rows[4096, ttft.KVTIER_SECOND]["speedup_vs_vllm_cpu"] == pytest.approx(0.5)
    assert "speedup_vs_vllm_cpu" not in rows[4096, ttft.VLLM_CPU]
    assert rows[4096, ttft.VLLM_CPU]["loaded_tokens_min"] == 4096


def test_table_and_json_carry_every_way_at_every_length() -> None:
    prof = ttft.profile(quick=True, gpu=False)
    result = {
        "profile": ttft.profile_json(prof),
        "device": "cpu (2 cores)",
        "vllm_version": "0.0",
        **ttft.summarize(samples(), BLOCK),
    }
    assert json.loads(json.dumps(result))["rows"] == result["rows"]
    header, body = ttft.table_rows(result)
    assert len(body) == 2 * len(ttft.WAYS) and all(len(r) == len(header) for r in body)
    assert [r[1] for r in body[:5]] == [ttft.LABELS[w] for w in ttft.WAYS]
    assert body[3][4] == "4.40x"  # kvtier at 1k: 1.1 s recomputed, 0.25 s loaded
    text = ttft.plain_table(result)
    assert len(text.splitlines()) == 1 + len(body) + 1
    assert prof.shape.name in text


@pytest.mark.parametrize(
    ("way", "counts", "message"),
    [
        (ttft.VLLM_CPU, {"local_hit_tokens": 4096}, "own prefix cache"),
        (ttft.KVTIER, {"local_hit_tokens": 32}, "own prefix cache"),
        (ttft.RECOMPUTE, {"external_hit_tokens": 1024}, "loaded while recomputing"),
        (ttft.VLLM_FS, {"external_hit_tokens": 0}, "only 0 of 4096"),
        (ttft.KVTIER_SECOND, {"external_hit_tokens": 2048}, "only 2048 of 4096"),
        (ttft.VLLM_CPU, {"secondary_read_bytes": 1 << 20}, "from a secondary tier"),
        (ttft.VLLM_FS, {"secondary_read_bytes": 0}, "not read from the fs tier"),
        (ttft.VLLM_FS, {"kvtier_load_bytes": 1 << 20}, "not read from the fs tier"),
        (ttft.KVTIER, {"kvtier_load_bytes": 0}, "nothing loaded from kvtier"),
    ],
)
def test_a_row_whose_kv_came_from_elsewhere_fails_the_run(
    way: str, counts: dict[str, int], message: str
) -> None:
    taken = samples()
    taken[way][4096][1] = sample(0.1, way, 4096, **counts)
    with pytest.raises(RuntimeError, match=message):
        ttft.summarize(taken, BLOCK)


def test_a_missing_way_fails_the_run() -> None:
    taken = samples()
    del taken[ttft.KVTIER_SECOND]
    with pytest.raises(RuntimeError, match="no samples"):
        ttft.summarize(taken, BLOCK)
    taken = samples()
    del taken[ttft.VLLM_FS][4096]
    with pytest.raises(RuntimeError, match="no samples at 4096"):
        ttft.summarize(taken, BLOCK)


def test_profiles() -> None:
    quick, full = ttft.profile(quick=True, gpu=False), ttft.profile(quick=False, gpu=False)
    gpu = ttft.profile(quick=False, gpu=True)
    assert len(quick.lengths) < len(full.lengths) and full.lengths == ttft.LENGTHS
    assert quick.shape.hidden < full.shape.hidden < gpu.shape.hidden
    assert gpu.shape == ttft.LLAMA_1B and gpu.lengths == ttft.LENGTHS
    # 16 layers x 8 KV heads x 64 x (K, V) x 2 bytes
    assert ttft.LLAMA_1B.kv_bytes_per_token == 32 * 1024
    assert ttft.percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert ttft.percentile([1.0, 2.0], 0.9) == pytest.approx(1.9)


def test_registered_as_a_bench_target() -> None:
    assert BENCHMARKS["ttft"][0] == "kvtier.bench.ttft"
    args = build_parser().parse_args(["bench", "ttft", "--quick"])
    assert args.target == "ttft" and args.quick
