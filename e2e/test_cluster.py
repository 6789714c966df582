"""The conformance suite: kvtier as a platform team meets it, against an API server.

When KUBECONFIG names a cluster, every scenario runs against it: the CRDs are applied, the
operator runs as a local process with that kubeconfig, and what the scenarios create lives in
a namespace of their own, deleted at the end. Without one (CI here), the scenarios the emulated
API server can play run against it (tests/kube_api.py: field management, server-side apply,
the status subresource, finalizers; served over TLS with the CA and a client certificate
inlined in the kubeconfig, so every client logs in as on a kubeadm or kind cluster), and the
rest are skipped naming why: only a real API server (and its controllers) can show them. The
The conformance table in docs/operator.md says which scenario runs where.
"""

from __future__ import annotations

import base64
import copy
import json
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from lightkube import Client
from lightkube.config.kubeconfig import KubeConfig
from lightkube.resources.apiextensions_v1 import CustomResourceDefinition
from lightkube.resources.apps_v1 import DaemonSet
from lightkube.resources.core_v1 import ConfigMap, Namespace
from lightkube.types import PatchType

from kvtier.kube import (
    FIELD_MANAGER,
    ApiError,
    KVCacheNode,
    KVCacheTier,
    as_dict,
    resource_of,
    to_object,
)
from tests.apiserver_rules import admit, load_crd
from tests.kube_api import KubeAPI
from tests.operator_process import running_operator, wait_for

REPO = Path(__file__).resolve().parents[1]
REAL = bool(os.environ.get("KUBECONFIG"))
real_only = pytest.mark.skipif(
    not REAL, reason="real API server only: KUBECONFIG names no cluster (docs/operator.md)"
)
NAME = "conformance"
AGENT = f"kvtier-{NAME}"


@dataclass
class Cluster:
    client: Client
    kubeconfig: Path
    namespace: str
    directory: Path
    api: KubeAPI | None  # the emulated server, when there is no real one

    @property
    def real(self) -> bool:
        return self.api is None


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    directory = tmp_path_factory.mktemp("conformance")
    if REAL:
        kubeconfig = Path(os.environ["KUBECONFIG"])
        client = Client(field_manager="kvtier-conformance")
        namespace = f"kvtier-e2e-{uuid.uuid4().hex[:6]}"
        client.create(Namespace.from_dict({"metadata": {"name": namespace}}))
        try:
            yield Cluster(client, kubeconfig, namespace, directory, None)
        finally:
            client.delete(Namespace, namespace)
        return
    with KubeAPI(directory, tls=True) as api:
        kubeconfig = api.kubeconfig
        client = Client(KubeConfig.from_file(kubeconfig), field_manager="kvtier-conformance")
        yield Cluster(client, kubeconfig, "inference", directory, api)


@pytest.fixture(scope="module")
def crds(cluster: Cluster) -> list[str]:
    """`kubectl apply -f crds/`: every CRD applied (server-side) and, on a real server,
    Established — the step a non-structural schema used to fail."""
    names = []
    for path in sorted((REPO / "crds").glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        names.append(crd["metadata"]["name"])
        if cluster.real:
            cluster.client.apply(CustomResourceDefinition.from_dict(crd), force=True)
    if cluster.real:
        for name in names:
            wait_for(lambda name=name: _established(cluster.client, name), timeout=60)
    return names


def _established(client: Client, name: str) -> bool:
    crd = client.get(CustomResourceDefinition, name)
    conditions = (crd.status.conditions if crd.status else None) or []
    return any(c.type == "Established" and c.status == "True" for c in conditions)


@pytest.fixture(scope="module")
def webhook(cluster: Cluster, crds: list[str]) -> Iterator[int]:
    namespaces = (cluster.namespace,) if cluster.real else ()
    with running_operator(cluster.kubeconfig, cluster.directory, namespaces) as port:
        yield port


def tier_manifest(cluster: Cluster, name: str = NAME, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "kvtier.io/v1alpha1",
        "kind": "KVCacheTier",
        "metadata": {"name": name, "namespace": cluster.namespace},
        "spec": {
            "podSelector": {"matchLabels": {"app": "vllm"}},
            "host": {"capacity": "1Gi", "chunkSize": "2Mi"},
            **spec,
        },
    }


@pytest.fixture(scope="module")
def tier(cluster: Cluster, webhook: int) -> dict[str, Any]:
    return as_dict(cluster.client.create(to_object(tier_manifest(cluster))))


def get(cluster: Cluster, resource: Any, name: str) -> dict[str, Any] | None:
    try:
        return as_dict(cluster.client.get(resource, name, namespace=cluster.namespace))
    except ApiError as exc:
        if exc.status.code == 404:
            return None
        raise


def daemonset(cluster: Cluster) -> dict[str, Any]:
    return dict(wait_for(lambda: get(cluster, DaemonSet, AGENT)))


def patch_tier(cluster: Cluster, patch: dict[str, Any], name: str = NAME) -> None:
    cluster.client.patch(
        KVCacheTier, name, patch, namespace=cluster.namespace, patch_type=PatchType.MERGE
    )


# --- the CRDs ------------------------------------------------------------------------------


@real_only
def test_crds_are_established(cluster: Cluster, crds: list[str]) -> None:
    assert all(_established(cluster.client, name) for name in crds)


def test_every_example_is_admitted(cluster: Cluster, crds: list[str]) -> None:
    """A real server dry-runs each example's create; without one, the schema and CEL rules
    the server would apply are evaluated (tests/apiserver_rules.py)."""
    examples = sorted((REPO / "examples").glob("*.yaml"))
    assert examples
    for path in examples:
        resource = yaml.safe_load(path.read_text())
        resource["metadata"]["namespace"] = cluster.namespace
        if cluster.real:
            cluster.client.create(to_object(resource), dry_run=True)
        else:
            assert admit(load_crd("kvcachetier.yaml"), resource)[1] == [], path.name


INVALID = [
    ({"host": {"capacity": "-4Gi"}}, "spec.host.capacity"),
    ({"host": {"capacity": 0}}, "spec.host.capacity"),
    ({"host": {"capacity": "8Gi", "policy": "fifo"}}, "spec.host.policy"),
    ({"host": {"capacity": "8Gi", "chunkSize": "2 Mi"}}, "spec.host.chunkSize"),
    ({"tiers": [{"name": "host", "peer": {}}]}, "spec.tiers[0].name"),
    ({"tiers": [{"name": "a", "peer": {}}, {"name": "a", "peer": {}}]}, "spec.tiers"),
    ({"tiers": [{"name": "x"}]}, "spec.tiers[0]"),
    ({"vllm": {"cpuBytes": -1}}, "spec.vllm.cpuBytes"),
    ({"isolation": "cluster"}, "spec.isolation"),
]


@pytest.mark.parametrize(("change", "field"), INVALID, ids=[f for _c, f in INVALID])
def test_an_invalid_spec_is_refused_naming_its_field(
    cluster: Cluster, crds: list[str], change: dict[str, Any], field: str
) -> None:
    resource = tier_manifest(cluster, "invalid")
    resource["spec"].update(change)
    if cluster.real:
        with pytest.raises(ApiError) as refused:
            cluster.client.create(to_object(resource), dry_run=True)
        assert refused.value.status.code == 422 and field in str(refused.value.status.message)
    else:
        errors = admit(load_crd("kvcachetier.yaml"), resource)[1]
        assert any(e.startswith(f"{field}:") for e in errors), errors


# --- the operator's children -----------------------------------------------------------------


def test_children_are_created_and_owned(cluster: Cluster, tier: dict[str, Any]) -> None:
    uid = tier["metadata"]["uid"]
    for kind, api_version in (
        ("ConfigMap", "v1"),
        ("ServiceAccount", "v1"),
        ("Service", "v1"),
        ("Role", "rbac.authorization.k8s.io/v1"),
        ("RoleBinding", "rbac.authorization.k8s.io/v1"),
        ("DaemonSet", "apps/v1"),
    ):
        child = wait_for(lambda k=kind, v=api_version: get(cluster, resource_of(v, k), AGENT))
        (owner,) = child["metadata"]["ownerReferences"]
        assert owner["uid"] == uid and owner["controller"] is True, kind
        managers = {(e["manager"], e["operation"]) for e in child["metadata"]["managedFields"]}
        assert (FIELD_MANAGER, "Apply") in managers, (kind, managers)


def test_a_deleted_child_is_recreated(cluster: Cluster, tier: dict[str, Any]) -> None:
    wait_for(lambda: get(cluster, ConfigMap, AGENT))
    cluster.client.delete(ConfigMap, AGENT, namespace=cluster.namespace)
    recreated = wait_for(lambda: get(cluster, ConfigMap, AGENT))
    assert "agent.yaml" in recreated["data"]


def test_a_hand_edited_child_is_repaired(cluster: Cluster, tier: dict[str, Any]) -> None:
    """`kubectl set image daemonset/kvtier-conformance '*=other:latest'`: a strategic merge
    patch by another field manager; the next pass sets kvtier's image back."""
    image = daemonset(cluster)["spec"]["template"]["spec"]["containers"][0]["image"]
    container = {"name": "agent", "image": "other:latest"}
    cluster.client.patch(
        DaemonSet,
        AGENT,
        {"spec": {"template": {"spec": {"containers": [container]}}}},
        namespace=cluster.namespace,
        patch_type=PatchType.STRATEGIC,
        field_manager="kubectl-set",
    )

    def repaired() -> bool:
        containers = daemonset(cluster)["spec"]["template"]["spec"]["containers"]
        return bool(containers[0]["image"] == image)

    wait_for(repaired)


def test_a_field_the_desired_object_drops_is_removed(
    cluster: Cluster, tier: dict[str, Any]
) -> None:
    def priority() -> str | None:
        return daemonset(cluster)["spec"]["template"]["spec"].get("priorityClassName")

    patch_tier(cluster, {"spec": {"agent": {"priorityClassName": "kvtier-conformance"}}})
    wait_for(lambda: priority() == "kvtier-conformance")
    patch_tier(cluster, {"spec": {"agent": {"priorityClassName": None}}})
    wait_for(lambda: priority() is None)


def test_a_child_written_by_an_earlier_version_is_taken_over(
    cluster: Cluster, webhook: int
) -> None:
    """Children that earlier versions created without a field manager (recorded as Updates
    by "Python") move to kvtier's Apply entry, so what kvtier no longer sets is removed."""
    name = "legacy"
    child = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": f"kvtier-{name}",
            "namespace": cluster.namespace,
            "labels": {"stale": "yes"},
            "annotations": {"kvtier.io/spec-hash": "0123456789abcdef"},
        },
        "data": {"agent.yaml": "old: true\n"},
    }
    cluster.client.create(to_object(child), field_manager="Python")
    cluster.client.create(to_object(tier_manifest(cluster, name)))
    try:

        def taken_over() -> dict[str, Any] | None:
            current = get(cluster, ConfigMap, f"kvtier-{name}") or {}
            labels = (current.get("metadata") or {}).get("labels") or {}
            return current if "stale" not in labels and "agent.yaml" in current["data"] else None

        current = wait_for(taken_over)
        assert "old: true" not in current["data"]["agent.yaml"]
        assert "kvtier.io/spec-hash" not in (current["metadata"].get("annotations") or {})
        managers = {e["manager"] for e in current["metadata"]["managedFields"]}
        assert "Python" not in managers and FIELD_MANAGER in managers
    finally:
        cluster.client.delete(KVCacheTier, name, namespace=cluster.namespace)


def test_a_spec_change_rolls_the_agents(cluster: Cluster, tier: dict[str, Any]) -> None:
    key = "kvtier.io/config-hash"

    def config_hash() -> str:
        return str(daemonset(cluster)["spec"]["template"]["metadata"]["annotations"][key])

    before = config_hash()
    patch_tier(cluster, {"spec": {"host": {"capacity": "2Gi"}}})
    wait_for(lambda: config_hash() != before)
    if cluster.real:  # the DaemonSet controller takes the new template up
        wait_for(
            lambda: (
                (ds := daemonset(cluster)).get("status", {}).get("observedGeneration", 0)
                >= ds["metadata"]["generation"]
            ),
            timeout=120,
        )


def test_status_observes_the_generation_it_acted_on(cluster: Cluster, tier: dict[str, Any]) -> None:
    patch_tier(cluster, {"spec": {"host": {"capacity": "3Gi"}}})

    def observed() -> dict[str, Any] | None:
        current = get(cluster, KVCacheTier, NAME) or {}
        status = current.get("status") or {}
        generation = current["metadata"]["generation"]
        if status.get("observedGeneration") != generation:
            return None
        return (
            status
            if all(c.get("observedGeneration") == generation for c in status["conditions"])
            else None
        )

    assert wait_for(observed)["conditions"]


# --- agents, status and kubectl get ----------------------------------------------------------


def _column(obj: dict[str, Any], json_path: str) -> Any:
    value: Any = obj
    for part in json_path.strip(".").split("."):
        value = (value or {}).get(part) if isinstance(value, dict) else None
    return value


def test_a_real_agent_publishes_its_node_and_kubectl_get_shows_it(
    cluster: Cluster, tier: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real agent process logs in with the kubeconfig (over TLS with inline CA data when
    emulated), creates its KVCacheNode, reports; the tier's status and `kubectl get kvt`
    columns then show it."""
    from kvtier.client.connection import AgentClient
    from kvtier.local.agent import AgentProcess, scratch_config

    monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig))
    scratch = Path(tempfile.mkdtemp(prefix="kvtier-e2e-", dir="/dev/shm"))
    report = {
        "target": "kubernetes",
        "namespace": cluster.namespace,
        "tier": NAME,
        "node": "conformance-node",
        "intervalSeconds": 0.5,
        "minIntervalSeconds": 0.2,
    }
    config = scratch_config(scratch, "conformance", "4Mi", "64Ki", report=report)
    chunks = "conformance-0123456789ab"
    try:
        with AgentProcess(config), AgentClient(config.endpoint) as client:
            keys = [i.to_bytes(8, "little") * 4 for i in range(4)]
            rows = [bytes([i]) * (64 << 10) for i in range(4)]
            client.store(chunks, keys, rows)
            client.lookup(chunks, [keys[0], b"\xff" * 32])

            def reported() -> dict[str, Any] | None:
                node = get(cluster, KVCacheNode, f"{NAME}-conformance-node") or {}
                status = node.get("status") or {}
                return status if status.get("lookups") == 2 else None

            status = wait_for(reported)
            assert status["tiers"][0]["chunks"] == 4 and status["hits"] == 1

            def shown() -> dict[str, Any] | None:
                current = get(cluster, KVCacheTier, NAME) or {}
                return current if (current.get("status") or {}).get("lookups") else None

            current = wait_for(shown)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    columns = {
        c["name"]: _column(current, c["jsonPath"])
        for c in load_crd("kvcachetier.yaml")["spec"]["versions"][0]["additionalPrinterColumns"]
    }
    assert columns["Hit-Rate"] == "50%" and columns["Host-Used"]
    assert chunks in current["status"]["fingerprints"]
    kubectl = shutil.which("kubectl")
    if cluster.real and kubectl:
        shown_by_kubectl = subprocess.run(
            [kubectl, "get", "kvt", NAME, "-n", cluster.namespace],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert "50%" in shown_by_kubectl


# --- the webhook -----------------------------------------------------------------------------


def _review(port: int, pod: dict[str, Any]) -> dict[str, Any]:
    body = {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "0000-1111",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "operation": "CREATE",
            "namespace": pod["metadata"]["namespace"],
            "name": pod["metadata"]["name"],
            "object": pod,
            "userInfo": {"username": "system:serviceaccount:x:y"},
            "dryRun": False,
        },
    }
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/kvtier-inject",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=10) as resp:
        return dict(json.loads(resp.read())["response"])


def test_the_webhook_injects_a_selected_pod_and_no_other(
    cluster: Cluster, tier: dict[str, Any], webhook: int
) -> None:
    """The operator's admission server, called as the API server calls it (through the API
    server itself only with the chart installed: see the helm scenario)."""
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "vllm-0", "namespace": cluster.namespace, "labels": {"app": "vllm"}},
        "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.33.0"}]},
    }
    response = wait_for(lambda: (r := _review(webhook, pod)).get("patch") and r)
    assert response["allowed"] is True
    patch = json.loads(base64.b64decode(response["patch"]))
    assert any(op["path"] == "/spec/containers/0/args" for op in patch) or any(
        "kv-transfer-config" in json.dumps(op) for op in patch
    )
    other = copy.deepcopy(pod)
    other["metadata"]["labels"] = {"app": "web"}
    untouched = _review(webhook, other)
    assert untouched["allowed"] is True and not untouched.get("patch")


# --- deletion --------------------------------------------------------------------------------


def test_delete_releases_the_finalizer(cluster: Cluster, webhook: int) -> None:
    """A deleted tier goes away (kopf's finalizer released, nothing stuck); its children name
    it as their controlling owner, which is what the garbage collector acts on."""
    name = "deleted"
    created = as_dict(cluster.client.create(to_object(tier_manifest(cluster, name))))
    child = wait_for(lambda: get(cluster, ConfigMap, f"kvtier-{name}"))
    assert child["metadata"]["ownerReferences"][0]["uid"] == created["metadata"]["uid"]
    wait_for(
        lambda: (
            "kvtier.io/operator"
            in ((get(cluster, KVCacheTier, name) or {}).get("metadata", {}).get("finalizers") or [])
        )
    )
    cluster.client.delete(KVCacheTier, name, namespace=cluster.namespace)
    wait_for(lambda: get(cluster, KVCacheTier, name) is None)


@real_only
def test_children_are_garbage_collected(cluster: Cluster, webhook: int) -> None:
    name = "collected"
    cluster.client.create(to_object(tier_manifest(cluster, name)))
    wait_for(lambda: get(cluster, DaemonSet, f"kvtier-{name}"))
    cluster.client.delete(KVCacheTier, name, namespace=cluster.namespace)
    wait_for(lambda: get(cluster, DaemonSet, f"kvtier-{name}") is None, timeout=120)
    wait_for(lambda: get(cluster, ConfigMap, f"kvtier-{name}") is None, timeout=120)


# --- the chart -------------------------------------------------------------------------------


@real_only
def test_helm_install_upgrade_uninstall(cluster: Cluster, crds: list[str]) -> None:
    helm = shutil.which("helm") or str(Path(sys.executable).parent / "helm")
    release = f"kvtier-{uuid.uuid4().hex[:4]}"
    chart = str(REPO / "charts" / "kvtier")
    base = [helm, "--kubeconfig", str(cluster.kubeconfig), "-n", cluster.namespace]

    def helm_run(*args: str) -> None:
        subprocess.run([*base, *args], check=True, timeout=300)

    helm_run("install", release, chart)
    try:
        helm_run("upgrade", release, chart, "--set", "operator.reconcileIntervalSeconds=15")
        helm_run("status", release)
    finally:
        helm_run("uninstall", release, "--wait")
    listed = subprocess.run([*base, "list", "-q"], capture_output=True, text=True, check=True)
    assert release not in listed.stdout
