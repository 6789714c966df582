"""The Helm chart: lints strictly, renders for several value sets, and every rendered object
validates against the Kubernetes 1.33 schemas (the Prometheus Operator and cert-manager
kinds, which those schemas do not cover, are checked for shape)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kvtier.api.config import parse_config
from tests.chart_render import CHART, HELM, REPO, helm, render

FOREIGN = {"PodMonitor", "Certificate", "Issuer"}
METRICS = {
    "kvtier_hits_total",
    "kvtier_lookups_total",
    "kvtier_tier_used_bytes",
    "kvtier_store_bytes_total",
    "kvtier_request_seconds_bucket",
    "kvtier_peer_chunks_total",
    "kvtier_peer_lent_slots",
}

VALUE_SETS: dict[str, list[str]] = {
    "defaults": [],
    "ha-monitoring": [
        "--set",
        "operator.replicas=2",
        "--set",
        "metrics.podMonitor.enabled=true",
        "--set",
        "metrics.grafanaDashboard.enabled=true",
        "--set",
        "operator.watchNamespaces={inference,batch}",
    ],
    "cert-manager": ["--set", "webhook.certManager.enabled=true", "--set", "image.tag=0.1.0-rc1"],
}


def test_lints_strictly() -> None:
    helm("lint", "--strict", str(CHART))


@pytest.mark.parametrize("values", list(VALUE_SETS), ids=list(VALUE_SETS))
def test_renders_valid_objects(values: str) -> None:
    objects = render(*VALUE_SETS[values])
    kinds = {o["kind"] for o in objects}
    assert {
        "CustomResourceDefinition",
        "Deployment",
        "ClusterRole",
        "ClusterRoleBinding",
        "MutatingWebhookConfiguration",
        "Service",
        "ServiceAccount",
    } <= kinds
    for obj in objects:
        if obj["kind"] in FOREIGN:
            assert obj["apiVersion"].split("/")[0] in {"monitoring.coreos.com", "cert-manager.io"}
            continue
        kubernetes_validate.validate(obj, "1.33", strict=True)


def test_crds_come_from_the_single_source() -> None:
    crds = [o for o in render() if o["kind"] == "CustomResourceDefinition"]
    source = [yaml.safe_load(p.read_text()) for p in sorted((REPO / "crds").glob("*.yaml"))]
    assert sorted(crds, key=lambda c: c["metadata"]["name"]) == sorted(
        source, key=lambda c: c["metadata"]["name"]
    )


def by_kind(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    """The object of a kind (the first, or the one of that name)."""
    return next(o for o in objects if o["kind"] == kind and name in (None, o["metadata"]["name"]))


def test_rbac_is_least_privilege() -> None:
    role = by_kind(render(), "ClusterRole", "kv-kvtier")
    for rule in role["rules"]:
        assert "*" not in rule["verbs"] and "*" not in rule["resources"]
        # It deletes only the NFS PersistentVolumes it made (no owner can collect them).
        assert "delete" not in rule["verbs"] or rule["resources"] == ["persistentvolumes"]
    secrets = [r for r in role["rules"] if "secrets" in r["resources"]]
    # Secrets are only created (a peer tier's CURVE keys, of the one shape the chart's
    # admission policy admits: test_chart_access.py), never read, listed, watched, updated
    # or deleted.
    assert secrets and all(set(r["verbs"]) == {"create"} for r in secrets)
    csi = by_kind(render(), "ClusterRole", "kv-kvtier-csi")
    assert csi["rules"] == [
        {"apiGroups": ["kvtier.io"], "resources": ["kvcachetiers"], "verbs": ["get", "list"]}
    ]


def test_only_the_csi_plugin_is_privileged() -> None:
    """The CSI node plugin is the one privileged pod (the release namespace's Pod Security
    level is `privileged` for it); the operator's pod meets `restricted`."""
    from tests.pod_security import restricted

    objects = render()
    driver = by_kind(objects, "CSIDriver", "csi.kvtier.io")["spec"]
    assert driver == {
        "attachRequired": False,
        "podInfoOnMount": True,
        "volumeLifecycleModes": ["Ephemeral"],
        "fsGroupPolicy": "None",
    }
    plugin = by_kind(objects, "DaemonSet", "kv-kvtier-csi")["spec"]["template"]["spec"]
    names = [c["name"] for c in plugin["containers"]]
    assert names == ["plugin", "node-driver-registrar"]
    assert plugin["containers"][0]["securityContext"]["privileged"] is True
    mounts = {m["name"]: m for m in plugin["containers"][0]["volumeMounts"]}
    assert mounts["pods-dir"]["mountPropagation"] == "Bidirectional"
    operator = by_kind(objects, "Deployment")["spec"]["template"]["spec"]
    assert restricted(operator) == []
    privileged = [
        o["metadata"]["name"]
        for o in objects
        if o["kind"] in {"Deployment", "DaemonSet"}
        and any(
            (c.get("securityContext") or {}).get("privileged")
            for c in o["spec"]["template"]["spec"]["containers"]
        )
    ]
    assert privileged == ["kv-kvtier-csi"]


def test_webhook_never_blocks_pods_and_has_a_ca() -> None:
    objects = render()
    (hook,) = by_kind(objects, "MutatingWebhookConfiguration")["webhooks"]
    assert hook["failurePolicy"] == "Ignore" and hook["timeoutSeconds"] <= 10
    assert hook["clientConfig"]["service"]["path"] == "/kvtier-inject"
    assert hook["clientConfig"]["caBundle"]
    assert hook["rules"][0]["operations"] == ["CREATE"]
    secret = by_kind(objects, "Secret")
    assert secret["type"] == "kubernetes.io/tls"
    with_cm = render(*VALUE_SETS["cert-manager"])
    assert (
        "cert-manager.io/inject-ca-from"
        in by_kind(with_cm, "MutatingWebhookConfiguration")["metadata"]["annotations"]
    )


def test_operator_runs_unprivileged_with_its_settings() -> None:
    deployment = by_kind(render(*VALUE_SETS["ha-monitoring"]), "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["securityContext"]["privileged"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["KVTIER_PEERING"] and deployment["spec"]["replicas"] == 2
    assert "--namespace=inference" in container["args"]


def test_dashboard_charts_the_agents_metrics() -> None:
    config_map = next(
        o
        for o in render(*VALUE_SETS["ha-monitoring"])
        if o["kind"] == "ConfigMap" and "dashboard" in o["metadata"]["name"]
    )
    dashboard = json.loads(config_map["data"]["kvtier.json"])
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p["targets"])
    assert all(metric in exprs for metric in METRICS)


@pytest.mark.parametrize(
    ("value", "named"),
    [
        ("operator.replicas=0", "replicas"),
        ("operator.replicas=100000000", "replicas"),
        ("image.tag=bad tag", "tag"),
        ("operator.watchNamespaces[0]=Inference", "watchNamespaces"),
        ("serviceAccount.name=BadName", "name"),
        ("webhook.port=8080", "port"),
        ("operator.heartbeatTimeoutSeconds=1", "heartbeatTimeoutSeconds"),
        ("security.allowedRegistries[0]=registry.corp.example", "allowedRegistries"),
        ("csi.legacyPoolDir=/", "legacyPoolDir"),
        ("csi.legacyPoolDir=/var/lib/kubelet", "legacyPoolDir"),
    ],
)
def test_bad_values_are_refused_by_the_schema(value: str, named: str) -> None:
    """Each rendered before, into a pod the API server refuses, one that fails at run time
    (an image reference with a space, a webhook on the health port), an operator watching a
    namespace that cannot exist, a registry prefix that also matches other hosts, or a
    legacy directory the privileged plugin would empty."""
    proc = subprocess.run(
        [HELM, "template", "kv", str(CHART), "--set", value],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0 and named in proc.stderr


def test_a_large_agent_uid_from_a_values_file_renders_as_an_integer(tmp_path: Path) -> None:
    """Numbers in a values file are floats to Helm: 1000710000 (an OpenShift-style uid)
    rendered as 1.00071e+09, which the CSI plugin's --agent-uid and the operator's
    KVTIER_AGENT_UID refuse, crash-looping both."""
    values = tmp_path / "v.yaml"
    values.write_text("security:\n  agentUid: 1000710000\n")
    text = json.dumps(render("-f", str(values)))
    assert "--agent-uid=1000710000" in text
    assert '"name": "KVTIER_AGENT_UID", "value": "1000710000"' in text
    assert "e+09" not in text


def test_examples_are_admitted_and_render_agent_configs() -> None:
    from kvtier.operator.builders import build_agent_config
    from kvtier.operator.settings import OperatorSettings
    from tests.apiserver_rules import admit, load_crd

    examples = sorted((REPO / "examples").glob("*.yaml"))
    assert len(examples) >= 4
    for path in examples:
        resource = yaml.safe_load(path.read_text())
        resource["metadata"].setdefault("namespace", "inference")
        stored, errors = admit(load_crd("kvcachetier.yaml"), resource)
        assert errors == [], (path.name, errors)
        stored["metadata"]["uid"] = "x"
        config = build_agent_config(stored, OperatorSettings())
        assert parse_config(yaml.safe_load(config.to_yaml())) == config


def test_a_webhook_certificate_made_anew_rolls_the_operator() -> None:
    """The operator loads its webhook certificate once, at start: an upgrade that made a new
    CA (no kept Secret to reuse: a first install, or a render without a cluster, as here)
    changed the webhook's caBundle while the operator kept serving the old certificate, and
    with failurePolicy Ignore pods were then made without the connector. Each such render now
    changes the operator's pod template; the Secret carries its CA, which an upgrade against
    a cluster reuses (Helm's `lookup`, which only a real cluster answers)."""
    first, second = render(), render()

    def parts(objects: list[dict[str, Any]]) -> tuple[str, str, str]:
        secret = next(
            o for o in objects if o["kind"] == "Secret" and "webhook" in o["metadata"]["name"]
        )
        hook = next(o for o in objects if o["kind"] == "MutatingWebhookConfiguration")
        deployment = next(o for o in objects if o["kind"] == "Deployment")
        annotations = deployment["spec"]["template"]["metadata"]["annotations"]
        return (
            secret["data"]["ca.crt"],
            hook["webhooks"][0]["clientConfig"]["caBundle"],
            annotations["kvtier.io/webhook-cert"],
        )

    (ca1, bundle1, roll1), (ca2, bundle2, roll2) = parts(first), parts(second)
    assert ca1 == bundle1 and ca2 == bundle2 and ca1 != ca2
    assert roll1 != roll2
    managed = render("--set", "webhook.certManager.enabled=true")
    deployment = next(o for o in managed if o["kind"] == "Deployment")
    assert "kvtier.io/webhook-cert" not in deployment["spec"]["template"]["metadata"].get(
        "annotations", {}
    )


def test_a_release_name_as_long_as_helm_allows_makes_names_that_fit() -> None:
    """Helm allows release names of 53 characters; the names were truncated to 63 before
    their suffixes, so from 47 the uninstall Job's name (which the hook needs) and from 49
    the webhook's Service were longer than the API server takes."""
    text = helm("template", "r" * 53, str(CHART), "--namespace", "kvtier-system")
    for obj in (d for d in yaml.safe_load_all(text) if d):
        name = obj["metadata"]["name"]
        if obj["kind"] in ("Service", "Job", "Deployment", "DaemonSet", "ServiceAccount"):
            assert len(name) <= 63, (obj["kind"], name)
