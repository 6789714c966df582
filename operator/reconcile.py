"""Level-based reconciliation of a KVCacheTier's children: compare what exists with what the
builders want, create what is missing, patch what drifted. Run on every change and on a
timer, so a deleted or edited child comes back whichever event was missed."""

from __future__ import annotations

import hashlib
import json
from typing import Any

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


async def ensure_children(
    client: KubeClient, tier: Manifest, settings: OperatorSettings
) -> list[str]:
    """Make the children match the resource; returns what was done, e.g. 'created DaemonSet'.
    Raises ConfigError before touching anything when the spec cannot be rendered."""
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
