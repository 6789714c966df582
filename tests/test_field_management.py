"""The emulated API server's field management held to fixed cases from Kubernetes' server-side
apply documentation (reference/using-api/server-side-apply): what the tests of the operator's
repair and migration rely on must behave as a real server does in these cases."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from tests import field_management as fm
from tests.kube_api import KubeAPI

CM: dict[str, Any] = {
    "apiVersion": "v1",
    "kind": "ConfigMap",
    "metadata": {"name": "test-cm", "namespace": "default", "labels": {"test-label": "test"}},
    "data": {"key": "some value"},
}


def owners(obj: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(e["manager"], e["operation"]): e["fieldsV1"] for e in obj["metadata"]["managedFields"]}


def test_apply_records_the_documented_managed_fields() -> None:
    """The documentation's example: kubectl applies test-cm; its entry owns the label and
    the data key, in FieldsV1."""
    obj = fm.apply(None, CM, "kubectl", force=False)
    assert owners(obj) == {
        ("kubectl", "Apply"): {
            "f:metadata": {"f:labels": {"f:test-label": {}}},
            "f:data": {"f:key": {}},
        }
    }
    assert obj["data"] == {"key": "some value"}


def test_a_different_value_owned_by_another_manager_conflicts_unless_forced() -> None:
    obj = fm.apply(None, CM, "kubectl", force=False)
    other = copy.deepcopy(CM)
    other["data"]["key"] = "other value"
    with pytest.raises(fm.Conflict, match=r'conflict with "kubectl": \.data\.key'):
        fm.apply(obj, other, "controller", force=False)
    forced = fm.apply(obj, other, "controller", force=True)
    assert forced["data"]["key"] == "other value"
    fields = owners(forced)
    assert "f:key" in fields[("controller", "Apply")]["f:data"]
    assert "f:data" not in fields[("kubectl", "Apply")]  # ownership moved


def test_the_same_value_is_shared_and_a_sharer_can_give_it_up() -> None:
    """Two appliers setting the same value share the field; one dropping it leaves it."""
    obj = fm.apply(None, CM, "kubectl", force=False)
    obj = fm.apply(obj, CM, "controller", force=False)
    assert all("f:key" in f["f:data"] for f in owners(obj).values())
    without = copy.deepcopy(CM)
    del without["data"]
    obj = fm.apply(obj, without, "controller", force=False)
    assert obj["data"] == {"key": "some value"}
    assert "f:data" not in owners(obj)[("controller", "Apply")]


def test_a_field_removed_from_the_applied_config_is_removed_when_nobody_else_owns_it() -> None:
    obj = fm.apply(None, CM, "kubectl", force=False)
    without = copy.deepcopy(CM)
    del without["metadata"]["labels"]
    obj = fm.apply(obj, without, "kubectl", force=False)
    assert "labels" not in obj["metadata"] and obj["data"] == {"key": "some value"}


def test_an_update_takes_the_fields_it_changes_and_never_conflicts() -> None:
    """`kubectl edit` (an Update) may change an applied field; the applier then conflicts."""
    obj = fm.apply(None, CM, "kubectl", force=False)
    edited = fm.update(obj, {**obj, "data": {"key": "edited"}}, "kubectl-edit")
    fields = owners(edited)
    assert fields[("kubectl-edit", "Update")] == {"f:data": {"f:key": {}}}
    with pytest.raises(fm.Conflict):
        fm.apply(edited, CM, "kubectl", force=False)
    assert fm.apply(edited, CM, "kubectl", force=True)["data"]["key"] == "some value"


def test_associative_lists_merge_item_by_item() -> None:
    """Containers are a list keyed by name: an applier owns its own items, and removing an
    item it alone owns removes that item and no other."""
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "p", "namespace": "default"},
        "spec": {"containers": [{"name": "a", "image": "a:1"}, {"name": "b", "image": "b:1"}]},
    }
    obj = fm.apply(None, pod, "me", force=False)
    sidecar = {**pod, "spec": {"containers": [{"name": "c", "image": "c:1"}]}}
    obj = fm.apply(obj, sidecar, "injector", force=False)
    assert [c["name"] for c in obj["spec"]["containers"]] == ["a", "b", "c"]
    fewer = {**pod, "spec": {"containers": [{"name": "a", "image": "a:2"}]}}
    obj = fm.apply(obj, fewer, "me", force=False)
    assert obj["spec"]["containers"] == [
        {"name": "a", "image": "a:2"},
        {"name": "c", "image": "c:1"},
    ]


def test_a_request_setting_managed_fields_is_stored_as_asked() -> None:
    """How controllers move client-side fields to server-side apply: a patch of
    metadata.managedFields replaces them."""
    obj = fm.update(None, CM, "Python")
    asked = copy.deepcopy(obj)
    asked["metadata"]["managedFields"][0]["manager"] = "kvtier-operator"
    asked["metadata"]["managedFields"][0]["operation"] = "Apply"
    stored = fm.update(obj, asked, "kvtier-operator")
    assert owners(stored).keys() == {("kvtier-operator", "Apply")}


def test_the_emulated_server_applies_over_http(tmp_path: Any) -> None:
    """Over HTTP: apply creates, a no-op apply writes nothing, a conflict is HTTP 409."""
    path = "/api/v1/namespaces/default/configmaps"
    with KubeAPI(tmp_path) as api:
        apply = "application/apply-patch+yaml"
        code, created = api.request("PATCH", f"{path}/test-cm", CM, apply, manager="kubectl")
        assert code == 200 and created["data"] == CM["data"]
        version = created["metadata"]["resourceVersion"]
        code, again = api.request("PATCH", f"{path}/test-cm", CM, apply, manager="kubectl")
        assert code == 200 and again["metadata"]["resourceVersion"] == version
        other = {**CM, "data": {"key": "other"}}
        code, refused = api.request("PATCH", f"{path}/test-cm", other, apply, manager="x")
        assert code == 409 and "conflict" in refused["message"]
