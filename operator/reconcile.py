"""Level-based reconciliation of a KVCacheTier's children: compare what exists with what the
builders want, create what is missing, patch what drifted. Run on every change and on a
timer, so a deleted or edited child comes back whichever event was missed."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from kvtier.agent.config import ConfigError
from kvtier.operator.builders import build_children
from kvtier.operator.kube import KubeClient, KubeError
from kvtier.operator.names import GROUP
from kvtier.operator.settings import OperatorSettings

Manifest = dict[str, Any]
SPEC_HASH = f"{GROUP}/spec-hash"


def _with_hash(child: Manifest) -> Manifest:
    """Stamp a child with a digest of what it should be: drift is a differing digest, so
    fields the API server adds (defaults, status) are never mistaken for drift."""
    body = {k: v for k, v in child.items() if k != "metadata"}
    digest = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]
    meta = child["metadata"]
    return {
        **child,
        "metadata": {**meta, "annotations": {**meta.get("annotations", {}), SPEC_HASH: digest}},
    }


async def check_references(client: KubeClient, tier: Manifest) -> None:
    """What the schema cannot know: the Secrets and claims the spec names must exist.
    Raises ConfigError naming the field, before anything is changed."""
    namespace = tier["metadata"]["namespace"]
    problems = []
    for i, entry in enumerate(tier["spec"].get("tiers", [])):
        refs = []
        if "credentialsSecret" in entry.get("objectStore", {}):
            refs.append(
                (
                    "Secret",
                    "objectStore.credentialsSecret",
                    entry["objectStore"]["credentialsSecret"]["name"],
                )
            )
        if "curveKeySecret" in entry.get("peer", {}):
            refs.append(("Secret", "peer.curveKeySecret", entry["peer"]["curveKeySecret"]["name"]))
        if "pvc" in entry.get("filesystem", {}):
            refs.append(
                ("PersistentVolumeClaim", "filesystem.pvc", entry["filesystem"]["pvc"]["claimName"])
            )
        for kind, field, name in refs:
            if not await client.exists(kind, namespace, name):
                problems.append(
                    f"spec.tiers[{i}].{field}: {kind} {name!r} not found in namespace "
                    f"{namespace}; fix: create it or correct the name"
                )
    if problems:
        raise ConfigError(problems)


async def ensure_children(
    client: KubeClient, tier: Manifest, settings: OperatorSettings
) -> list[str]:
    """Make the children match the resource; returns what was done, e.g. 'created DaemonSet'.
    Raises ConfigError before touching anything when the spec cannot be rendered."""
    await check_references(client, tier)
    actions = []
    for child in (_with_hash(c) for c in build_children(tier, settings)):
        current = await client.get(child)
        if current is None:
            try:
                await client.create(child)
            except KubeError as exc:
                if exc.status != 409:  # 409: created meanwhile by a concurrent pass
                    raise
            actions.append(f"created {child['kind']}")
            continue
        have = (current.get("metadata", {}).get("annotations") or {}).get(SPEC_HASH)
        if have != child["metadata"]["annotations"][SPEC_HASH]:
            await client.merge_patch(
                child, {k: v for k, v in child.items() if k not in {"apiVersion", "kind"}}
            )
            actions.append(f"updated {child['kind']}")
    return actions
