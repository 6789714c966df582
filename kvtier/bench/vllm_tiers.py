"""`kvtier bench vllm`, the part that runs under the vLLM environment's Python.

The same rows go through vLLM's own TieringOffloadingManager twice in one run: once with
kvtier as the secondary tier (agent on this machine, pool on /dev/shm), once with vLLM's
native `fs` tier on a tmpfs directory. Store = complete_store until every cascade job has
finished; load = lookups after a primary reset until every chunk is promoted and HIT.
Prints the figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.api.pool_layout import PAGE
from kvtier.bench.vllm_scheduler import Engine, chunk_row, kvtier_extra_config
from kvtier.local.agent import AgentProcess, scratch_config

MiB = 1 << 20


def measure(engine: Engine, chunks: int, rounds: int) -> dict[str, float]:
    stores, loads = [], []
    size = chunks * engine.row
    for r in range(rounds):
        ids = list(range(r * chunks, (r + 1) * chunks))
        ctx, keys = engine.begin_store(ids)
        started = time.perf_counter()
        engine.finish_store(ctx, keys)
        stores.append(size / (time.perf_counter() - started) / 1e9)
        engine.reset_primary()
        started = time.perf_counter()
        answers, _ = engine.lookup(ids)
        loads.append(size / (time.perf_counter() - started) / 1e9)
        if any(a.name != "HIT" for a in answers):
            raise RuntimeError(f"not every chunk came back: {answers}")
        sample = [ids[0], ids[-1]]
        for i, row in zip(sample, engine.read(sample), strict=True):
            if not np.array_equal(row, chunk_row(i, engine.row)):
                raise RuntimeError("a promoted row differs from the stored one")
        engine.reset_primary()
    return {"store_gbps": statistics.median(stores), "load_gbps": statistics.median(loads)}


def run(quick: bool, agent_python: str) -> dict[str, Any]:
    row, chunks, rounds = MiB, (64 if quick else 256), (2 if quick else 3)
    scratch = Path(tempfile.mkdtemp(prefix="kvtier-bench-vllm-", dir="/dev/shm"))
    try:
        agent = scratch_config(scratch, "bench-vllm", PAGE + (chunks + 8) * (row + PAGE), row)
        with AgentProcess(agent, python=agent_python):
            engine = Engine(kvtier_extra_config(agent, chunks, row), row=row, step_sleep=0.001)
            try:
                kvtier = measure(engine, chunks, rounds)
            finally:
                engine.close()
        native_extra = {
            "cpu_bytes_to_use": chunks * row,
            "secondary_tiers": [{"type": "fs", "root_dir": str(scratch / "native-fs")}],
        }
        engine = Engine(native_extra, row=row, step_sleep=0.001)
        try:
            native = measure(engine, chunks, rounds)
        finally:
            engine.close()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return {
        "row_bytes": row,
        "chunks": chunks,
        "kvtier_store_gbps": kvtier["store_gbps"],
        "kvtier_load_gbps": kvtier["load_gbps"],
        "native_fs_store_gbps": native["store_gbps"],
        "native_fs_load_gbps": native["load_gbps"],
        "store_ratio_vs_native_fs": kvtier["store_gbps"] / native["store_gbps"],
        "load_ratio_vs_native_fs": kvtier["load_gbps"] / native["load_gbps"],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--agent-python", required=True)
    args = parser.parse_args()
    print(json.dumps(run(args.quick, args.agent_python)))


if __name__ == "__main__":
    main()
