"""`kvtier bench ttft`: time to first token of one real vLLM engine serving the same long
prompts each way it can get their KV, in one run: recompute; vLLM's own CPU tier
(`cpu_bytes_to_use`) after the engine's prefix cache is reset; vLLM's native fs tier after
its CPU tier is reset too; kvtier's host tier (the config the webhook injects) after the
same resets; and kvtier in a second engine that never computed the prompts (node sharing).

The engines run under the vLLM environment's Python (`kvtier.bench.vllm_ttft`); this module
starts that run and holds what both sides share: the profiles, the per-request checks that
a row's KV came from the tier it names, and the summary (p50/p90 per length and the speedup
over recompute measured in the same run). It imports neither vLLM nor kvtier's agent, so the
GPU script (`e2e/gpu/ttft_check.py`) prints the same table.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict, dataclass
from typing import Any

# The ways a prompt's KV reaches the engine, in the table's order.
RECOMPUTE = "recompute"
VLLM_CPU = "vllm_cpu"
VLLM_FS = "vllm_fs"
KVTIER = "kvtier"
KVTIER_SECOND = "kvtier_second_engine"
WAYS = (RECOMPUTE, VLLM_CPU, VLLM_FS, KVTIER, KVTIER_SECOND)
LABELS = {
    RECOMPUTE: "recompute",
    VLLM_CPU: "vLLM CPU tier",
    VLLM_FS: "vLLM fs tier",
    KVTIER: "kvtier",
    KVTIER_SECOND: "kvtier, engine 2",
}
LOADS = WAYS[1:]
# Counters read from the engine (vLLM's Prometheus metrics, summed over labels).
LOCAL_HITS = "vllm:prefix_cache_hits"
EXTERNAL_HITS = "vllm:external_prefix_cache_hits"
SECONDARY_READ = "vllm:kv_offload_tiering_read_bytes"
KVTIER_LOAD = "vllm:kvtier_load_bytes"


@dataclass(frozen=True)
class Shape:
    """A Llama model built locally with random weights (`kvtier.local.engines.tiny_model`)."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    dtype: str

    @property
    def kv_bytes_per_token(self) -> int:
        head = self.hidden // self.heads
        return 2 * self.layers * self.kv_heads * head * (4 if self.dtype == "float32" else 2)


@dataclass(frozen=True)
class Profile:
    shape: Shape
    lengths: tuple[int, ...]
    reps: int
    block_size: int = 32


# A Llama shape of 1.2B parameters with Llama 3.2 1B's layout (a small vocabulary: the
# tokens are random ids). On this project's 2-core CPU machines an 8k prefill of it takes
# minutes, so the CPU runs use smaller shapes of the same layout.
LLAMA_1B = Shape("llama-1b", 2048, 16, 32, 8, 8192, "bfloat16")
CPU_FULL = Shape("llama-25m", 512, 8, 8, 2, 1536, "float32")
CPU_QUICK = Shape("llama-3m", 256, 4, 4, 2, 768, "float32")
LENGTHS = (1024, 4096, 8192, 16384)


def profile(quick: bool, gpu: bool) -> Profile:
    if gpu:
        return Profile(LLAMA_1B, (1024, 8192) if quick else LENGTHS, 3 if quick else 5)
    if quick:
        return Profile(CPU_QUICK, (1024, 4096), 3)
    return Profile(CPU_FULL, LENGTHS, 3)


def profile_json(p: Profile) -> dict[str, Any]:
    return {**asdict(p), "kv_bytes_per_token": p.shape.kv_bytes_per_token}


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default)."""
    if not values:
        raise ValueError("no samples")
    ordered = sorted(values)
    rank = q * (len(ordered) - 1)
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def check_sample(way: str, sample: dict[str, Any], length: int, block: int) -> None:
    """Fails the run when a request's KV did not come from where its row says: a cache that
    was not reset (local prefix hits), a load that did not happen (too few external hits),
    or one served by another tier than the row's (the secondary tiers' read counters)."""
    where = f"{LABELS[way]}, {length} tokens"
    if sample["local_hit_tokens"]:
        raise RuntimeError(
            f"{where}: {sample['local_hit_tokens']} tokens hit the engine's own "
            "prefix cache, which should have been reset"
        )
    external = sample["external_hit_tokens"]
    if way == RECOMPUTE:
        if external:
            raise RuntimeError(f"{where}: {external} tokens loaded while recomputing")
        return
    if external < length - block:
        raise RuntimeError(f"{where}: only {external} of {length} tokens loaded")
    secondary, kvtier = sample.get("secondary_read_bytes"), sample.get("kvtier_load_bytes")
    if way == VLLM_CPU and secondary:
        raise RuntimeError(f"{where}: {secondary} bytes read from a secondary tier")
    if way == VLLM_FS and (secondary == 0 or kvtier):
        raise RuntimeError(f"{where}: not read from the fs tier (secondary {secondary} B)")
    if way in (KVTIER, KVTIER_SECOND) and kvtier == 0:
        raise RuntimeError(f"{where}: nothing loaded from kvtier")


def summarize(samples: dict[str, dict[int, list[dict[str, Any]]]], block: int) -> dict[str, Any]:
    """Per length, each way's TTFT p50/p90 and its speedup over recompute, measured in the
    same run (the ratio of p50s), and kvtier's against vLLM's own tiers. Every sample is
    checked first (`check_sample`)."""
    missing = [w for w in WAYS if w not in samples]
    if missing:
        raise RuntimeError(f"no samples for {missing}")
    lengths = sorted(samples[RECOMPUTE])
    rows: list[dict[str, Any]] = []
    for length in lengths:
        p50: dict[str, float] = {}
        for way in WAYS:
            taken = samples[way].get(length, [])
            if not taken:
                raise RuntimeError(f"{LABELS[way]}: no samples at {length} tokens")
            for s in taken:
                check_sample(way, s, length, block)
            ttfts = [s["ttft_s"] for s in taken]
            p50[way] = percentile(ttfts, 0.5)
            rows.append(
                {
                    "tokens": length,
                    "way": way,
                    "ttft_p50_s": p50[way],
                    "ttft_p90_s": percentile(ttfts, 0.9),
                    "samples": len(ttfts),
                    "loaded_tokens_min": min(s["external_hit_tokens"] for s in taken),
                }
            )
        for row in rows[-len(WAYS) :]:
            row["speedup_vs_recompute"] = p50[RECOMPUTE] / row["ttft_p50_s"]
            if row["way"] in (KVTIER, KVTIER_SECOND):
                row["speedup_vs_vllm_cpu"] = p50[VLLM_CPU] / row["ttft_p50_s"]
                row["speedup_vs_vllm_fs"] = p50[VLLM_FS] / row["ttft_p50_s"]
    return {"lengths": lengths, "rows": rows}


def table_rows(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    header = [
        "tokens",
        "KV from",
        "p50 s",
        "p90 s",
        "vs recompute",
        "vs CPU",
        "vs fs",
        "loaded",
    ]
    body = []
    for r in result["rows"]:
        body.append(
            [
                f"{r['tokens']:,}",
                LABELS[r["way"]],
                f"{r['ttft_p50_s']:.3f}",
                f"{r['ttft_p90_s']:.3f}",
                f"{r['speedup_vs_recompute']:.2f}x",
                f"{r['speedup_vs_vllm_cpu']:.2f}x" if "speedup_vs_vllm_cpu" in r else "",
                f"{r['speedup_vs_vllm_fs']:.2f}x" if "speedup_vs_vllm_fs" in r else "",
                f"{r['loaded_tokens_min']:,}",
            ]
        )
    return header, body


def caption(result: dict[str, Any]) -> str:
    p = result["profile"]
    s = p["shape"]
    return (
        f"{s['name']} ({s['layers']} layers, hidden {s['hidden']}, {s['dtype']}, random "
        f"weights) on {result['device']}, vLLM {result['vllm_version']}; {p['reps']} prompts "
        "per length, each served once per way (max_tokens=1); vs: speedup, the ratio of "
        "p50s in this run, over recompute and (kvtier's rows) over vLLM's CPU and fs tiers; "
        "loaded: the fewest tokens any request of the row loaded from a tier"
    )


def plain_table(result: dict[str, Any]) -> str:
    """The table as text, for where `rich` is not installed (the GPU script)."""
    header, body = table_rows(result)
    widths = [max(len(x) for x in col) for col in zip(header, *body, strict=True)]
    lines = [
        "  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in [header, *body]
    ]
    return "\n".join([*lines, caption(result)])


def render(result: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    table = Table(
        title="time to first token: one vLLM engine, KV from each tier (same run)",
        box=None,
        show_edge=False,
        pad_edge=False,
    )
    header, body = table_rows(result)
    for i, col in enumerate(header):
        table.add_column(col, justify="left" if i == 1 else "right", no_wrap=True)
    for i, row in enumerate(body):
        table.add_row(*row, end_section=(i + 1) % len(WAYS) == 0)
    console.print(table)
    console.print(caption(result))


def run(quick: bool) -> dict[str, Any]:
    """The engines under the vLLM environment's Python, the agent under this one (as in a
    cluster: agent and engine in their own containers). Progress goes to stderr."""
    from kvtier.bench.tiers import vllm_python

    python = vllm_python()
    if python is None:
        raise SystemExit("no vLLM environment: run `make vllm-env` or set KVTIER_VLLM_PYTHON")
    command = [str(python), "-m", "kvtier.bench.vllm_ttft", "--agent-python", sys.executable]
    proc = subprocess.run(
        command + (["--quick"] if quick else []),
        stdout=subprocess.PIPE,
        text=True,
        timeout=3600,
        check=False,
    )
    if proc.returncode != 0:
        raise SystemExit(f"TTFT benchmark failed (exit {proc.returncode}); see stderr above")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"benchmark": "ttft", "quick": quick, **result}
