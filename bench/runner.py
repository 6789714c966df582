"""Runs a benchmark, writes its JSON, and prints either a table or the JSON."""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from kvtier.agent.units import format_bytes


def _machine() -> dict[str, Any]:
    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "machine": platform.machine(),
    }


def render_host(result: dict[str, Any], console: Console) -> None:
    table = Table(title="host tier vs raw memcpy, GB/s (same run)")
    columns = ("op", "row", "thr", "kvtier", "memcpy", "ratio", "memcpy+xxh3", "ratio")
    for col in columns:
        table.add_column(col, justify="right")
    for c in result["cases"]:
        hashed = "memcpy_checksum_gbps" in c and (
            f"{c['memcpy_checksum_gbps']:.2f}",
            f"{c['ratio_vs_memcpy_checksum']:.2f}",
        )
        table.add_row(
            c["op"],
            format_bytes(c["row_bytes"]),
            str(c["threads"]),
            f"{c['kvtier_gbps']:.2f}",
            f"{c['memcpy_gbps']:.2f}",
            f"{c['ratio']:.2f}",
            *(hashed or ("-", "-")),
        )
    console.print(table)
    lookups = Table(title="batched lookup round trip")
    for col in ("keys", "p50 µs", "p99 µs"):
        lookups.add_column(col, justify="right")
    for row in result["lookup"].values():
        lookups.add_row(f"{row['keys']:,}", f"{row['p50_us']:.0f}", f"{row['p99_us']:.0f}")
    console.print(lookups)
    r = result
    console.print(
        "worst case over rows >= 1 MiB, 1 thread:\n"
        f"  store ratio vs memcpy:          {r['store_ratio_vs_memcpy']:.2f}\n"
        f"  store ratio vs memcpy+checksum: {r['store_ratio_vs_memcpy_checksum']:.2f}\n"
        f"  load ratio vs memcpy:           {r['load_ratio_vs_memcpy']:.2f}\n"
        f"lookup p99, 1k keys: {r['lookup_p99_us_1k']:.0f} µs"
    )


def run_benchmark(target: str, quick: bool, as_json: bool, out: Path | None) -> int:
    if target != "host":
        raise SystemExit(f"unknown benchmark {target!r}")
    from kvtier.bench import host

    result = {**host.run(quick), "machine": _machine()}
    path = out or Path(".scratch/bench") / f"{target}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        render_host(result, Console())
        print(f"JSON written to {path}", file=sys.stderr)
    return 0
