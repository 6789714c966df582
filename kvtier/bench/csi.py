"""The CSI node plugin's cost: NodePublishVolume latency over its gRPC socket (as kubelet
calls it; the first publish of a tier creates its tmpfs, later ones only bind-mount it), and
the host tier's copy speed with its pool inside a published tier volume against the same
agent on a plain tmpfs, in one run, measured in back-to-back pairs. Needs root (mounts)."""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

from kvtier.bench.host import MiB, copy_cases
from kvtier.csi.messages import message
from kvtier.csi.mounts import mounts, unmount
from kvtier.csi.server import NodePlugin, serve
from kvtier.csi.volumes import Volumes

NAMESPACE, TIER = "bench", "llama"


class StaticTiers:
    """One KVCacheTier, without an API server: what is timed is the plugin's own work."""

    def __init__(self, capacity: str) -> None:
        self.tier = {"spec": {"host": {"capacity": capacity}}}

    def get(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.tier if (namespace, name) == (NAMESPACE, TIER) else None

    def names(self) -> set[tuple[str, str]]:
        return {(NAMESPACE, TIER)}


def _percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


def _timed_publish(publish: Any, i: int, target: Path) -> float:
    """Seconds one NodePublishVolume of the tier's volume at `target` takes, as kubelet
    calls it."""
    started = time.perf_counter()
    publish(
        message("NodePublishVolumeRequest")(
            volume_id=f"csi-{i}",
            target_path=str(target),
            volume_capability={"mount": {}, "access_mode": {"mode": 1}},
            volume_context={"tier": TIER, "csi.storage.k8s.io/pod.namespace": NAMESPACE},
        ),
        timeout=10,
    )
    return time.perf_counter() - started


def run(quick: bool) -> dict[str, Any]:
    if os.geteuid() != 0:
        return {"benchmark": "csi", "quick": quick, "skipped": "needs root (mount)"}
    base = Path(tempfile.mkdtemp(prefix="kv-csi-"))  # short: the agent's socket lies below
    pods = base / "p"
    pods.mkdir()
    plugin = NodePlugin("bench", Volumes(base / "state", pods), StaticTiers("2Gi"))
    server = serve(plugin, f"unix://{base}/csi.sock")
    channel = grpc.insecure_channel(f"unix://{base}/csi.sock")
    try:
        call = {
            name: channel.unary_unary(
                f"/csi.v1.Node/{name}",
                request_serializer=message(f"{name}Request").SerializeToString,
                response_deserializer=message(f"{name}Response").FromString,
            )
            for name in ("NodePublishVolume", "NodeUnpublishVolume")
        }
        targets = [pods / str(i) / "mount" for i in range(20 if quick else 100)]
        publish = [_timed_publish(call["NodePublishVolume"], i, t) for i, t in enumerate(targets)]
        unpublish = []
        speeds = _pool_speeds(targets[0] / "pool", quick)
        for target in targets:
            started = time.perf_counter()
            call["NodeUnpublishVolume"](
                message("NodeUnpublishVolumeRequest")(volume_id="x", target_path=str(target)),
                timeout=10,
            )
            unpublish.append(time.perf_counter() - started)
    finally:
        channel.close()
        server.stop(0).wait()
        for point in sorted(
            (m.point for m in mounts() if m.point.is_relative_to(base)), reverse=True
        ):
            unmount(point)
        shutil.rmtree(base, ignore_errors=True)
    later = publish[1:]
    return {
        "benchmark": "csi",
        "quick": quick,
        "first_publish_ms": publish[0] * 1e3,
        "publish_p50_ms": statistics.median(later) * 1e3,
        "publish_p99_ms": _percentile(later, 0.99) * 1e3,
        "unpublish_p50_ms": statistics.median(unpublish) * 1e3,
        "pool": speeds,
        "bind_vs_tmpfs_store": statistics.median(s["store_ratio_bind_vs_tmpfs"] for s in speeds),
        "bind_vs_tmpfs_load": statistics.median(s["load_ratio_bind_vs_tmpfs"] for s in speeds),
    }


def _pool_speeds(published: Path, quick: bool) -> list[dict[str, Any]]:
    """Per row size, store and load of the host tier with its pool on a plain tmpfs and in
    the published volume, run back to back several times; the ratio is the median of each
    pair's, so the machine's drift between pairs cancels."""
    duration, rounds, pairs = (0.25, 1, 3) if quick else (0.5, 2, 5)
    out = []
    for row in (1 * MiB, 32 * MiB) if quick else (1 * MiB, 4 * MiB, 32 * MiB):
        samples: dict[str, list[tuple[float, float]]] = {"store": [], "load": []}
        for _ in range(pairs):
            plain = {c["op"]: c for c in copy_cases(row, 1, duration, rounds)}
            bound = {c["op"]: c for c in copy_cases(row, 1, duration, rounds, directory=published)}
            for op in samples:
                samples[op].append((plain[op]["kvtier_gbps"], bound[op]["kvtier_gbps"]))
        entry: dict[str, Any] = {"row_bytes": row, "pairs": pairs}
        for op, measured in samples.items():
            entry[f"{op}_tmpfs_gbps"] = statistics.median(p for p, _ in measured)
            entry[f"{op}_bind_gbps"] = statistics.median(b for _, b in measured)
            entry[f"{op}_ratio_bind_vs_tmpfs"] = statistics.median(b / p for p, b in measured)
        out.append(entry)
    return out
