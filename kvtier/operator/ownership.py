"""Moving children written by earlier kvtier versions to server-side apply.

Earlier versions created and merge-patched children without naming a field manager, so the
API server recorded their fields as `Update`s of a manager named after the HTTP client's
User-Agent. An Apply by kvtier's field manager would then own only the fields it sends: a
field the desired object has since dropped would stay owned by that old manager and never be
removed. As Kubernetes documents for controllers moving from client-side to server-side apply
(client-go's `csaupgrade`), those `Update` entries are folded into kvtier's `Apply` entry once,
by a JSON patch of `metadata.managedFields` guarded by the object's resourceVersion.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

# The managers earlier kvtier versions wrote children as: aiohttp's User-Agent ("Python/3.x
# aiohttp/3.x") up to its first "/", which is how an API server names a manager by default.
LEGACY_MANAGERS = frozenset({"Python"})

Entry = dict[str, Any]


def union(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two FieldsV1 sets (nested maps of path elements) as one."""
    merged = dict(a)
    for key, sub in b.items():
        merged[key] = union(merged.get(key) or {}, sub) if sub else merged.get(key, {})
    return merged


def upgraded(entries: list[Entry], manager: str, api_version: str) -> list[Entry] | None:
    """`entries` with the legacy managers' Update entries folded into `manager`'s Apply entry;
    None when there is nothing to move."""
    legacy = [
        e
        for e in entries
        if e.get("operation") == "Update"
        and e.get("manager") in LEGACY_MANAGERS
        and not e.get("subresource")
    ]
    if not legacy:
        return None
    mine = next(
        (e for e in entries if e.get("manager") == manager and e.get("operation") == "Apply"),
        None,
    )
    fields: dict[str, Any] = dict((mine or {}).get("fieldsV1") or {})
    for entry in legacy:
        fields = union(fields, entry.get("fieldsV1") or {})
    kept = [e for e in entries if e is not mine and not any(e is x for x in legacy)]
    return [
        *kept,
        {
            "manager": manager,
            "operation": "Apply",
            "apiVersion": api_version,
            "time": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "fieldsType": "FieldsV1",
            "fieldsV1": fields,
        },
    ]


def upgrade_patch(current: dict[str, Any], manager: str) -> list[dict[str, Any]] | None:
    """The JSON patch that moves `current`'s legacy fields to `manager`, or None; it fails
    (and is retried on the next pass) if the object changed since it was read."""
    meta = current.get("metadata") or {}
    entries = upgraded(list(meta.get("managedFields") or []), manager, current["apiVersion"])
    if entries is None:
        return None
    return [
        {"op": "test", "path": "/metadata/resourceVersion", "value": meta["resourceVersion"]},
        {"op": "replace", "path": "/metadata/managedFields", "value": entries},
    ]
