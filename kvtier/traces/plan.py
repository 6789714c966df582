"""`kvtier plan`: how much host memory and secondary-tier storage a trace's traffic needs.

The trace (a file, or a node's access log from `kvtier trace`) is replayed at capacities
from a few chunks up to the trace's whole working set (every distinct chunk, where only
first uses miss) with the policy the host tier would run (`--policy`, by default the
config's default). Hit rates count whole-prompt tokens up to a request's first miss over
the last half of the requests, as `kvtier replay` does.

The knee is where the host curve bends (Kneedle: the point furthest above the chord from the
smallest to the largest capacity, both axes scaled to [0, 1]): below it each GiB of host
memory buys much, above it little. The host capacity:

- `--target-hit-rate T`: up to the knee, or less where that reaches T already;
- `--memory-budget B` (or `--capacity B`): B, and whether it is past the knee;
- neither: the knee.

The secondary tier is then sized by what it adds behind that host tier: the trace is
replayed once more through the host tier at that capacity with, behind it, an LRU tier
(how the filesystem and object tiers evict) at each capacity of the curve. Every chunk the
host tier stores is written through to it; a request's chunks the host tier misses are
looked up there, and its hit prefix runs on while a chunk is in either tier (those loads
touch it, as the chunks written do). The secondary recommended is the smallest reaching T,
or 95% of the reachable hit rate (every distinct chunk held) where no T is given; none
where the host tier alone gets there, and how many points it adds is said either way.

At the chosen host capacity the other policies are replayed too, and the output says when
one beats the policy the plan was made for. Progress goes to stderr whatever the output.

An access log sampled at rate r (whole requests, by their first chunk) stands for traffic
1/r times larger: capacities are divided by r. Capacities are bytes as Kubernetes reads
them: `8G` is 8 x 10^9 bytes, shown with its chunk count and in binary units.
"""

from __future__ import annotations

import itertools
import math
import sys
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.api.units import format_bytes
from kvtier.traces.plot import check_target
from kvtier.traces.replay import (
    Trace,
    TraceError,
    load_trace,
    positive_bytes,
    progress_bar,
    replay_direct,
    show,
    trace_fields,
)

SECONDARY_POLICY = "lru"  # how the filesystem and object tiers evict
REACHABLE_SHARE = 0.95
BEATS_BY = 0.001  # another policy this far ahead at the chosen size is named


def default_policy() -> str:
    """The policy a tier runs when its resource names none."""
    from kvtier.api.config import HostTierConfig

    return str(HostTierConfig.model_fields["policy"].default)


@dataclass
class Point:
    blocks: int  # in the trace (sampled)
    capacity_bytes: int  # for the whole traffic: blocks x block bytes / sample rate
    host: float  # the host tier alone at this capacity
    secondary: float  # the host tier as recommended with a secondary tier of this capacity


def _hit_rate(
    trace: Trace, policy: str, blocks: int, progress: Callable[[int], None] | None
) -> float:
    result = replay_direct(trace, policy, blocks, progress=progress)
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


class Behind:
    """Secondary tiers (LRU, one per capacity) behind a host tier being replayed: called
    with each request's nodes and the host's slots for them, before the host changes."""

    def __init__(self, trace: Trace, capacities: Sequence[int], warmup: int) -> None:
        self.trace, self.capacities, self.warmup = trace, list(capacities), warmup
        self.tiers: list[OrderedDict[int, None]] = [OrderedDict() for _ in capacities]
        self.hit_tokens = [0] * len(capacities)
        self.host_tokens = 0
        self.prompt_tokens = 0

    def __call__(self, r: int, nodes: Sequence[int], held: Sequence[int]) -> None:
        start = self.trace.starts[r]
        tokens = self.trace.tokens[start : start + len(nodes)]
        host = held.index(-1) if -1 in held else len(held)
        measured = r >= self.warmup
        if measured:
            self.prompt_tokens += sum(tokens)
            self.host_tokens += sum(tokens[:host])
        missed = [n for n, s in zip(nodes, held, strict=True) if s < 0]
        for i, tier in enumerate(self.tiers):
            reach = host
            while reach < len(nodes) and (held[reach] >= 0 or nodes[reach] in tier):
                reach += 1
            if measured:
                self.hit_tokens[i] += sum(tokens[:reach])
            cap = self.capacities[i]
            for node in missed:  # loaded from it, or computed and written through to it
                if node in tier:
                    tier.move_to_end(node)
                else:
                    tier[node] = None
                    if len(tier) > cap:
                        tier.popitem(last=False)

    def rates(self) -> list[float]:
        total = max(self.prompt_tokens, 1)
        return [h / total for h in self.hit_tokens]


def host_curve(
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
        out.append(Point(blocks, math.ceil(blocks * block_bytes / sample_rate), host, host))
    return out


def behind_host(
    trace: Trace,
    policy: str,
    host_blocks: int,
    points: list[Point],
    progress: Callable[[int], None] | None = None,
) -> None:
    """Fill each point's `secondary`: the hit rate with the host tier at `host_blocks` and
    a secondary tier of the point's capacity behind it."""
    behind = Behind(trace, [p.blocks for p in points], trace.requests // 2)
    replay_direct(trace, policy, max(1, host_blocks), progress=progress, observe=behind)
    for p, rate in zip(points, behind.rates(), strict=True):
        p.secondary = rate


KNEE_LIFT = 0.01  # how far above the chord (of the normalised curve) a bend must lie


def knee(points: Sequence[Point]) -> Point | None:
    """Kneedle on the host curve, capacity on a linear axis; None where the curve has no
    bend: no point lies above its chord (it rises as fast, or faster, with more memory)."""
    if len(points) < 3:
        return points[-1]
    x0, x1 = points[0].capacity_bytes, points[-1].capacity_bytes
    lo, hi = min(p.host for p in points), max(p.host for p in points)
    if hi <= lo or x1 <= x0:
        return points[0]  # flat: the least memory does as well as any

    def lift(p: Point) -> float:
        return (p.host - lo) / (hi - lo) - (p.capacity_bytes - x0) / (x1 - x0)

    best = max(points, key=lift)
    return best if lift(best) > KNEE_LIFT else None


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


def host_capacity(
    points: Sequence[Point], target: float | None, budget: int | None
) -> dict[str, Any]:
    """The host tier's capacity from its curve alone (the secondary tier's comes after)."""
    found = knee(points)
    bend = points[-1] if found is None else found  # no bend: every distinct chunk's room
    reachable = points[-1].host  # every distinct chunk held
    out: dict[str, Any] = {"knee": _point(bend), "reachable_hit_rate": reachable}
    if found is None:
        out["no_knee"] = True
    if target is not None:
        out["target_hit_rate"] = target
        out["reachable"] = target <= reachable
        if not out["reachable"]:
            out["note"] = (
                f"the trace's reuse allows at most {100 * reachable:.1f}% "
                "(every distinct chunk cached; first uses always miss)"
            )
        alone = capacity_for(points, target, "host")
        host = alone if alone is not None and alone <= bend.capacity_bytes else bend.capacity_bytes
    elif budget is not None:
        out["memory_budget"] = budget
        host = budget
        out["past_knee"] = budget > bend.capacity_bytes
    else:
        host = bend.capacity_bytes
    out["host_capacity_bytes"] = host
    out["host_hit_rate"] = rate_at(points, host, "host")
    return out


def secondary_capacity(points: Sequence[Point], chosen: dict[str, Any]) -> dict[str, Any]:
    """The secondary tier, from `points`' hit rates with it behind the chosen host tier."""
    host_rate = chosen["host_hit_rate"]
    goal = chosen.get("target_hit_rate")
    if goal is None or not chosen.get("reachable", True):
        goal = REACHABLE_SHARE * chosen["reachable_hit_rate"]
    if host_rate >= goal:
        secondary = 0
    else:
        secondary = capacity_for(points, goal, "secondary") or points[-1].capacity_bytes
    with_it = rate_at(points, secondary, "secondary") if secondary else host_rate
    return {
        "secondary_capacity_bytes": secondary,
        "hit_rate_with_secondary": max(host_rate, with_it),
        "secondary_adds": max(0.0, with_it - host_rate),
        "secondary_adds_at_most": max(0.0, points[-1].secondary - host_rate),
    }


def recommend(points: Sequence[Point], target: float | None, budget: int | None) -> dict[str, Any]:
    """Host and secondary capacities from `points` whose `secondary` is already measured
    behind the host capacity `host_capacity` chooses."""
    chosen = host_capacity(points, target, budget)
    return {**chosen, **secondary_capacity(points, chosen)}


def _point(p: Point) -> dict[str, Any]:
    return {
        "blocks": p.blocks,
        "capacity_bytes": p.capacity_bytes,
        "capacity": format_bytes(p.capacity_bytes),
        "host": p.host,
        "secondary": p.secondary,
    }


def host_blocks(capacity_bytes: int, block_bytes: int, sample_rate: float) -> int:
    return max(1, int(capacity_bytes * sample_rate // block_bytes))


def plan(
    trace: Trace,
    policy: str,
    block_bytes: int,
    sample_rate: float = 1.0,
    points: int = 12,
    target: float | None = None,
    budget: int | None = None,
    progress: Callable[[int], None] | None = None,
    others: Sequence[str] = (),
) -> dict[str, Any]:
    found = host_curve(trace, policy, block_bytes, sample_rate, points, progress)
    chosen = host_capacity(found, target, budget)
    blocks = host_blocks(chosen["host_capacity_bytes"], block_bytes, sample_rate)
    behind_host(trace, policy, blocks, found, progress)
    at_host = {policy: _hit_rate(trace, policy, blocks, None)}
    for other in others:
        if other != policy:
            at_host[other] = _hit_rate(trace, other, blocks, progress)
    best = max(at_host, key=lambda k: at_host[k])
    chosen["host_hit_rate"] = at_host[policy]  # replayed at the very capacity
    report = {
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
        **chosen,
        "host_blocks": blocks,
        "policies_at_host_capacity": at_host,
        **secondary_capacity(found, chosen),
    }
    if best != policy and at_host[best] - at_host[policy] > BEATS_BY:
        report["better_policy"] = best
    return report


def render(report: dict[str, Any]) -> Any:
    from rich.table import Table

    t = report["trace"]
    table = Table(
        title=f"{t['requests']:,} requests, {t['unique_blocks']:,} distinct chunks of "
        f"{format_bytes(t['block_bytes'])}; hit prompt tokens up to the first miss"
    )
    table.add_column("capacity", justify="right")
    table.add_column("chunks", justify="right")
    table.add_column(f"host alone ({report['policy']})", justify="right")
    table.add_column(
        f"secondary ({report['secondary_policy']}) behind "
        f"{format_bytes(report['host_capacity_bytes'])} of host",
        justify="right",
    )
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
    given = report.get("memory_budget_given")
    what = f"{given} = {format_bytes(host)}" if given else format_bytes(host)
    lines.append(
        f"host capacity per node: {what}, {report['host_blocks']:,} chunks "
        f"({100 * report['host_hit_rate']:.1f}% hit rate with {report['policy']}; "
        + ("no knee)" if report.get("no_knee") else f"knee at {knee_at})")
    )
    if report.get("no_knee"):
        lines.append(
            "  the curve has no knee: hit rate rises as fast with more memory up to the whole "
            f"working set ({knee_at}), so no smaller capacity is where it stops paying"
        )
    if report.get("past_knee"):
        lines.append(f"  the budget is past the knee: host memory beyond {knee_at} buys little")
    better = report.get("better_policy")
    if better:
        rates = report["policies_at_host_capacity"]
        lines.append(
            f"  at this capacity {better} beats {report['policy']}: "
            f"{100 * rates[better]:.1f}% against {100 * rates[report['policy']]:.1f}%"
        )
    if secondary:
        lines.append(
            f"secondary tier: {format_bytes(secondary)} "
            f"({100 * report['hit_rate_with_secondary']:.1f}% with the host tier, "
            f"+{100 * report['secondary_adds']:.1f} points over the host tier alone)"
        )
    else:
        lines.append(
            "secondary tier: not needed (it would add at most "
            f"{100 * report['secondary_adds_at_most']:.1f} points behind the host tier)"
        )
    return lines


def main(args: Any) -> int:
    """Entry point of `kvtier plan` (flags parsed in kvtier.cli.main)."""
    from rich.console import Console

    from kvtier.agent.host.policy import POLICIES

    err = Console(stderr=True)
    policy = args.policy or default_policy()
    if policy not in POLICIES:
        err.print(f"unknown policy {policy}; use {', '.join(POLICIES)}")
        return 2
    try:
        if args.plot is not None:
            check_target(args.plot)
        trace = load_trace(args.trace, args.block_size, args.limit)
        fields = trace_fields(args.trace)
        given = positive_bytes("--block-bytes", args.block_bytes)
        per_token = positive_bytes("--bytes-per-token", args.bytes_per_token)
        if given is not None and per_token is not None:
            raise ValueError(
                "--block-bytes and --bytes-per-token both give a chunk's size: give one"
            )
        if given is not None:
            block_bytes = given
        elif per_token is not None:
            block_bytes = per_token * trace.block_size
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
        budget = positive_bytes("--memory-budget", args.memory_budget)
        if budget is not None and host_blocks(budget, block_bytes, rate) * block_bytes > budget:
            raise ValueError(f"{args.memory_budget} holds no chunk of {format_bytes(block_bytes)}")
    except (OSError, ValueError, TraceError) as exc:
        print(exc, file=sys.stderr)  # one line, whatever the terminal's width
        return 2
    others = [p for p in POLICIES if p != policy]
    passes = len(grid(trace.unique_blocks, args.points)) + 1 + len(others)
    with progress_bar("plan", err) as bar:
        task = bar.add_task("plan", total=trace.requests * passes)
        report = plan(
            trace,
            policy,
            block_bytes,
            rate,
            args.points,
            args.target_hit_rate,
            budget,
            progress=lambda n: bar.advance(task, n),
            others=others,
        )
    if budget is not None and not args.memory_budget.rstrip("B").endswith("i"):
        report["memory_budget_given"] = args.memory_budget
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
        label=f"with a secondary tier ({report['secondary_policy']}) behind the host",
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
