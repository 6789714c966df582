"""What the chart lets the operator do with Secrets: RBAC (tests/rbac_access.py, as
`kubectl auth can-i` asks) lets it create Secrets but read, list, watch or change none, in any
namespace; and since RBAC cannot narrow a create by name, the chart's ValidatingAdmissionPolicy
(tests/admission_policy.py) admits only the CURVE key pair Secret the operator makes, refusing
every other Secret its ServiceAccount creates."""

from __future__ import annotations

import copy
from typing import Any

import jsonpatch
import pytest
import zmq

from kvtier.api.names import curve_secret_name
from kvtier.operator.builders import build_curve_secret
from tests.admission_policy import admit, compile_errors, create_request
from tests.chart_render import render
from tests.rbac_access import can_i

OPERATOR = ("kvtier-system", "kv-kvtier")
USERNAME = "system:serviceaccount:kvtier-system:kv-kvtier"
NAMESPACES = [None, "kvtier-system", "inference", "kube-system", "default"]
VALUE_SETS = {
    "defaults": [],
    "namespaced-ha": [
        "--set",
        "operator.replicas=2",
        "--set",
        "operator.watchNamespaces={inference}",
    ],
}


@pytest.fixture(scope="module", params=list(VALUE_SETS), ids=list(VALUE_SETS))
def chart(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return render(*VALUE_SETS[request.param])


def test_the_evaluator_follows_rbac_rules() -> None:
    """The RBAC model itself, on roles whose answers the documentation gives."""
    sa = {"kind": "ServiceAccount", "name": "app", "namespace": "ns"}
    objects = [
        {
            "kind": "ClusterRole",
            "metadata": {"name": "reader"},
            "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list"]}],
        },
        {
            "kind": "Role",
            "metadata": {"name": "one", "namespace": "ns"},
            "rules": [
                {
                    "apiGroups": [""],
                    "resources": ["configmaps"],
                    "resourceNames": ["mine"],
                    "verbs": ["get"],
                },
                {"apiGroups": ["apps"], "resources": ["deployments/scale"], "verbs": ["patch"]},
            ],
        },
        {
            "kind": "ClusterRoleBinding",
            "metadata": {"name": "reader"},
            "roleRef": {"kind": "ClusterRole", "name": "reader"},
            "subjects": [sa],
        },
        {
            "kind": "RoleBinding",
            "metadata": {"name": "one", "namespace": "ns"},
            "roleRef": {"kind": "Role", "name": "one"},
            "subjects": [sa],
        },
    ]
    who = ("ns", "app")
    assert can_i(objects, who, "list", "pods")  # -A, through the ClusterRoleBinding
    assert not can_i(objects, who, "watch", "pods", namespace="ns")
    assert can_i(objects, who, "get", "configmaps", namespace="ns", name="mine")
    assert not can_i(objects, who, "get", "configmaps", namespace="ns")  # no name
    assert not can_i(objects, who, "get", "configmaps", namespace="ns", name="other")
    assert not can_i(objects, who, "get", "configmaps", name="mine")  # -A: RoleBinding is local
    assert not can_i(objects, who, "get", "configmaps", namespace="other", name="mine")
    assert can_i(objects, who, "patch", "deployments/scale", "apps", namespace="ns")
    assert not can_i(objects, who, "patch", "deployments", "apps", namespace="ns")
    assert not can_i(objects, ("other", "app"), "list", "pods")


@pytest.mark.parametrize("verb", ["get", "list", "watch", "update", "patch", "delete"])
def test_the_operator_can_read_or_change_no_secret(chart: list[dict[str, Any]], verb: str) -> None:
    """`kubectl auth can-i <verb> secrets -A --as=system:serviceaccount:kvtier-system:kv-kvtier`
    answers no, in every namespace, also for the Secrets of the chart and of the tiers."""
    for namespace in NAMESPACES:
        assert not can_i(chart, OPERATOR, verb, "secrets", namespace=namespace), namespace
        for name in ("kv-kvtier-webhook-tls", "kvtier-llama-peers-curve", "s3-credentials"):
            assert not can_i(chart, OPERATOR, verb, "secrets", namespace=namespace, name=name)


def test_the_operator_can_create_secrets_and_do_its_work(chart: list[dict[str, Any]]) -> None:
    assert can_i(chart, OPERATOR, "create", "secrets", namespace="inference")
    assert can_i(chart, OPERATOR, "list", "kvcachetiers", "kvtier.io")
    assert can_i(chart, OPERATOR, "patch", "kvcachetiers", "kvtier.io", namespace="inference")
    assert can_i(chart, OPERATOR, "delete", "persistentvolumes", name="kvtier-inference-a-nfs")
    assert can_i(chart, OPERATOR, "get", "persistentvolumeclaims", namespace="inference")
    # The pre-delete hook's Role: its own Deployment, nothing else.
    deployments = ("deployments", "apps")
    assert can_i(
        chart, OPERATOR, "patch", *deployments, namespace="kvtier-system", name="kv-kvtier"
    )
    assert not can_i(chart, OPERATOR, "patch", *deployments, namespace="kvtier-system", name="x")
    assert not can_i(
        chart, OPERATOR, "patch", *deployments, namespace="inference", name="kv-kvtier"
    )


def policy_of(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (policy,) = [o for o in objects if o["kind"] == "ValidatingAdmissionPolicy"]
    (binding,) = [o for o in objects if o["kind"] == "ValidatingAdmissionPolicyBinding"]
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"]
    assert "matchResources" not in binding["spec"] and "paramRef" not in binding["spec"]
    assert policy["apiVersion"] == "admissionregistration.k8s.io/v1"
    return policy


def curve_secret(tier: str = "llama", entry: str = "peers") -> dict[str, Any]:
    """The Secret the operator makes, from its own builder."""
    resource = {
        "apiVersion": "kvtier.io/v1alpha1",
        "kind": "KVCacheTier",
        "metadata": {"name": tier, "namespace": "inference", "uid": "0f1e-uid"},
        "spec": {"tiers": [{"name": entry, "peer": {}}]},
    }
    public, secret = zmq.curve_keypair()
    return build_curve_secret(resource, curve_secret_name(tier, entry), public, secret)


def test_the_policy_compiles_and_admits_the_operators_curve_secret() -> None:
    policy = policy_of(render())
    assert compile_errors(policy) == []
    request = create_request(USERNAME)
    assert admit(policy, request, curve_secret()) == []
    # Tier and peer tier names are at most 63 characters (label values, DNS labels), so the
    # name is never shortened to a digest the policy would not recognise.
    long_tier, long_entry = "t" * 63, "p" * 63
    assert curve_secret_name(long_tier, long_entry) == f"kvtier-{long_tier}-{long_entry}-curve"
    assert admit(policy, request, curve_secret(long_tier, long_entry)) == []
    # Another release's operator, or anyone else: not this policy's business.
    others = ("system:serviceaccount:kvtier-system:other", "system:admin")
    for user in others:
        assert admit(policy, create_request(user), {"kind": "Secret", "metadata": {}}) is None
    update = {**create_request(USERNAME), "operation": "UPDATE"}
    assert admit(policy, update, curve_secret()) is None  # RBAC refuses updates anyway
    assert admit(policy, create_request(USERNAME, "configmaps"), {"metadata": {}}) is None


def replace(path: str, value: Any) -> list[dict[str, Any]]:
    return [{"op": "replace", "path": path, "value": value}]


def remove(path: str) -> list[dict[str, Any]]:
    return [{"op": "remove", "path": path}]


def add(path: str, value: Any) -> list[dict[str, Any]]:
    return [{"op": "add", "path": path, "value": value}]


OWNER, LABELS, NAME = "/metadata/ownerReferences/0", "/metadata/labels", "/metadata/name"
ANOTHER_OWNER = {"apiVersion": "v1", "kind": "ConfigMap", "name": "x", "uid": "y"}
REFUSED = [
    ("a service account token", replace("/type", "kubernetes.io/service-account-token")),
    ("no type", remove("/type")),
    ("no labels", remove(LABELS)),
    ("another manager", replace(f"{LABELS}/app.kubernetes.io~1managed-by", "me")),
    ("no tier label", remove(f"{LABELS}/kvtier.io~1tier")),
    ("labels of two tiers", replace(f"{LABELS}/app.kubernetes.io~1instance", "other")),
    ("any name", replace(NAME, "db-password")),
    ("another tier's name", replace(NAME, "kvtier-other-peers-curve")),
    ("no peer tier in the name", replace(NAME, "kvtier-llama--curve")),
    ("not a key pair's name", replace(NAME, "kvtier-llama-peers")),
    ("no owner", remove("/metadata/ownerReferences")),
    ("another kind of owner", replace(f"{OWNER}/kind", "Deployment")),
    ("another group's owner", replace(f"{OWNER}/apiVersion", "apps/v1")),
    ("another tier as owner", replace(f"{OWNER}/name", "other")),
    ("an owner that is not the controller", replace(f"{OWNER}/controller", False)),
    ("two owners", add("/metadata/ownerReferences/-", ANOTHER_OWNER)),
    ("another key", add("/data/token", "eA==")),
    ("no keys", remove("/data")),
    ("stringData", add("/stringData", {"x": "y"})),
]


@pytest.mark.parametrize(("case", "patch"), REFUSED, ids=[c for c, _ in REFUSED])
def test_the_policy_refuses_any_other_secret_the_operator_creates(
    case: str, patch: list[dict[str, Any]]
) -> None:
    policy = policy_of(render())
    secret = jsonpatch.apply_patch(copy.deepcopy(curve_secret()), patch)
    reasons = admit(policy, create_request(USERNAME), secret)
    assert reasons, case
    # refused by what the policy checks, not by an expression failing on an odd object
    assert set(reasons) <= {v["message"] for v in policy["spec"]["validations"]}, reasons
