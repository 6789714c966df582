"""The example KVCacheTier the tests start from, as a user would write it."""

from __future__ import annotations

from typing import Any


def example_tier(capacity: str, *more_tiers: dict[str, Any]) -> dict[str, Any]:
    """A tier on GPU nodes with a shared filesystem and an S3 tier, then `more_tiers`."""
    return {
        "apiVersion": "kvtier.io/v1alpha1",
        "kind": "KVCacheTier",
        "metadata": {"name": "llama", "namespace": "inference", "uid": "0f1e-uid", "generation": 1},
        "spec": {
            "nodeSelector": {"nvidia.com/gpu.present": "true"},
            "tolerations": [
                {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
            ],
            "podSelector": {"matchLabels": {"app": "vllm"}},
            "host": {"capacity": capacity, "policy": "arc"},
            "tiers": [
                {
                    "name": "shared-fs",
                    "filesystem": {"pvc": {"claimName": "kv"}, "capacity": "2Ti"},
                },
                {
                    "name": "s3",
                    "objectStore": {
                        "bucket": "kv-cache",
                        "capacity": "10Ti",
                        "endpoint": "http://minio:9000",
                        "credentialsSecret": {"name": "s3-creds"},
                    },
                },
                *more_tiers,
            ],
        },
    }
