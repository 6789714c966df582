"""The demo's picture: cumulative hit rate by tier and occupancy, turn by turn."""

from __future__ import annotations

from pathlib import Path


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
