"""Names and labels of everything the operator creates for one KVCacheTier."""

from __future__ import annotations

import hashlib

GROUP = "kvtier.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
MANAGED_BY = "kvtier-operator"


def agent_name(tier: str) -> str:
    """The name of the tier's DaemonSet, ConfigMap, Service and RBAC objects."""
    return _dns(f"kvtier-{tier}")


def instance_id(namespace: str, tier: str) -> str:
    """Unique per tier on a node: names the pool file and the socket directory, so tiers
    of the same name in two namespaces never collide."""
    return _dns(f"{namespace}-{tier}")


def labels(tier: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "kvtier-agent",
        "app.kubernetes.io/instance": tier,
        "app.kubernetes.io/managed-by": MANAGED_BY,
        f"{GROUP}/tier": tier,
    }


def _dns(name: str, limit: int = 63) -> str:
    if len(name) <= limit:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    return f"{name[: limit - 9]}-{digest}"
