"""`kvtier plan`: how much host memory and secondary-tier storage a trace's traffic needs.

The trace (a file, or a node's access log from `kvtier trace`) is replayed through the host
index at capacities from a few chunks up to the trace's whole working set (every distinct
chunk, where only first uses miss), with the host tier's policy and with LRU, which is how
the filesystem and object tiers evict. Hit rates count whole-prompt tokens up to a request's
first miss over the last half of the requests, as `kvtier replay` does; a capacity the trace
never fills is as good as an unbounded one, so it gets the unbounded hit rate.

The knee is where the host curve bends (Kneedle: the point furthest above the chord from the
smallest to the largest capacity, both axes scaled to [0, 1]): below it each GiB of host
memory buys much, above it little. Recommendations:

- `--target-hit-rate T`: host memory per node up to the knee, or less where that reaches T
  already; the secondary tier as large as LRU needs to reach T (none when the host alone
  does). A target above what the trace's reuse allows at all is said to be out of reach.
- `--memory-budget B`: the host hit rate at B, and whether B is past the knee; the secondary
  tier sized for 95% of the reachable hit rate.
- neither: the knee, and the secondary tier for 95% of the reachable hit rate.

An access log sampled at rate r (whole requests, by their first chunk) stands for traffic
1/r times larger: capacities are divided by r.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.agent.units import format_bytes, parse_bytes
from kvtier.replay import Trace, TraceError, load_trace, progress_bar, replay, show

SECONDARY_POLICY = "lru"  # how the filesystem and object tiers evict
REACHABLE_SHARE = 0.95


@dataclass
class Point:
    blocks: int  # in the trace (sampled)
    capacity_bytes: int  # for the whole traffic: blocks x block bytes / sample rate
    host: float
    secondary: float


def _hit_rate(
    trace: Trace, policy: str, blocks: int, progress: Callable[[int], None] | None
) -> float:
    result = replay(trace, policy, blocks, progress=progress)
    return result.hit_tokens / result.prompt_tokens if result.prompt_tokens else 0.0


def grid(unique_blocks: int, points: int) -> list[int]:
    """Capacities in blocks, geometric from 1/4096 of the working set (at least 8) to all
    of it."""
    top = max(1, unique_blocks)
    low = min(top, max(8, top // 4096))
    if points < 2 or low == top:
        return [top]
    ratio = (top / low) ** (1 / (points - 1))
    out = sorted({max(1, round(low * ratio**i)) for i in range(points)} | {top})
    return out


def curve(
    trace: Trace,
    policy: str,
    block_bytes: int,
    sample_rate: float,
    points: int,
    progress: Callable[[int], None] | None = None,
) -> list[Point]:
    out = []
    for blocks in grid(trace.unique_blocks, points):
        host = _hit_rate(trace, policy, blocks, progress)
        secondary = (
            host
            if policy == SECONDARY_POLICY
            else _hit_rate(trace, SECONDARY_POLICY, blocks, progress)
        )
        out.append(Point(blocks, math.ceil(blocks * block_bytes / sample_rate), host, secondary))
    return out


def knee(points: Sequence[Point]) -> Point:
    """Kneedle on the host curve, capacity on a linear axis."""
    if len(points) < 3:
        return points[-1]
    x0, x1 = points[0].capacity_bytes, points[-1].capacity_bytes
    lo, hi = min(p.host for p in points), max(p.host for p in points)
    if hi <= lo or x1 <= x0:
        return points[0]

    def lift(p: Point) -> float:
        return (p.host - lo) / (hi - lo) - (p.capacity_bytes - x0) / (x1 - x0)

    return max(points, key=lift)


def capacity_for(points: Sequence[Point], rate: float, which: str) -> int | None:
    """The least capacity whose hit rate (`host` or `secondary`) reaches `rate`, between
    grid points on a log-capacity scale; None where the largest does not."""
    prev: Point | None = None
    for p in points:
        value = getattr(p, which)
        if value >= rate:
            if prev is None:
                return p.capacity_bytes
            before = getattr(prev, which)
            share = (rate - before) / (value - before) if value > before else 1.0
            lo, hi = math.log(prev.capacity_bytes), math.log(p.capacity_bytes)
            return min(p.capacity_bytes, math.ceil(math.exp(lo + share * (hi - lo))))
        prev = p
    return None


def rate_at(points: Sequence[Point], capacity: int, which: str) -> float:
    """Hit rate at `capacity`, interpolated on a log-capacity scale (flat past the ends)."""
    if capacity <= points[0].capacity_bytes:
        return float(getattr(points[0], which))
    for a, b in itertools.pairwise(points):
        if capacity <= b.capacity_bytes:
            share = math.log(capacity / a.capacity_bytes) / math.log(
                b.capacity_bytes / a.capacity_bytes
            )
            va, vb = getattr(a, which), getattr(b, which)
            return float(va + share * (vb - va))
    return float(getattr(points[-1], which))


def recommend(points: Sequence[Point], target: float | None, budget: int | None) -> dict[str, Any]:
    bend = knee(points)
    reachable = max(points[-1].host, points[-1].secondary)  # every distinct chunk held
    out: dict[str, Any] = {"knee": _point(bend), "reachable_hit_rate": reachable}
    if target is not None:
        out["target_hit_rate"] = target
        if target > reachable:
            out["reachable"] = False
            out["note"] = (
                f"the trace's reuse allows at most {100 * reachable:.1f}% "
                "(every distinct chunk cached; first uses always miss)"
            )
            host = bend.capacity_bytes
            secondary = points[-1].capacity_bytes
        else:
            out["reachable"] = True
            alone = capacity_for(points, target, "host")
            host = (
                alone if alone is not None and alone <= bend.capacity_bytes else bend.capacity_bytes
            )
            needed = capacity_for(points, target, "secondary")
            secondary = 0 if host == alone else (needed or points[-1].capacity_bytes)
    elif budget is not None:
        out["memory_budget"] = budget
        host = budget
        out["past_knee"] = budget > bend.capacity_bytes
        secondary = capacity_for(points, REACHABLE_SHARE * reachable, "secondary") or 0
    else:
        host = bend.capacity_bytes
        secondary = capacity_for(points, REACHABLE_SHARE * reachable, "secondary") or 0
    out["host_capacity_bytes"] = host
    out["host_hit_rate"] = rate_at(points, host, "host")
    out["secondary_capacity_bytes"] = secondary
    out["hit_rate_with_secondary"] = max(
        out["host_hit_rate"], rate_at(points, secondary, "secondary") if secondary else 0.0
    )
    return out


def _point(p: Point) -> dict[str, Any]:
    return {
        "blocks": p.blocks,
        "capacity_bytes": p.capacity_bytes,
        "capacity": format_bytes(p.capacity_bytes),
        "host": p.host,
        "secondary": p.secondary,
    }


def _trace_fields(path: Path) -> dict[str, Any]:
    """`chunk_bytes` and `sample_rate` from the first record (an export writes them)."""
    from kvtier.replay import read_records

    for record in read_records(path, limit=1):
        return {k: record[k] for k in ("chunk_bytes", "sample_rate") if k in record}
    return {}


def plan(
    trace: Trace,
    policy: str,
    block_bytes: int,
    sample_rate: float = 1.0,
    points: int = 12,
    target: float | None = None,
    budget: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    found = curve(trace, policy, block_bytes, sample_rate, points, progress)
    return {
        "trace": {
            "requests": trace.requests,
            "unique_blocks": trace.unique_blocks,
            "block_size": trace.block_size,
            "block_bytes": block_bytes,
            "sample_rate": sample_rate,
        },
        "policy": policy,
        "secondary_policy": SECONDARY_POLICY,
        "curve": [_point(p) for p in found],
        **recommend(found, target, budget),
    }


def render(report: dict[str, Any]) -> Any:
    from rich.table import Table

    t = report["trace"]
    table = Table(
        title=f"{t['requests']:,} requests, {t['unique_blocks']:,} distinct chunks of "
        f"{format_bytes(t['block_bytes'])}; hit prompt tokens up to the first miss"
    )
    table.add_column("capacity", justify="right")
    table.add_column("chunks", justify="right")
    table.add_column(f"host ({report['policy']})", justify="right")
    table.add_column(f"secondary ({report['secondary_policy']})", justify="right")
    table.add_column("")
    for p in report["curve"]:
        mark = "knee" if p["blocks"] == report["knee"]["blocks"] else ""
        table.add_row(
            p["capacity"],
            f"{p['blocks']:,}",
            f"{100 * p['host']:.1f}%",
            f"{100 * p['secondary']:.1f}%",
            mark,
        )
    return table


def summary(report: dict[str, Any]) -> list[str]:
    lines = []
    if "note" in report:
        lines.append(f"target out of reach: {report['note']}")
    host, secondary = report["host_capacity_bytes"], report["secondary_capacity_bytes"]
    knee_at = report["knee"]["capacity"]
    lines.append(
        f"host capacity per node: {format_bytes(host)} "
        f"({100 * report['host_hit_rate']:.1f}% hit rate; knee at {knee_at})"
    )
    if report.get("past_knee"):
        lines.append(f"  the budget is past the knee: host memory beyond {knee_at} buys little")
    if secondary:
        lines.append(
            f"secondary tier: {format_bytes(secondary)} "
            f"({100 * report['hit_rate_with_secondary']:.1f}% with the host tier)"
        )
    else:
        lines.append("secondary tier: not needed for this target")
    return lines


def main(args: Any) -> int:
    """Entry point of `kvtier plan` (flags parsed in kvtier.cli)."""
    from rich.console import Console

    from kvtier.agent.policy import POLICIES

    err = Console(stderr=True)
    if args.policy not in POLICIES:
        err.print(f"unknown policy {args.policy}; use {', '.join(POLICIES)}")
        return 2
    try:
        trace = load_trace(args.trace, args.block_size, args.limit)
        fields = _trace_fields(args.trace)
        if args.block_bytes:
            block_bytes = parse_bytes(args.block_bytes)
        elif args.bytes_per_token:
            block_bytes = parse_bytes(args.bytes_per_token) * trace.block_size
        elif "chunk_bytes" in fields:
            block_bytes = int(fields["chunk_bytes"])
        else:
            raise ValueError(
                "give --block-bytes or --bytes-per-token (the trace names no chunk_bytes)"
            )
        rate = (
            args.sample_rate
            if args.sample_rate is not None
            else float(fields.get("sample_rate", 1.0))
        )
        if not 0 < rate <= 1:
            raise ValueError(f"sample rate {rate} is not in (0, 1]")
        if args.target_hit_rate is not None and not 0 < args.target_hit_rate <= 1:
            raise ValueError("--target-hit-rate is a fraction, e.g. 0.3")
        budget = parse_bytes(args.memory_budget) if args.memory_budget else None
    except (OSError, ValueError, TraceError) as exc:
        err.print(str(exc))
        return 2
    sizes = grid(trace.unique_blocks, args.points)
    passes = len(sizes) * (1 if args.policy == SECONDARY_POLICY else 2)
    with progress_bar("plan", err, quiet=args.json) as bar:
        task = bar.add_task("plan", total=trace.requests * passes)
        report = plan(
            trace,
            args.policy,
            block_bytes,
            rate,
            args.points,
            args.target_hit_rate,
            budget,
            progress=lambda n: bar.advance(task, n),
        )
    if args.plot is not None:
        plot_plan(report, args.plot)
    show(report, args.json, render(report), summary(report), 120)
    return 0


def plot_plan(report: dict[str, Any], path: Path) -> Path:
    """Hit rate against capacity (log scale) for the host policy and LRU, the knee and the
    recommendation marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gib = float(1 << 30)
    xs = [p["capacity_bytes"] / gib for p in report["curve"]]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    ax.plot(
        xs,
        [100 * p["host"] for p in report["curve"]],
        marker="o",
        label=f"host ({report['policy']})",
    )
    ax.plot(
        xs,
        [100 * p["secondary"] for p in report["curve"]],
        marker=".",
        linestyle="--",
        label=f"secondary tier ({report['secondary_policy']})",
    )
    knee_point = report["knee"]
    ax.axvline(knee_point["capacity_bytes"] / gib, color="grey", linestyle=":", label="knee")
    ax.axvline(
        report["host_capacity_bytes"] / gib, color="tab:green", alpha=0.5, label="host recommended"
    )
    if report["secondary_capacity_bytes"]:
        ax.axvline(
            report["secondary_capacity_bytes"] / gib,
            color="tab:purple",
            alpha=0.5,
            label="secondary recommended",
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("capacity (GiB)")
    ax.set_ylabel("hit rate (% of prompt tokens)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    t = report["trace"]
    ax.set_title(
        f"kvtier plan: {t['requests']:,} requests, {format_bytes(t['block_bytes'])} chunks"
    )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
