"""`kvtier bench tiers`: the secondary tiers against raw I/O on the same bytes, same run.

Filesystem: kvtier's tier (header page, atomic publish, checksum verified on every read)
against plain one-file-per-row writes and `readv` reads, and against vLLM's native fs tier
I/O (its C batch path) when a vLLM environment is available. S3: kvtier's tier against
plain parallel boto3 `put_object`/`get_object` with the same thread count, on one server
(moto's S3 server on loopback unless an endpoint is given).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kvtier.agent.chunk import ChunkHeader, checksum
from kvtier.agent.tiers.filesystem import FilesystemTier
from kvtier.agent.tiers.objectstore import ObjectStoreTier
from kvtier.api.config import FilesystemTierConfig, ObjectStoreTierConfig
from kvtier.bench.baseline import shared_buffer
from kvtier.local.wait import port_open, wait_for
from kvtier.shm.pool import Bytes

MiB = 1 << 20


def _timed(fn: Callable[[], object], nbytes: int) -> float:
    started = time.perf_counter()
    fn()
    return nbytes / (time.perf_counter() - started) / 1e9


def _rows(buf: Bytes, row: int, rows: int) -> list[memoryview]:
    return [buf[i * row : (i + 1) * row].data for i in range(rows)]


def _headers(ns: str, views: list[memoryview]) -> list[ChunkHeader]:
    return [ChunkHeader(ns, b"%016d" % i, len(v), checksum(v)) for i, v in enumerate(views)]


def vllm_python() -> Path | None:
    """The interpreter of an environment with vLLM: $KVTIER_VLLM_PYTHON or .venv-vllm."""
    candidates = [os.environ.get("KVTIER_VLLM_PYTHON"), ".venv-vllm/bin/python"]
    for candidate in candidates:
        if candidate and Path(candidate).exists():
            return Path(candidate)
    return None


def _fs_round(
    root: Path, r: int, src_rows: list[memoryview], dst_rows: list[memoryview]
) -> dict[str, float]:
    size = sum(len(v) for v in src_rows)
    raw_dir, kv_dir = root / f"raw-{r}", root / f"kvtier-{r}"
    raw_dir.mkdir(parents=True)
    tier = FilesystemTier(
        "bench", FilesystemTierConfig(path=kv_dir, capacity=4 * size, fsync=False)
    )
    headers = _headers(f"bench-{r}", src_rows)
    paths = [raw_dir / f"{i:08x}" for i in range(len(src_rows))]

    def raw_write() -> None:
        for path, view in zip(paths, src_rows, strict=True):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.write(fd, view)
            os.close(fd)

    def raw_read(verify: bool) -> None:
        for path, view in zip(paths, dst_rows, strict=True):
            fd = os.open(path, os.O_RDONLY)
            os.readv(fd, [view])
            os.close(fd)
            if verify:  # what any reader that verifies must add: hash what it read
                checksum(view)

    def kv_write() -> None:
        for header, view in zip(headers, src_rows, strict=True):
            tier.write(header, view)

    def kv_read() -> None:
        for header, view in zip(headers, dst_rows, strict=True):
            if tier.read_into(header.namespace, header.key, view) is None:
                raise RuntimeError("kvtier filesystem tier lost a chunk")

    result = {
        "raw_w": _timed(raw_write, size),
        "kv_w": _timed(kv_write, size),
        "raw_r": _timed(lambda: raw_read(False), size),
        "raw_rv": _timed(lambda: raw_read(True), size),
        "kv_r": _timed(kv_read, size),
    }
    shutil.rmtree(raw_dir)
    shutil.rmtree(kv_dir)
    return result


def fs_cases(root: Path, row: int, rows: int, rounds: int) -> dict[str, Any]:
    src, dst = shared_buffer(row * rows), shared_buffer(row * rows)
    src_rows, dst_rows = _rows(src, row, rows), _rows(dst, row, rows)
    results: dict[str, list[float]] = {k: [] for k in ("raw_w", "raw_r", "raw_rv", "kv_w", "kv_r")}
    for r in range(rounds):
        for name, gbps in _fs_round(root, r, src_rows, dst_rows).items():
            results[name].append(gbps)
    med = {k: statistics.median(v) for k, v in results.items()}
    out: dict[str, Any] = {
        "row_bytes": row,
        "rows": rows,
        "raw_write_gbps": med["raw_w"],
        "raw_read_gbps": med["raw_r"],
        "raw_read_checksum_gbps": med["raw_rv"],
        "kvtier_write_gbps": med["kv_w"],
        "kvtier_read_gbps": med["kv_r"],
        "vllm_native_write_gbps": None,
        "vllm_native_read_gbps": None,
    }
    python = vllm_python()
    if python is not None:
        script = Path(__file__).with_name("vllm_native_fs.py")
        proc = subprocess.run(
            [
                str(python),
                str(script),
                "--dir",
                str(root / "vllm"),
                "--row",
                str(row),
                "--rows",
                str(rows),
                "--rounds",
                str(rounds),
            ],
            capture_output=True,
            text=True,
            timeout=600,
            check=True,
        )
        native = json.loads(proc.stdout.strip().splitlines()[-1])
        out["vllm_native_write_gbps"] = native["write_gbps"]
        out["vllm_native_read_gbps"] = native["read_gbps"]
    return out


@contextmanager
def s3_endpoint(endpoint: str | None) -> Iterator[str]:
    if endpoint:
        yield endpoint
        return
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(lambda: port_open(port), 30, "the S3 server")
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


def _s3_round(
    tier: ObjectStoreTier,
    pool: ThreadPoolExecutor,
    r: int,
    src_rows: list[memoryview],
    dst_rows: list[memoryview],
) -> dict[str, float]:
    s3, bucket = tier.s3, tier.bucket  # the same client settings for the raw baseline
    headers = _headers(f"bench-{r}", src_rows)
    names = [f"raw-{r}/{i:08x}" for i in range(len(src_rows))]

    def raw_put(i: int) -> None:
        s3.put_object(Bucket=bucket, Key=names[i], Body=bytes(src_rows[i]))

    def raw_get(i: int) -> None:
        body = s3.get_object(Bucket=bucket, Key=names[i])["Body"].read()
        dst_rows[i][: len(body)] = body

    def kv_put(i: int) -> None:
        tier.write(headers[i], src_rows[i])

    def kv_get(i: int) -> None:
        if tier.read_into(headers[i].namespace, headers[i].key, dst_rows[i]) is None:
            raise RuntimeError("kvtier object-store tier lost a chunk")

    def parallel(fn: Callable[[int], None]) -> Callable[[], object]:
        return lambda: list(pool.map(fn, range(len(src_rows))))

    size = sum(len(v) for v in src_rows)
    return {
        "raw_put": _timed(parallel(raw_put), size),
        "kv_put": _timed(parallel(kv_put), size),
        "raw_get": _timed(parallel(raw_get), size),
        "kv_get": _timed(parallel(kv_get), size),
    }


def s3_cases(endpoint: str, row: int, rows: int, threads: int, rounds: int) -> dict[str, Any]:
    creds = {"aws_access_key_id": "bench", "aws_secret_access_key": "bench"}
    os.environ.setdefault("AWS_ACCESS_KEY_ID", creds["aws_access_key_id"])
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", creds["aws_secret_access_key"])
    bucket = f"kvtier-bench-{uuid.uuid4().hex[:8]}"
    config = ObjectStoreTierConfig(
        endpoint=endpoint,
        bucket=bucket,
        capacity=100 * row * rows,
        max_concurrency=threads,
        timeout_seconds=30,
    )
    tier = ObjectStoreTier("bench", config)
    tier.s3.create_bucket(Bucket=bucket)
    src, dst = shared_buffer(row * rows), shared_buffer(row * rows)
    src_rows, dst_rows = _rows(src, row, rows), _rows(dst, row, rows)
    pool = ThreadPoolExecutor(threads)
    results: dict[str, list[float]] = {k: [] for k in ("raw_put", "raw_get", "kv_put", "kv_get")}
    for r in range(rounds):
        for name, gbps in _s3_round(tier, pool, r, src_rows, dst_rows).items():
            results[name].append(gbps)
    pool.shutdown()
    tier.close()
    med = {k: statistics.median(v) for k, v in results.items()}
    return {
        "row_bytes": row,
        "rows": rows,
        "threads": threads,
        "boto3_put_gbps": med["raw_put"],
        "boto3_get_gbps": med["raw_get"],
        "kvtier_put_gbps": med["kv_put"],
        "kvtier_get_gbps": med["kv_get"],
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def run(quick: bool, directory: Path | None = None, endpoint: str | None = None) -> dict[str, Any]:
    root = (directory or Path(".scratch/bench-tiers")) / uuid.uuid4().hex[:8]
    rounds = 2 if quick else 3
    try:
        fs = fs_cases(root, 2 * MiB, 64 if quick else 256, rounds)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    with s3_endpoint(endpoint) as url:
        s3 = s3_cases(url, 2 * MiB, 16 if quick else 64, threads=8, rounds=rounds)
    return {
        "benchmark": "tiers",
        "quick": quick,
        "filesystem": {**fs, "directory": str(root.parent)},
        "s3": s3,
        "fs_write_ratio_vs_raw": fs["kvtier_write_gbps"] / fs["raw_write_gbps"],
        "fs_read_ratio_vs_raw": fs["kvtier_read_gbps"] / fs["raw_read_gbps"],
        "fs_read_ratio_vs_raw_checksum": fs["kvtier_read_gbps"] / fs["raw_read_checksum_gbps"],
        "fs_write_ratio_vs_vllm_native": _ratio(
            fs["kvtier_write_gbps"], fs["vllm_native_write_gbps"]
        ),
        "fs_read_ratio_vs_vllm_native": _ratio(fs["kvtier_read_gbps"], fs["vllm_native_read_gbps"]),
        "s3_put_ratio_vs_boto3": s3["kvtier_put_gbps"] / s3["boto3_put_gbps"],
        "s3_get_ratio_vs_boto3": s3["kvtier_get_gbps"] / s3["boto3_get_gbps"],
    }
