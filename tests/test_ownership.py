"""Children written by earlier versions move to kvtier's server-side apply identity, as
client-go's csaupgrade does it: the old manager's Update entries folded into kvtier's Apply
entry, nobody else's entries touched, the patch guarded by the resourceVersion."""

from __future__ import annotations

from typing import Any

from kvtier.kube import FIELD_MANAGER
from kvtier.operator.ownership import upgrade_patch, upgraded


def entry(manager: str, operation: str, fields: dict[str, Any]) -> dict[str, Any]:
    return {
        "manager": manager,
        "operation": operation,
        "fieldsType": "FieldsV1",
        "fieldsV1": fields,
    }


def test_legacy_updates_fold_into_the_apply_entry() -> None:
    entries = [
        entry("Python", "Update", {"f:data": {"f:agent.yaml": {}}, "f:metadata": {"f:labels": {}}}),
        entry(FIELD_MANAGER, "Apply", {"f:data": {"f:agent.yaml": {}}}),
        entry("kubectl-edit", "Update", {"f:data": {"f:extra": {}}}),
        entry("Python", "Update", {"f:status": {"f:x": {}}}) | {"subresource": "status"},
    ]
    result = upgraded(entries, FIELD_MANAGER, "v1")
    assert result is not None
    by_manager = {(e["manager"], e["operation"], e.get("subresource")): e for e in result}
    assert set(by_manager) == {
        ("kubectl-edit", "Update", None),
        ("Python", "Update", "status"),
        (FIELD_MANAGER, "Apply", None),
    }
    assert by_manager[(FIELD_MANAGER, "Apply", None)]["fieldsV1"] == {
        "f:data": {"f:agent.yaml": {}},
        "f:metadata": {"f:labels": {}},
    }


def test_nothing_to_move_means_no_patch() -> None:
    current = {
        "apiVersion": "v1",
        "metadata": {
            "resourceVersion": "7",
            "managedFields": [entry(FIELD_MANAGER, "Apply", {"f:data": {}})],
        },
    }
    assert upgrade_patch(current, FIELD_MANAGER) is None
    current["metadata"]["managedFields"].append(entry("Python", "Update", {"f:data": {}}))
    patch = upgrade_patch(current, FIELD_MANAGER)
    assert patch is not None and patch[0] == {
        "op": "test",
        "path": "/metadata/resourceVersion",
        "value": "7",
    }
