"""Eviction policies on the trace suite: per family, budgets from about 1% of its working
set to all of it, the hit rate of each policy, Belady's bound, kvcache-simulator's LRU at
the same block count, and the share of the LRU-to-optimal gap each policy closes.

`python -m kvtier.bench.eviction [--requests N] [--seeds 1,2] [--families a,b] [--json F]`
prints the tables of docs/replay.md. Seed 1 is the seed policies may be tuned on; seed 2
(and any other) is traffic they have never seen, reported apart. The conversation family is
the Mooncake release's trace (`../shared/traces`, or tests/data's 3,000-request slice), the
others are `kvtier.traces.tracegen.FAMILIES`.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, cast

from kvtier.traces.replay import OPTIMAL, load_trace, replay_direct
from kvtier.traces.tracegen import FAMILIES, write

FRACTIONS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0)
POLICIES = ("lru", "arc", "adaptive", OPTIMAL)
ROOT = Path(__file__).resolve().parents[2]
CONVERSATION = [
    ROOT.parent / "shared" / "traces" / "mooncake_conversation.jsonl",
    ROOT / "tests" / "data" / "mooncake_conversation_3000.jsonl.gz",
]


def family_trace(family: str, seed: int, requests: int, into: Path) -> Path:
    """A family's trace as a Mooncake JSONL file under `into`."""
    if family == "conversation":
        source = next(p for p in CONVERSATION if p.exists())
        import gzip

        raw = source.read_bytes()
        text = gzip.decompress(raw).decode() if source.suffix == ".gz" else raw.decode()
        rows = [line + "\n" for line in text.splitlines() if line.strip()]
        # Seeds are windows of the one real hour: seed 1 its first `requests`, seed 2 the next.
        rows = rows[(seed - 1) * requests : seed * requests] or rows[:requests]
        path = into / f"conversation-{seed}.jsonl"
        path.write_text("".join(rows))
        return path
    size = requests // 3 if family == "sharegpt" else requests  # ~3.6 requests a chat
    make = cast(Any, FAMILIES[family])
    return write(into / f"{family}-{seed}.jsonl", make(seed, size))


def simulator_lru(path: Path, blocks: int) -> float | None:
    from kvcache_sim import trace as sim_trace
    from kvcache_sim.plan import build_execution_plan
    from kvcache_sim.policies import simulate_policy

    plan = build_execution_plan(sim_trace.parse_trace_file(path, block_size=512))
    result = simulate_policy(plan, "lru", blocks)
    return result.hitRate if result.measurementMode == "fixed_window" else None


def sweep(
    path: Path, policies: tuple[str, ...] = POLICIES, fractions: tuple[float, ...] = FRACTIONS
) -> dict[str, Any]:
    trace = load_trace(path, 512)
    rows = []
    replayed, began = 0, time.perf_counter()
    for fraction in fractions:
        blocks = max(8, int(trace.unique_blocks * fraction))
        row: dict[str, Any] = {"fraction": fraction, "blocks": blocks}
        for policy in policies:
            row[policy] = replay_direct(trace, policy, blocks).hit_rate
            replayed += trace.requests
        row["simulator_lru"] = simulator_lru(path, blocks)
        if row["lru"] is None:
            continue
        lru, best = row["lru"], row.get(OPTIMAL)
        for policy in policies:
            if policy not in ("lru", OPTIMAL) and best is not None and best - lru > 0.02:
                row[f"{policy}_gap_closed"] = (row[policy] - lru) / (best - lru)
        rows.append(row)
    return {
        "requests": trace.requests,
        "unique_blocks": trace.unique_blocks,
        "budgets": rows,
        "requests_per_s": replayed / max(time.perf_counter() - began, 1e-9),
    }


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def markdown(family: str, seed: int, report: dict[str, Any], new: str = "adaptive") -> str:
    lines = [
        f"**{family}**, seed {seed} ({report['requests']:,} requests, "
        f"{report['unique_blocks']:,} distinct blocks)",
        "",
        f"| blocks | lru | arc | {new} | optimal | simulator LRU | gap closed |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in report["budgets"]:
        gap = row.get(f"{new}_gap_closed")
        lines.append(
            f"| {row['blocks']:,} | {_pct(row['lru'])} | {_pct(row.get('arc'))} | "
            f"{_pct(row.get(new))} | {_pct(row.get(OPTIMAL))} | {_pct(row['simulator_lru'])} | "
            f"{'-' if gap is None else f'{100 * gap:.0f}%'} |"
        )
    closed = [r[f"{new}_gap_closed"] for r in report["budgets"] if f"{new}_gap_closed" in r]
    if closed:
        lines += [
            "",
            f"Mean gap closed (budgets with a gap above 2 points): "
            f"{100 * sum(closed) / len(closed):.0f}%.",
        ]
    return "\n".join(lines)


def run(quick: bool, requests: int = 3000, seeds: tuple[int, ...] = (1, 2)) -> dict[str, Any]:
    """`kvtier bench eviction [--quick]`: every family at both seeds (`--quick`: 600
    requests, seed 2 only), keyed `family/seed`."""
    if quick:
        requests, seeds = 600, (2,)
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            for family in ["conversation", *FAMILIES]:
                path = family_trace(family, seed, requests, Path(tmp))
                out[f"{family}/{seed}"] = sweep(path)
    return {"families": out, "requests": requests, "seeds": list(seeds)}


def render(result: dict[str, Any], console: Any) -> None:
    for name, report in result["families"].items():
        family, seed = name.split("/")
        console.print(markdown(family, int(seed), report), highlight=False)
        console.print(
            f"\n{report['requests_per_s']:,.0f} requests/s replayed (wall clock)\n",
            highlight=False,
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvtier.bench.eviction")
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--seeds", default="1,2")
    parser.add_argument("--families", default=",".join(["conversation", *FAMILIES]))
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    policies = tuple(p for p in args.policies.split(",") if p)
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in [int(s) for s in args.seeds.split(",")]:
            for family in args.families.split(","):
                path = family_trace(family, seed, args.requests, Path(tmp))
                report = sweep(path, policies)
                out[f"{family}/{seed}"] = report
                print(
                    markdown(
                        family, seed, report, policies[2] if len(policies) > 3 else policies[-1]
                    )
                )
                print(
                    f"\n{report['requests_per_s']:,.0f} requests/s replayed (wall clock)\n",
                    flush=True,
                )
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
