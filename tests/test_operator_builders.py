"""The operator's pure parts: children built from a KVCacheTier (valid Kubernetes objects,
owned, rendering an agent config the agent accepts), status aggregation, pod injection."""

from __future__ import annotations

import copy
import datetime as dt
import json
import os
from pathlib import Path
from typing import Any

import jsonpatch
import kubernetes_validate
import pytest
import yaml

from kvtier.api.config import ConfigError, parse_config
from kvtier.api.names import tier_group
from kvtier.operator.builders import build_agent_config, build_children
from kvtier.operator.status import aggregate, merge_conditions, transitions
from kvtier.operator.webhook import INJECTED, SKIPPED, mutate_pod, selects
from tests.apiserver_rules import admit, load_crd
from tests.operator_fixtures import POD, RESOURCE, SETTINGS, by_kind, tier


def test_children_are_valid_owned_and_labelled() -> None:
    children = build_children(tier(), SETTINGS)
    assert [c["kind"] for c in children] == [
        "ConfigMap",
        "ServiceAccount",
        "Role",
        "RoleBinding",
        "Service",
        "DaemonSet",
    ]
    for child in children:
        kubernetes_validate.validate(child, "1.33", strict=True)
        assert child["metadata"]["namespace"] == "inference"
        (owner,) = child["metadata"]["ownerReferences"]
        assert owner["uid"] == "0f1e-uid" and owner["controller"] is True
        assert child["metadata"]["labels"]["kvtier.io/tier"] == "llama"


def test_configmap_holds_an_agent_config_the_agent_accepts() -> None:
    config_map = by_kind(build_children(tier(), SETTINGS))["ConfigMap"]
    config = parse_config(yaml.safe_load(config_map["data"]["agent.yaml"]))
    assert config.name == "inference-llama"
    assert str(config.run_dir) == "/var/run/kvtier/run"
    assert str(config.host.pool_dir) == "/var/run/kvtier/pool"
    assert config.host.policy == "arc" and config.host.chunk_bytes == 2 << 20
    fs, s3 = config.tiers
    assert (
        fs.filesystem is not None and str(fs.filesystem.path) == "/var/lib/kvtier/tiers/shared-fs"
    )
    assert s3.object_store is not None
    assert str(s3.object_store.credentials_dir) == "/etc/kvtier/s3/s3"
    assert s3.object_store.endpoint == "http://minio:9000"


def test_daemonset_runs_unprivileged_with_volumes_probes_and_sized_memory() -> None:
    ds = by_kind(build_children(tier(), SETTINGS))["DaemonSet"]
    pod = ds["spec"]["template"]["spec"]
    (agent,) = pod["containers"]
    assert agent["image"] == "registry.local/kvtier:test"
    assert agent["securityContext"]["privileged"] is False
    assert agent["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert not pod.get("hostNetwork") and not pod.get("hostIPC") and not pod.get("hostPID")
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["tier-shared-fs"]["persistentVolumeClaim"] == {"claimName": "kv"}
    assert volumes["s3-s3"]["secret"]["secretName"] == "s3-creds"
    assert volumes["kvtier"]["csi"] == {
        "driver": "csi.kvtier.io",
        "volumeAttributes": {"tier": "llama"},
    }
    assert "hostPath" not in json.dumps(pod) and "initContainers" not in pod
    mounts = {m["name"]: m["mountPath"] for m in agent["volumeMounts"]}
    assert mounts["kvtier"] == "/var/run/kvtier"
    assert pod["securityContext"]["supplementalGroups"] == [tier_group("inference", "llama")]
    assert agent["readinessProbe"]["httpGet"]["path"] == "/metrics"
    memory = int(agent["resources"]["requests"]["memory"])
    # the pool and its page tables (8 bytes a 4 KiB page), the overhead, and for each of
    # its 4,088 slots (2 MiB rows, each with a 4 KiB header, after the pool's 4 KiB
    # superblock) 2 KiB of arc index and 1.5 KiB of the agent's other state
    assert memory == (8 << 30) + (8 << 30) // 512 + (512 << 20) + 4088 * (2048 + 1536)
    assert memory == int(agent["resources"]["limits"]["memory"])


def test_agent_reads_its_secrets_as_kubelet_mounts_them() -> None:
    """Kubelet writes Secret files as root with the volume's defaultMode; only the pod's
    fsGroup makes them group-owned (and group-readable). So the agent's non-root uid reads
    its credentials through fsGroup = the tier's group with a group-readable mode, and the
    CSI driver's fsGroupPolicy None keeps kubelet from re-owning the tier's own directory
    (tests/test_kubelet_rules.py runs the agent that way)."""
    pod = by_kind(build_children(tier(), SETTINGS))["DaemonSet"]["spec"]["template"]["spec"]
    group = tier_group("inference", "llama")
    assert pod["securityContext"]["fsGroup"] == group
    assert pod["securityContext"]["fsGroupChangePolicy"] == "OnRootMismatch"
    secrets = [v["secret"] for v in pod["volumes"] if "secret" in v]
    assert secrets and all(
        s["defaultMode"] & 0o040 and not s["defaultMode"] & 0o007 for s in secrets
    )
    from tests.chart_render import render

    (driver,) = [o for o in render() if o["kind"] == "CSIDriver"]
    assert driver["spec"]["fsGroupPolicy"] == "None"


def test_spec_change_rolls_the_daemonset() -> None:
    before = by_kind(build_children(tier(), SETTINGS))["DaemonSet"]
    changed = tier()
    changed["spec"]["host"]["capacity"] = "16Gi"
    after = by_kind(build_children(changed, SETTINGS))["DaemonSet"]
    key = "kvtier.io/config-hash"
    assert (
        before["spec"]["template"]["metadata"]["annotations"][key]
        != (after["spec"]["template"]["metadata"]["annotations"][key])
    )
    assert by_kind(build_children(tier(), SETTINGS))["DaemonSet"] == before  # deterministic


def test_role_is_least_privilege() -> None:
    role = by_kind(build_children(tier(), SETTINGS))["Role"]
    for rule in role["rules"]:
        assert rule["apiGroups"] == ["kvtier.io"]
        assert "*" not in rule["verbs"] and "*" not in rule["resources"]
        assert "delete" not in rule["verbs"]


def test_access_log_settings_reach_the_agent() -> None:
    assert build_agent_config(tier(), SETTINGS).access_log.max_keys == 1 << 20  # CRD default
    resource = copy.deepcopy(RESOURCE)
    resource["spec"]["agent"] = {"accessLog": {"maxKeys": 5000, "sampleRate": 0.5}}
    stored, errors = admit(load_crd("kvcachetier.yaml"), resource)
    assert errors == []
    config = build_agent_config(stored, SETTINGS)
    assert (config.access_log.max_keys, config.access_log.sample_rate) == (5000, 0.5)
    resource["spec"]["agent"]["accessLog"]["sampleRate"] = 0
    assert any("sampleRate" in e for e in admit(load_crd("kvcachetier.yaml"), resource)[1])


def test_bad_config_the_schema_cannot_catch_names_the_field() -> None:
    resource = tier()
    resource["spec"]["host"] = {"capacity": "1Mi", "chunkSize": "2Mi"}
    with pytest.raises(ConfigError, match=r"host\.chunkBytes"):
        build_agent_config(resource, SETTINGS)


def node_report(
    i: int, beat: str, used: int = 100, fingerprint: str = "llama-3-8b-0a1b2c3d4e"
) -> dict[str, Any]:
    return {
        "status": {
            "heartbeat": beat,
            "lookups": 10,
            "hits": 7,
            "peers": [f"node-{(i + 1) % 3}"],
            "fingerprints": [fingerprint],
            "tiers": [
                {"name": "host", "usedBytes": used, "capacityBytes": 1000},
                {"name": "shared-fs", "usedBytes": 5, "capacityBytes": 50, "chunks": 2, "hits": 1},
            ],
        }
    }


NOW = dt.datetime(2026, 11, 29, 12, 0, 0, tzinfo=dt.UTC)
FRESH, STALE = "2026-11-29T11:59:50Z", "2026-11-29T11:50:00Z"


def test_status_aggregates_nodes_and_conditions() -> None:
    nodes = [node_report(0, FRESH), node_report(1, FRESH), node_report(2, STALE)]
    status = aggregate(nodes, desired=3, now=NOW, heartbeat_timeout=60)
    assert status["nodes"] == {"desired": 3, "ready": 2}
    assert status["host"] == {"usedBytes": 300, "capacityBytes": 3000}
    assert status["tiers"] == [
        {"name": "shared-fs", "usedBytes": 15, "capacityBytes": 150, "chunks": 6, "hits": 3}
    ]
    assert status["summary"]["hitRate"] == "70%"
    assert status["peers"] == 3
    conditions = {c["type"]: c["status"] for c in status["conditions"]}
    assert conditions == {
        "ConfigValid": "True",
        "AgentsReady": "False",
        "FingerprintConflict": "False",
        "TiersHealthy": "False",  # a desired agent without a fresh report runs no tier
        "Ready": "False",
    }


def test_fingerprint_conflict_and_config_error_are_reported() -> None:
    nodes = [node_report(0, FRESH), node_report(1, FRESH, fingerprint="llama-3-8b-ffff000011")]
    status = aggregate(
        nodes, desired=2, now=NOW, heartbeat_timeout=60, config_error="secret s3-creds not found"
    )
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["FingerprintConflict"]["status"] == "True"
    assert "llama-3-8b" in conditions["FingerprintConflict"]["message"]
    assert conditions["ConfigValid"]["message"] == "secret s3-creds not found"
    assert conditions["Ready"]["status"] == "False"


def test_conditions_keep_transition_time_and_report_changes() -> None:
    old = aggregate([node_report(0, FRESH)], 1, NOW, 60)["conditions"]
    later = NOW + dt.timedelta(minutes=5)
    same = aggregate([node_report(0, "2026-11-29T12:04:55Z")], 1, later, 60)["conditions"]
    merged = merge_conditions(old, same)
    assert all(c["lastTransitionTime"] == "2026-11-29T12:00:00Z" for c in merged)
    assert transitions(old, same) == []
    down = aggregate([node_report(0, FRESH)], 1, later, 60)["conditions"]
    assert {c["type"] for c in transitions(old, down)} == {"AgentsReady", "TiersHealthy", "Ready"}


def test_a_thousand_nodes_aggregate_in_one_pass() -> None:
    nodes = [node_report(i, FRESH, used=i) for i in range(1000)]
    status = aggregate(nodes, desired=1000, now=NOW, heartbeat_timeout=60)
    assert status["nodes"]["ready"] == 1000
    assert status["host"]["usedBytes"] == sum(range(1000))


def injected(pod: dict[str, Any]) -> dict[str, Any]:
    mutation = mutate_pod(pod, tier(), SETTINGS)
    return dict(jsonpatch.apply_patch(pod, mutation.patch))


def test_pod_gets_the_connector_mounts_plugin_and_hash_seed() -> None:
    pod = injected(copy.deepcopy(POD))
    kubernetes_validate.validate(pod, "1.33", strict=True)
    container = pod["spec"]["containers"][0]
    flag = container["args"].index("--kv-transfer-config")
    config = json.loads(container["args"][flag + 1])
    extra = config["kv_connector_extra_config"]
    assert config["kv_connector"] == "OffloadingConnector"
    assert extra["secondary_tiers"][0]["agent"] == "ipc:///var/run/kvtier/run/agent.sock"
    assert extra["cpu_bytes_to_use"] == 4 << 30 and extra["canonical_layout"] is True
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["PYTHONPATH"] == "/opt/kvtier-plugin:/app" and env["PYTHONHASHSEED"] == "0"
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert {"/var/run/kvtier", "/opt/kvtier-plugin"} <= mounts
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["kvtier"]["csi"]["volumeAttributes"] == {"tier": "llama"}
    assert "hostPath" not in json.dumps(pod)
    assert pod["spec"]["securityContext"]["supplementalGroups"] == [
        tier_group("inference", "llama")
    ]
    (init,) = pod["spec"]["initContainers"]
    assert init["image"] == "registry.local/kvtier:test"
    assert INJECTED in pod["metadata"]["annotations"]
    assert not pod["spec"].get("hostIPC") and not pod["spec"].get("hostNetwork")
    assert "privileged" not in json.dumps(pod)


def test_namespace_isolation_scopes_the_plugin() -> None:
    isolated = tier()
    isolated["spec"]["isolation"] = "namespace"
    pod = jsonpatch.apply_patch(copy.deepcopy(POD), mutate_pod(POD, isolated, SETTINGS).patch)
    args = pod["spec"]["containers"][0]["args"]
    config = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert config["kv_connector_extra_config"]["secondary_tiers"][0]["scope"] == "inference"
    shared = injected(copy.deepcopy(POD))["spec"]["containers"][0]["args"]
    assert "scope" not in json.loads(shared[-1])["kv_connector_extra_config"]["secondary_tiers"][0]


def test_injection_is_idempotent() -> None:
    once = injected(copy.deepcopy(POD))
    assert mutate_pod(once, tier(), SETTINGS).patch == []


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"args": ["--kv-transfer-config", "{}"]}, "already sets --kv-transfer-config"),
        ({"command": ["sh", "-c", "vllm serve x"], "args": []}, "shell string"),
        ({"name": "sidecar"}, "no container named 'vllm'"),
    ],
)
def test_pods_that_cannot_be_injected_are_annotated_with_why(
    change: dict[str, Any], reason: str
) -> None:
    pod = copy.deepcopy(POD)
    pod["spec"]["containers"][0].update(change)
    mutation = mutate_pod(pod, tier(), SETTINGS)
    assert not mutation.injected and reason in mutation.reason
    result = jsonpatch.apply_patch(pod, mutation.patch)
    assert reason in result["metadata"]["annotations"][SKIPPED]


def test_label_selectors() -> None:
    assert selects({"matchLabels": {"app": "vllm"}}, {"app": "vllm", "x": "y"})
    assert not selects({"matchLabels": {"app": "vllm"}}, {"app": "web"})
    expr = {
        "matchExpressions": [
            {"key": "tier", "operator": "In", "values": ["a", "b"]},
            {"key": "off", "operator": "DoesNotExist"},
        ]
    }
    assert selects(expr, {"tier": "a"}) and not selects(expr, {"tier": "a", "off": "1"})


GOLDEN = Path(__file__).resolve().parent / "golden" / "llama-children.yaml"


def test_children_match_the_golden_manifests() -> None:
    """Any change to what the operator creates shows up as a reviewable diff of this file
    (regenerate with KVTIER_UPDATE_GOLDEN=1)."""
    rendered = yaml.safe_dump_all(build_children(tier(), SETTINGS), sort_keys=True)
    if os.environ.get("KVTIER_UPDATE_GOLDEN"):
        GOLDEN.write_text(rendered)
    assert rendered == GOLDEN.read_text()


def test_peer_tier_gets_its_port_keys_and_address() -> None:
    resource = tier()
    resource["spec"]["tiers"] = [
        {"name": "peers", "peer": {"port": 6000, "curveKeySecret": {"name": "kv-curve"}}}
    ]
    children = build_children(resource, SETTINGS)
    config = parse_config(yaml.safe_load(by_kind(children)["ConfigMap"]["data"]["agent.yaml"]))
    (peer,) = config.tiers
    assert peer.peer is not None and peer.peer.bind == "tcp://0.0.0.0:6000"
    assert str(peer.peer.curve_key_dir) == "/etc/kvtier/curve/peers"
    assert config.report.target == "kubernetes"
    pod = by_kind(children)["DaemonSet"]["spec"]["template"]["spec"]
    assert {"name": "peer", "containerPort": 6000} in pod["containers"][0]["ports"]
    assert {e["name"] for e in pod["containers"][0]["env"]} >= {"NODE_NAME", "POD_IP"}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["curve-peers"]["secret"]["secretName"] == "kv-curve"
    kubernetes_validate.validate(by_kind(children)["DaemonSet"], "1.33", strict=True)


@pytest.mark.parametrize(
    ("transports", "data_path"),
    [
        (None, "auto"),
        (["nixl", "tcp", "zmq"], "auto"),
        (["nixl", "zmq"], "auto"),  # as stored before tcp existed: the stream too
        (["zmq", "nixl"], "auto"),
        (["nixl"], "nixl"),
        (["tcp"], "tcp"),
        (["zmq", "tcp"], "tcp"),
        (["zmq"], "zmq"),
    ],
)
def test_peer_transports_choose_the_agents_data_path(
    transports: list[str] | None, data_path: str
) -> None:
    resource = tier()
    peer: dict[str, Any] = {"maxLentChunks": 32}
    if transports is not None:
        peer["transports"] = transports
    resource["spec"]["tiers"] = [{"name": "peers", "peer": peer}]
    config = parse_config(
        yaml.safe_load(
            by_kind(build_children(resource, SETTINGS))["ConfigMap"]["data"]["agent.yaml"]
        )
    )
    assert config.tiers[0].peer is not None
    assert config.tiers[0].peer.data_path == data_path
    assert config.tiers[0].peer.max_lent_chunks == 32
    # the stream listens on its own port, which the pod declares, unless only ZMQ frames
    # are allowed
    ports = by_kind(build_children(resource, SETTINGS))["DaemonSet"]["spec"]["template"]["spec"]
    declared = {p["name"]: p["containerPort"] for p in ports["containers"][0]["ports"]}
    stream = None if data_path == "zmq" else 5560
    assert config.tiers[0].peer.stream_port == stream
    assert declared.get("peer-data") == stream


@pytest.mark.parametrize("encrypt", [None, False, True])
def test_encrypt_bytes_reaches_the_agents(encrypt: bool | None) -> None:
    """`peer.encryptBytes` turns the stream's encryption on in every agent's config; unset
    or false, chunks travel in the clear, each authenticated."""
    resource = tier()
    peer: dict[str, Any] = {} if encrypt is None else {"encryptBytes": encrypt}
    resource["spec"]["tiers"] = [{"name": "peers", "peer": peer}]
    config = parse_config(
        yaml.safe_load(
            by_kind(build_children(resource, SETTINGS))["ConfigMap"]["data"]["agent.yaml"]
        )
    )
    assert config.tiers[0].peer is not None
    assert config.tiers[0].peer.encrypt_bytes is bool(encrypt)


def test_observed_generation_is_the_generation_last_reconciled() -> None:
    """API conventions: status.observedGeneration (and each condition's) names the spec the
    operator acted on; a spec changed since is not yet observed."""
    from kvtier.operator.control import State, next_status

    state = State(SETTINGS)
    tier = {"metadata": {"namespace": "ns", "name": "t", "generation": 4}, "spec": {}}
    tier["status"] = {"observedGeneration": 3}
    now = dt.datetime.now(dt.UTC)
    status, _ = next_status(state, tier, [], 0, now)
    assert status is not None and status["observedGeneration"] == 3
    state.observed[("ns", "t")] = 4
    status, _ = next_status(state, tier, [], 0, now)
    assert status is not None and status["observedGeneration"] == 4
    assert {c["observedGeneration"] for c in status["conditions"]} == {4}
