"""Names, labels and groups of everything kvtier creates for one KVCacheTier: what the
operator, its webhook and the CSI plugin agree on without talking to each other."""

from __future__ import annotations

import hashlib

GROUP = "kvtier.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
MANAGED_BY = "kvtier-operator"


def agent_name(tier: str) -> str:
    """The name of the tier's DaemonSet, ConfigMap, Service and RBAC objects."""
    return dns_name(f"kvtier-{tier}")


def curve_secret_name(tier: str, entry: str) -> str:
    """The CURVE key pair Secret the operator creates for a peer tier whose spec names none."""
    return dns_name(f"kvtier-{tier}-{entry}-curve", 253)


def instance_id(namespace: str, tier: str) -> str:
    """Unique per tier on a node: names the pool file and the socket directory, so tiers
    of the same name in two namespaces never collide."""
    return dns_name(f"{namespace}-{tier}")


def labels(tier: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "kvtier-agent",
        "app.kubernetes.io/instance": tier,
        "app.kubernetes.io/managed-by": MANAGED_BY,
        f"{GROUP}/tier": tier,
    }


def dns_name(name: str, limit: int = 63) -> str:
    """`name` within `limit` characters, a digest standing in for the cut part."""
    if len(name) <= limit:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    return f"{name[: limit - 9]}-{digest}"


# Tier groups: each tier's node-local directory, pool and socket belong to a group of its own,
# which only the tier's pods (agent and vLLM) get as a supplemental group. Derived from the
# tier's identity, so the operator, the webhook and the CSI plugin agree without a registry;
# drawn from a range above the usual system, user and OpenShift project ranges.
TIER_GID_BASE = 1 << 30
TIER_GID_SPAN = 1 << 29


def tier_dir(namespace: str, tier: str) -> str:
    """The tier's directory name on a node: namespace and tier names are DNS labels (no
    dots), so this is unique where `instance_id` (joined by a dash) could collide."""
    return f"{namespace}.{tier}"


def tier_group(namespace: str, tier: str) -> int:
    digest = hashlib.sha256(tier_dir(namespace, tier).encode()).digest()
    return TIER_GID_BASE + int.from_bytes(digest[:8], "big") % TIER_GID_SPAN
