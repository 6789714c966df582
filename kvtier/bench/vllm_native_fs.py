"""vLLM's native filesystem tier I/O (`vllm.v1.kv_offload.tiering.fs.io`), timed on the same
rows and directory kind as kvtier's filesystem tier. Runs under the vLLM environment's
Python (kvtier's own environment has no vLLM) and prints its figures as JSON."""

from __future__ import annotations

import argparse
import json
import mmap
import shutil
import statistics
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--row", type=int, required=True)
    parser.add_argument("--rows", type=int, required=True)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    from vllm.v1.kv_offload.tiering.fs.io import batch_load_block, batch_store_block

    size = args.row * args.rows
    flags = mmap.MAP_SHARED | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE
    src, dst = mmap.mmap(-1, size, flags=flags), mmap.mmap(-1, size, flags=flags)
    src.write(bytes(range(256)) * (size // 256))
    offsets = [i * args.row for i in range(args.rows)]
    writes, reads = [], []
    for r in range(args.rounds):
        root = args.dir / f"round-{r}"
        paths = [str(root / f"{i:03x}" / f"{i:08x}.bin") for i in range(args.rows)]
        t = time.perf_counter()
        batch_store_block(paths, memoryview(src), offsets, args.row, use_o_direct=False)
        writes.append(size / (time.perf_counter() - t) / 1e9)
        t = time.perf_counter()
        batch_load_block(paths, memoryview(dst), offsets, args.row, use_o_direct=False)
        reads.append(size / (time.perf_counter() - t) / 1e9)
        if dst[:4096] != src[:4096]:
            raise SystemExit("vLLM native fs read back different bytes")
        shutil.rmtree(root)
    print(
        json.dumps({"write_gbps": statistics.median(writes), "read_gbps": statistics.median(reads)})
    )


if __name__ == "__main__":
    main()
