"""An injected pod's process for tests/test_kubelet_rules.py: stores or loads numbered rows
through the agent at ENDPOINT, as the vLLM plug-in does, and prints what happened as JSON.

    kubelet_client.py store ENDPOINT COUNT ROW_BYTES
    kubelet_client.py load ENDPOINT COUNT ROW_BYTES
    kubelet_client.py replace POOL_PATH COUNT ROW_BYTES

`replace` is what a pod of the tier that means harm would try: put a file of its own with
other bytes in the first COUNT slots in the pool's place, by renaming it over the pool.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.client.connection import AgentClient

NAMESPACE = "kubelet-rules"
PAGE = 4096


def _row(i: int, nbytes: int) -> np.ndarray:
    return np.full(nbytes, i % 251, np.uint8)


def replace(pool: Path, count: int, nbytes: int) -> dict[str, Any]:
    """A file of the pool's size with its superblock and the first COUNT slots' header pages
    (their generation stamps too), the payloads left as holes that read as zeros: little
    room needed, and every chunk a client then loads from it is wrong."""
    mine = pool.with_name("tenant.pool")
    try:
        with open(pool, "rb") as src, open(mine, "wb") as dst:
            dst.truncate(os.fstat(src.fileno()).st_size)
            dst.write(src.read(PAGE))
            for slot in range(count):  # after the superblock: (header page, payload) per slot
                start = PAGE + slot * (PAGE + nbytes)
                src.seek(start)
                dst.seek(start)
                dst.write(src.read(PAGE))
        os.rename(mine, pool)
    except OSError as exc:
        return {"replaced": False, "error": exc.strerror}
    return {"replaced": True}


def main(action: str, endpoint: str, count: int, nbytes: int) -> dict[str, Any]:
    if action == "replace":
        return replace(Path(endpoint), count, nbytes)
    keys = [b"chunk-%06d" % i for i in range(count)]
    with AgentClient(endpoint, timeout=10) as client:
        if action == "store":
            stored = client.store(NAMESPACE, keys, [_row(i, nbytes) for i in range(count)])
            return {"stored": stored.stored, "skipped": stored.skipped}
        outs = [np.zeros(nbytes, np.uint8) for _ in range(count)]
        loaded = client.load_into(NAMESPACE, keys, outs)
        same = sum(
            1
            for i, (ok, out) in enumerate(zip(loaded, outs, strict=True))
            if ok and np.array_equal(out, _row(i, nbytes))
        )
        return {"loaded": sum(loaded), "identical": same}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))))
