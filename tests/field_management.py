"""Field management as a Kubernetes API server does it (server-side apply), for the emulated
API server in kube_api.py, which has none of its own.

Written from Kubernetes' server-side apply documentation: every write records which manager
owns which fields (`metadata.managedFields`, `FieldsV1`); an Apply (PATCH with
`application/apply-patch+yaml`) merges the applied configuration into the object, fails on
fields another manager owns with a different value unless forced (then ownership moves), and
removes fields the same manager applied last time but no longer does, when nobody else owns
them; any other write (create, merge or strategic patch, JSON patch) is an Update that takes
ownership of the fields it changed, and never conflicts.

Gaps against a real server (listed in docs/operator.md too): which lists are associative comes from
a fixed table (a real server reads the OpenAPI schema's list types and patch merge keys);
removed fields are deleted, never reset to a schema default; an emptied parent map is dropped.
"""

from __future__ import annotations

import copy
import datetime as dt
import json
from typing import Any

Path = tuple[str, ...]
Obj = dict[str, Any]

# Lists merged item by item, by these keys (the patch merge keys of the built-in types kvtier's
# children use); any other list is atomic: replaced whole, owned as one field.
LIST_KEYS: dict[str, tuple[str, ...]] = {
    "containers": ("name",),
    "initContainers": ("name",),
    "volumes": ("name",),
    "env": ("name",),
    "volumeMounts": ("mountPath",),
    "ports": ("containerPort",),
    "imagePullSecrets": ("name",),
    "ownerReferences": ("uid",),
    "conditions": ("type",),
}
# Set by the server, never owned by a client.
SERVER_FIELDS = {
    "managedFields",
    "resourceVersion",
    "uid",
    "generation",
    "creationTimestamp",
    "deletionTimestamp",
    "selfLink",
}
MISSING = object()


class Conflict(Exception):
    """An Apply touching fields other managers own with other values (HTTP 409)."""

    def __init__(self, conflicts: list[tuple[str, Path]]) -> None:
        self.conflicts = conflicts
        lines = [f'conflict with "{m}": {render(p)}' for m, p in conflicts]
        super().__init__(f"Apply failed with {len(conflicts)} conflict(s): " + "; ".join(lines))


def render(path: Path) -> str:
    return "".join(f".{p[2:]}" if p.startswith("f:") else f"[{p[2:]}]" for p in path if p != ".")


def _item_key(field: str, item: Any) -> str | None:
    keys = LIST_KEYS.get(field)
    if keys is None or not isinstance(item, dict) or any(k not in item for k in keys):
        return None
    return "k:" + json.dumps({k: item[k] for k in keys}, separators=(",", ":"), sort_keys=True)


def _associative(field: str, value: Any) -> bool:
    return isinstance(value, list) and all(_item_key(field, i) is not None for i in value)


def fields_of(obj: Any, prefix: Path = (), top: bool = True) -> set[Path]:
    """The leaf fields an object sets, as FieldsV1 paths (status is never applied)."""
    found: set[Path] = set()
    if not isinstance(obj, dict):
        return found
    for name, value in obj.items():
        if top and name in {"apiVersion", "kind", "status"}:
            continue
        if prefix == ("f:metadata",) and name in SERVER_FIELDS | {"name", "namespace"}:
            continue
        path = (*prefix, f"f:{name}")
        if isinstance(value, dict) and value:
            found |= fields_of(value, path, False)
        elif _associative(name, value) and value:
            for item in value:
                item_path = (*path, str(_item_key(name, item)))
                found.add((*item_path, "."))
                found |= fields_of(item, item_path, False)
        else:
            found.add(path)
    return found


def to_fields_v1(paths: set[Path]) -> Obj:
    tree: Obj = {}
    for path in paths:
        node = tree
        for part in path:
            node = node.setdefault(part, {})
    return tree


def from_fields_v1(tree: Obj, prefix: Path = ()) -> set[Path]:
    found: set[Path] = set()
    for part, sub in tree.items():
        path = (*prefix, part)
        if sub:
            found |= from_fields_v1(sub, path)
        else:
            found.add(path)
    return found


def _child(node: Any, part: str) -> Any:
    if part.startswith("f:") and isinstance(node, dict):
        return node.get(part[2:], MISSING)
    if part.startswith("k:") and isinstance(node, list):
        wanted = json.loads(part[2:])
        for item in node:
            if isinstance(item, dict) and all(item.get(k) == v for k, v in wanted.items()):
                return item
    return MISSING


def value_at(obj: Any, path: Path) -> Any:
    node = obj
    for part in path:
        if part == ".":
            break
        node = _child(node, part)
        if node is MISSING:
            return MISSING
    return node


def merge(live: Any, config: Any, field: str = "", patch: bool = False, lists: bool = True) -> Any:
    """The applied configuration over the live value: maps merged key by key, associative
    lists item by item. As a patch (`patch=True`), None deletes a key; a JSON merge patch
    (`lists=False`) replaces lists whole, a strategic merge patch merges them by key."""
    if isinstance(live, dict) and isinstance(config, dict):
        result = dict(live)
        for name, value in config.items():
            if patch and value is None:
                result.pop(name, None)
            else:
                result[name] = merge(live.get(name, MISSING), value, name, patch, lists)
        return result
    if lists and _associative(field, live) and _associative(field, config):
        items = list(live)
        for item in config:
            key = _item_key(field, item)
            at = next((i for i, x in enumerate(items) if _item_key(field, x) == key), None)
            if at is None:
                items.append(copy.deepcopy(item))
            else:
                items[at] = merge(items[at], item, "", patch, lists)
        return items
    if patch and isinstance(config, dict):
        return merge({}, config, field, patch, lists)  # a new map: its None values are dropped
    return copy.deepcopy(config)


def _delete(obj: Any, path: Path) -> None:
    """Remove the field (or, for a `.` path, the list item) and parents it leaves empty."""
    if path and path[-1] == ".":
        path = path[:-1]
    parents = [obj]
    for part in path[:-1]:
        parents.append(_child(parents[-1], part))
        if parents[-1] is MISSING:
            return
    for depth in range(len(path) - 1, -1, -1):
        parent, part = parents[depth], path[depth]
        target = _child(parent, part)
        if target is MISSING:
            return
        if depth == len(path) - 1 or target in ({}, []):
            if isinstance(parent, dict):
                parent.pop(part[2:], None)
            else:
                parent.remove(target)
        else:
            return


def _is_item_key(path: Path) -> bool:
    """A key field of a list item (a container's name): it goes only with its item."""
    return len(path) >= 2 and path[-2].startswith("k:") and path[-1][2:] in json.loads(path[-2][2:])


def _entries(obj: Obj) -> list[Obj]:
    return list((obj.get("metadata") or {}).get("managedFields") or [])


def _owned(entry: Obj) -> set[Path]:
    return from_fields_v1(entry.get("fieldsV1") or {})


def _entry(manager: str, operation: str, api_version: str, paths: set[Path]) -> Obj:
    return {
        "manager": manager,
        "operation": operation,
        "apiVersion": api_version,
        "time": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "fieldsType": "FieldsV1",
        "fieldsV1": to_fields_v1(paths),
    }


def _record(
    obj: Obj, entries: list[tuple[Obj, set[Path]]], mine: Obj, manager: str, operation: str
) -> Obj:
    """`obj` with managedFields: the other entries (fields taken away), then the writer's."""
    kept = [{**e, "fieldsV1": to_fields_v1(owned)} for e, owned in entries if owned]
    key = (manager, operation)
    kept = [e for e in kept if (e["manager"], e["operation"]) != key]
    kept.append(mine)
    result = copy.deepcopy(obj)
    result.setdefault("metadata", {})["managedFields"] = kept
    return result


def apply(live: Obj | None, config: Obj, manager: str, force: bool) -> Obj:
    """The object after `manager` applies `config` to `live` (None: not there yet)."""
    base = copy.deepcopy(live) if live is not None else {}
    applied = fields_of(config)
    others: list[tuple[Obj, set[Path]]] = []
    previous: set[Path] = set()
    for entry in _entries(base):
        if entry["manager"] == manager and entry["operation"] == "Apply":
            previous = _owned(entry)
        else:
            others.append((entry, _owned(entry)))
    conflicts = [
        (entry["manager"], path)
        for entry, owned in others
        for path in sorted(applied & owned)
        if path[-1] != "." and value_at(base, path) != value_at(config, path)
    ]
    if conflicts and not force:
        raise Conflict(conflicts)
    taken = {p for _m, p in conflicts}
    others = [(entry, owned - taken) for entry, owned in others]
    result = merge(base, {k: v for k, v in config.items() if k != "status"})
    still_owned = set().union(*(owned for _e, owned in others)) if others else set()
    # Whole list items first (then their fields are gone with them), deepest fields next.
    for path in sorted(previous - applied, key=lambda p: (p[-1] != ".", -len(p))):
        under = [p for p in still_owned | applied if p[: len(path) - 1] == path[:-1]]
        if path in still_owned or (path[-1] == "." and under) or _is_item_key(path):
            continue
        _delete(result, path)
    mine = _entry(manager, "Apply", str(config.get("apiVersion", "")), applied)
    return _record(result, others, mine, manager, "Apply")


def update(live: Obj | None, new: Obj, manager: str) -> Obj:
    """`new` as written by a non-apply request of `manager`: it takes the fields it changed.
    A request that sets managedFields itself is stored as it asks, as a real server does."""
    old = copy.deepcopy(live) if live is not None else {}
    asked = (new.get("metadata") or {}).get("managedFields")
    if asked is not None and asked != (old.get("metadata") or {}).get("managedFields"):
        return new
    before, after = fields_of(old), fields_of(new)
    changed = {p for p in after if value_at(old, p) != value_at(new, p) or p not in before}
    gone = before - after
    entries = []
    mine: set[Path] = set(changed)
    for entry in _entries(old):
        owned = _owned(entry) - changed - gone
        if entry["manager"] == manager and entry["operation"] == "Update":
            mine |= owned
            continue
        entries.append((entry, owned))
    if not mine:
        result = copy.deepcopy(new)
        result.setdefault("metadata", {})["managedFields"] = [
            {**e, "fieldsV1": to_fields_v1(o)} for e, o in entries if o
        ]
        return result
    return _record(
        new,
        entries,
        _entry(manager, "Update", str(new.get("apiVersion", "")), mine),
        manager,
        "Update",
    )


def manager_of(params: dict[str, str], user_agent: str) -> str:
    """The request's field manager: `fieldManager`, else the user agent up to its first '/'."""
    return params.get("fieldManager") or user_agent.split("/")[0] or "unknown"
