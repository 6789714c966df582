"""Pictures: the demo's cumulative hit rate by tier and occupancy, turn by turn; the replay's
hit rate against capacity."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def check_target(path: Path) -> None:
    """Refuse, before a long replay, a picture that could not be written: its directory
    missing, or a format matplotlib does not write."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'kvtier[plot]'") from None
    formats = Figure().canvas.get_supported_filetypes()
    if path.suffix and path.suffix.lower().lstrip(".") not in formats:  # none: a .png
        raise ValueError(f"--plot {path}: name a file of one of {', '.join(sorted(formats))}")
    if not path.parent.is_dir():
        raise ValueError(f"--plot {path}: directory {path.parent} does not exist")


def plot_demo(timeline: list[dict[str, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    turns = [p["turn"] for p in timeline]
    looked = [max(1.0, p["looked"]) for p in timeline]
    fig, (hits, occupancy) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    hits.stackplot(
        turns,
        [p["host"] / n for p, n in zip(timeline, looked, strict=True)],
        [p["fs"] / n for p, n in zip(timeline, looked, strict=True)],
        labels=["host memory", "filesystem tier"],
        colors=["#2b7bba", "#f39c12"],
    )
    hits.set_ylabel("cumulative hit rate")
    hits.set_ylim(0, 1)
    hits.legend(loc="upper left")
    hits.set_title("kvtier demo: chunks served, by tier")
    occupancy.plot(
        turns, [p["host_used"] for p in timeline], color="#2b7bba", label="host pool used (share)"
    )
    occupancy.set_ylabel("host pool used")
    occupancy.set_ylim(0, 1.05)
    fs_axis = occupancy.twinx()
    fs_axis.plot(
        turns,
        [p["fs_used_bytes"] / 2**20 for p in timeline],
        color="#f39c12",
        label="filesystem tier (MiB)",
    )
    fs_axis.set_ylabel("filesystem tier MiB")
    occupancy.set_xlabel("turns completed (all clients)")
    lines = occupancy.get_legend_handles_labels()[0] + fs_axis.get_legend_handles_labels()[0]
    occupancy.legend(lines, [str(line.get_label()) for line in lines], loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_replay(report: dict[str, Any], path: Path) -> None:
    """Hit rate against capacity, one line per policy; the region up to the optimal bound
    shaded. Underfilled capacities are left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report["budgets"] if not r["underfilled"]]
    blocks = [r["blocks"] for r in rows]
    fig, ax = plt.subplots(figsize=(8, 5))
    for policy in report["policies"]:
        points = [(r["blocks"], r[policy]) for r in rows if r[policy] is not None]
        if not points:
            continue
        xs, ys = zip(*points, strict=True)
        if policy == "optimal":
            ax.fill_between(xs, [100 * y for y in ys], color="#cccccc", alpha=0.5)
            ax.plot(xs, [100 * y for y in ys], color="#777777", ls="--", label="optimal bound")
        else:
            ax.plot(xs, [100 * y for y in ys], marker="o", label=policy)
    ax.set_xscale("log", base=2)
    ax.set_xticks(
        blocks,
        [
            f"{r['blocks']:,} blocks"
            if r["capacity"] == str(r["blocks"])
            else f"{r['capacity']}\n{r['blocks']:,} blocks"
            for r in rows
        ],
    )
    ax.set_ylabel("hit rate (prompt tokens, up to the first miss) %")
    ax.set_xlabel("host pool capacity")
    ax.set_ylim(bottom=0)
    t = report["trace"]
    ax.set_title(f"kvtier replay: {t['requests']:,} requests, {t['block_size']}-token blocks")
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
