"""RBAC authorization over a set of manifests, as `kubectl auth can-i` asks the API server
(a SelfSubjectAccessReview), for testing what the chart's roles allow. Written from
Kubernetes' documentation ("Using RBAC Authorization"): a request is allowed when a rule of a
role bound to the subject (the ServiceAccount itself, or one of its groups
`system:serviceaccounts`, `system:serviceaccounts:<namespace>`, `system:authenticated`) names
its verb, API group and resource (`resource/subresource` for a subresource; `*` matches any)
and, when the rule has resourceNames, a request for one object of those names. A
ClusterRoleBinding grants its role everywhere; a RoleBinding only in its own namespace. A
request with no namespace (`-A`, or a cluster-wide resource) is granted only by a
ClusterRoleBinding, and one with no name (list, watch, create, `get` of all) never by a rule
with resourceNames. RBAC only adds: nothing denies."""

from __future__ import annotations

from typing import Any

Manifest = dict[str, Any]


def _subjects(namespace: str, name: str) -> list[tuple[str, str | None, str]]:
    return [
        ("ServiceAccount", namespace, name),
        ("Group", None, "system:serviceaccounts"),
        ("Group", None, f"system:serviceaccounts:{namespace}"),
        ("Group", None, "system:authenticated"),
    ]


def _bound(binding: Manifest, subjects: list[tuple[str, str | None, str]]) -> bool:
    for subject in binding.get("subjects") or []:
        kind, name = subject.get("kind"), subject.get("name")
        for want_kind, want_namespace, want_name in subjects:
            if kind != want_kind or name != want_name:
                continue
            if kind == "ServiceAccount" and subject.get("namespace") != want_namespace:
                continue
            return True
    return False


def _rule_allows(rule: Manifest, verb: str, group: str, resource: str, name: str | None) -> bool:
    def named(values: list[str], wanted: str) -> bool:
        return "*" in values or wanted in values

    if not named(rule.get("verbs") or [], verb) or not named(rule.get("apiGroups") or [], group):
        return False
    resources = rule.get("resources") or []
    sub = resource.partition("/")[2]
    if not ("*" in resources or resource in resources or (sub and f"*/{sub}" in resources)):
        return False
    names = rule.get("resourceNames") or []
    return not names or (name is not None and name in names)


def can_i(
    objects: list[Manifest],
    service_account: tuple[str, str],
    verb: str,
    resource: str,
    group: str = "",
    namespace: str | None = None,
    name: str | None = None,
) -> bool:
    """Whether the ServiceAccount (namespace, name) may do `verb` on `resource` of `group` in
    `namespace` (None: all namespaces, or a cluster-wide resource), on the object `name`
    (None: no single object, as list, watch, create or a `get` of all ask)."""
    subjects = _subjects(*service_account)
    roles = {
        (o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]): o
        for o in objects
        if o.get("kind") in {"Role", "ClusterRole"}
    }
    assert not any(r.get("aggregationRule") for r in roles.values()), "aggregation: not modelled"
    for binding in objects:
        kind = binding.get("kind")
        if kind not in {"RoleBinding", "ClusterRoleBinding"} or not _bound(binding, subjects):
            continue
        where = binding["metadata"].get("namespace")
        if kind == "RoleBinding" and (namespace is None or where != namespace):
            continue
        ref = binding["roleRef"]
        role = roles.get((ref["kind"], where if ref["kind"] == "Role" else None, ref["name"]))
        if role is None:
            continue
        if any(_rule_allows(r, verb, group, resource, name) for r in role.get("rules") or []):
            return True
    return False
