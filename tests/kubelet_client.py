"""An injected pod's process for tests/test_kubelet_rules.py: stores or loads numbered rows
through the agent at ENDPOINT, as the vLLM plug-in does, and prints what happened as JSON.

    kubelet_client.py store ENDPOINT COUNT ROW_BYTES
    kubelet_client.py load ENDPOINT COUNT ROW_BYTES
"""

from __future__ import annotations

import json
import sys

import numpy as np

from kvtier.agent.client import AgentClient

NAMESPACE = "kubelet-rules"


def _row(i: int, nbytes: int) -> np.ndarray:
    return np.full(nbytes, i % 251, np.uint8)


def main(action: str, endpoint: str, count: int, nbytes: int) -> dict[str, int]:
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
