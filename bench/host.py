"""`kvtier bench host`: the client<->agent path against raw memcpy between two mappings.

Store = allocate round trip + copy into pool slots + commit round trip (checksums are
computed by the agent's sealer, concurrently). Load = begin-load round trip + copy out +
end-load round trip. The baseline copies the same rows between two populated mappings with
the same number of threads, and is measured in alternation with kvtier so both see the same
machine state.
"""

from __future__ import annotations

import itertools
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
from rich.progress import Progress

from kvtier.agent.client import AgentClient
from kvtier.agent.config import AgentConfig, scratch_config
from kvtier.agent.pool import PAGE, Bytes
from kvtier.agent.process import AgentProcess
from kvtier.bench.baseline import memcpy_rows, run_threads, shared_buffer, tmpfs_buffer

NS = "bench"
BATCH_BYTES = 64 << 20  # rows per call: an 8k-token prompt of 256-token chunks at 2 MiB
KiB, MiB = 1 << 10, 1 << 20


@contextmanager
def bench_agent(
    chunk_bytes: int, slots: int, directory: Path | None = None
) -> Iterator[AgentConfig]:
    """An agent whose pool and socket live in `directory` (a tmpfs; /dev/shm by default)."""
    scratch = Path(tempfile.mkdtemp(prefix="kvtier-bench-", dir=directory or "/dev/shm"))
    try:
        config = scratch_config(scratch, "bench", PAGE + slots * (chunk_bytes + PAGE), chunk_bytes)
        with AgentProcess(config):
            yield config
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _store_worker(
    client: AgentClient, src: Bytes, row: int, rows: int, ids: Iterator[int]
) -> Callable[[], int]:
    views = [src[r * row : (r + 1) * row] for r in range(rows)]

    def work() -> int:
        keys = [b"k%012d" % next(ids) for _ in range(rows)]
        return client.store(NS, keys, views).stored * row

    return work


def _load_worker(
    client: AgentClient, dst: Bytes, row: int, rows: int, first: int
) -> Callable[[], int]:
    views = [dst[r * row : (r + 1) * row] for r in range(rows)]
    keys = [b"k%012d" % (first + r) for r in range(rows)]
    client.store(NS, keys, views)

    def work() -> int:
        return sum(client.load_into(NS, keys, views)) * row

    return work


def copy_cases(
    row: int, threads: int, duration: float, rounds: int, directory: Path | None = None
) -> list[dict[str, Any]]:
    rows = max(1, BATCH_BYTES // row)
    srcs = [shared_buffer(rows * row) for _ in range(threads)]
    # The store baseline walks as many rows as the pool has slots per thread.
    pool_like = [tmpfs_buffer(3 * rows * row) for _ in range(threads)]
    results = []
    with bench_agent(row, slots=threads * rows * 3, directory=directory) as config:
        clients = [AgentClient(config.endpoint, timeout=30).connect() for _ in range(threads)]
        ids = itertools.count()
        pairs = list(zip(clients, srcs, pool_like, strict=True))
        for op in ("store", "load"):
            # Load workers store their rows when built, after the store phase's evictions.
            kv_workers = [
                _store_worker(c, s, row, rows, ids)
                if op == "store"
                else _load_worker(c, s, row, rows, 10**9 + i * rows)
                for i, (c, s, _d) in enumerate(pairs)
            ]
            raw_workers = [
                memcpy_rows(s, d, row, rows)
                if op == "store"
                else memcpy_rows(d[: rows * row], s, row, rows)
                for _c, s, d in pairs
            ]
            hashed_workers = [memcpy_rows(s, d, row, rows, checksum=True) for _c, s, d in pairs]
            kv, raw, hashed = [], [], []
            for _ in range(rounds):
                raw.append(run_threads(raw_workers, duration).gbps)
                if op == "store":
                    hashed.append(run_threads(hashed_workers, duration).gbps)
                kv.append(run_threads(kv_workers, duration).gbps)
                wait_sealed(clients[0])
            kv_gbps, raw_gbps = statistics.median(kv), statistics.median(raw)
            case: dict[str, Any] = {
                "op": op,
                "row_bytes": row,
                "threads": threads,
                "rows_per_call": rows,
                "kvtier_gbps": kv_gbps,
                "memcpy_gbps": raw_gbps,
                "ratio": kv_gbps / raw_gbps,
            }
            if hashed:
                case["memcpy_checksum_gbps"] = statistics.median(hashed)
                case["ratio_vs_memcpy_checksum"] = kv_gbps / case["memcpy_checksum_gbps"]
            results.append(case)
        for c in clients:
            c.close()
    return results


def wait_sealed(client: AgentClient, timeout: float = 60.0) -> None:
    """Let the agent's sealer finish, so it does not compete with what is measured next."""
    deadline = time.monotonic() + timeout
    while client.stats()["pinned_slots"] and time.monotonic() < deadline:
        time.sleep(0.01)


def lookup_latency(batches: list[int], reps: dict[int, int]) -> dict[str, dict[str, float]]:
    """Round-trip latency of batched lookups, every key held by the agent."""
    biggest = max(batches)
    out: dict[str, dict[str, float]] = {}
    with bench_agent(PAGE, slots=biggest + 16) as config, AgentClient(config.endpoint) as client:
        keys = [b"%032d" % i for i in range(biggest)]
        row = np.zeros(PAGE, np.uint8)
        for start in range(0, biggest, 1024):
            batch = keys[start : start + 1024]
            client.store(NS, batch, [row] * len(batch))
        wait_sealed(client)
        for n in batches:
            samples = []
            for rep in range(reps[n]):
                offset = (rep * 7919) % (biggest - n + 1)
                t = time.perf_counter()
                result = client.lookup(NS, keys[offset : offset + n])
                samples.append(time.perf_counter() - t)
                assert result.prefix == n
            samples.sort()
            label = f"{n // 1024}k"
            out[label] = {
                "keys": n,
                "p50_us": samples[len(samples) // 2] * 1e6,
                "p99_us": samples[min(len(samples) - 1, int(len(samples) * 0.99))] * 1e6,
            }
    return out


def run(quick: bool) -> dict[str, Any]:
    sizes = (
        [256 * KiB, 1 * MiB, 32 * MiB]
        if quick
        else [256 * KiB, 1 * MiB, 4 * MiB, 16 * MiB, 32 * MiB]
    )
    thread_counts = [1, 2]
    duration, rounds = (0.25, 2) if quick else (0.6, 3)
    cases: list[dict[str, Any]] = []
    with Progress(transient=True) as progress:
        task = progress.add_task("host tier vs memcpy", total=len(sizes) * len(thread_counts) + 1)
        for row in sizes:
            for threads in thread_counts:
                cases.extend(copy_cases(row, threads, duration, rounds))
                progress.advance(task)
        lookup = lookup_latency(
            [1024, 32768], {1024: 100 if quick else 400, 32768: 10 if quick else 40}
        )
        progress.advance(task)

    def worst(op: str, field: str = "ratio") -> float:
        return min(
            float(c[field])
            for c in cases
            if c["op"] == op and c["threads"] == 1 and c["row_bytes"] >= MiB
        )

    return {
        "benchmark": "host",
        "quick": quick,
        "cases": cases,
        "lookup": lookup,
        "store_ratio_vs_memcpy": worst("store"),
        "store_ratio_vs_memcpy_checksum": worst("store", "ratio_vs_memcpy_checksum"),
        "load_ratio_vs_memcpy": worst("load"),
        "lookup_p50_us_1k": lookup["1k"]["p50_us"],
        "lookup_p99_us_1k": lookup["1k"]["p99_us"],
        "lookup_p99_us_32k": lookup["32k"]["p99_us"],
    }
