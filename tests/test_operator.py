"""The operator's status and validation work, with `kvtier operator` (kopf) as its own process
against the emulated API server (kube_api.py): many nodes' reports aggregated at a bounded
write rate, what only the operator can check, events. The scenarios a user runs against a
cluster (children, repair, webhook, a real agent reporting) are the conformance suite,
e2e/test_cluster.py, which runs against a real cluster when KUBECONFIG names one."""

from __future__ import annotations

import copy
import datetime as dt
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.kube_api import KubeAPI
from tests.operator_process import running_operator, wait_for

NS = "inference"
TIERS = f"/apis/kvtier.io/v1alpha1/namespaces/{NS}/kvcachetiers"
NODES = f"/apis/kvtier.io/v1alpha1/namespaces/{NS}/kvcachenodes"
DAEMONSET = f"/apis/apps/v1/namespaces/{NS}/daemonsets/kvtier-llama"
CONFIGMAP = f"/api/v1/namespaces/{NS}/configmaps/kvtier-llama"
TIER: dict[str, Any] = {
    "apiVersion": "kvtier.io/v1alpha1",
    "kind": "KVCacheTier",
    "metadata": {"name": "llama", "namespace": NS},
    "spec": {
        "podSelector": {"matchLabels": {"app": "vllm"}},
        "targetContainer": "vllm",
        "host": {
            "capacity": "8Gi",
            "chunkSize": "2Mi",
            "policy": "lru",
        },
        "vllm": {"cpuBytes": "4Gi", "timeoutSeconds": 2},
    },
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[KubeAPI, int]]:
    directory = tmp_path_factory.mktemp("kube")
    with KubeAPI(directory) as api, running_operator(api.kubeconfig, directory) as port:
        yield api, port


def get(api: KubeAPI, path: str) -> dict[str, Any] | None:
    status, body = api.request("GET", path)
    return body if status == 200 else None


@pytest.fixture(scope="module")
def tier(cluster: tuple[KubeAPI, int]) -> dict[str, Any]:
    api, _ = cluster
    status, body = api.request("POST", TIERS, copy.deepcopy(TIER))
    assert status in (200, 201)
    return dict(body)


def node_report(name: str, beat: dt.datetime, used: int) -> dict[str, Any]:
    return {
        "apiVersion": "kvtier.io/v1alpha1",
        "kind": "KVCacheNode",
        "metadata": {"name": f"llama-{name}", "namespace": NS},
        "spec": {"tier": "llama", "node": name},
        "status": {
            "heartbeat": beat.strftime("%Y-%m-%dT%H:%M:%SZ"),
            "lookups": 100,
            "hits": 80,
            "fingerprints": ["llama-3-8b-0a1b2c3d4e5f"],
            "tiers": [{"name": "host", "usedBytes": used, "capacityBytes": 8 << 30}],
        },
    }


def tier_status(api: KubeAPI) -> dict[str, Any]:
    return tier_status_of(api, "llama")


def tier_status_of(api: KubeAPI, name: str) -> dict[str, Any]:
    body = get(api, f"{TIERS}/{name}")
    return dict((body or {}).get("status") or {})


def test_agent_reports_become_status_and_columns(
    cluster: tuple[KubeAPI, int], tier: dict[str, Any]
) -> None:
    api, _ = cluster
    wait_for(lambda: get(api, DAEMONSET))
    # The DaemonSet controller's part: how many nodes should run an agent.
    api.request(
        "PATCH",
        f"{DAEMONSET}/status",
        {
            "status": {
                "desiredNumberScheduled": 2,
                "currentNumberScheduled": 2,
                "numberMisscheduled": 0,
                "numberReady": 0,
            }
        },
        "application/merge-patch+json",
    )
    now = dt.datetime.now(dt.UTC)
    for i in range(2):
        api.create(NODES, node_report(f"gpu-{i}", now, 1 << 30))
    status = wait_for(lambda: (s := tier_status(api)).get("nodes", {}).get("ready") == 2 and s)
    assert status["nodes"] == {"desired": 2, "ready": 2}
    assert status["summary"]["host"] == "2.0 GiB/16.0 GiB"
    assert status["summary"]["hitRate"] == "80%"
    conditions = {c["type"]: c["status"] for c in status["conditions"]}
    assert conditions["AgentsReady"] == "True" and conditions["Ready"] == "True"


def test_config_only_the_operator_can_check_is_reported(
    cluster: tuple[KubeAPI, int], tier: dict[str, Any]
) -> None:
    api, _ = cluster
    ds_before = wait_for(lambda: get(api, DAEMONSET))
    api.request(
        "PATCH",
        f"{TIERS}/llama",
        {"spec": {"host": {"capacity": "1Mi"}}},
        "application/merge-patch+json",
    )

    def invalid() -> dict[str, Any] | None:
        conditions = {c["type"]: c for c in tier_status(api).get("conditions", [])}
        valid = conditions.get("ConfigValid", {})
        return valid if valid.get("status") == "False" else None

    condition = wait_for(invalid)
    assert "host.chunkBytes" in condition["message"] and "host.capacity" in condition["message"]
    ds_after = get(api, DAEMONSET)
    assert ds_after is not None and ds_after["spec"] == ds_before["spec"]  # agents keep running
    api.request(
        "PATCH",
        f"{TIERS}/llama",
        {"spec": {"host": {"capacity": "16Gi"}}},
        "application/merge-patch+json",
    )
    wait_for(lambda: invalid() is None)


def test_node_reports_do_not_mean_one_status_write_each(
    cluster: tuple[KubeAPI, int], tier: dict[str, Any]
) -> None:
    api, _ = cluster
    wait_for(lambda: tier_status(api).get("nodes"))
    updates_before = len(api.emulator.updates)
    started = time.monotonic()
    now = dt.datetime.now(dt.UTC)
    # 200 here (the emulator slows down with many objects); the pure aggregation of 1,000
    # reports is in test_operator_builders.py.
    for i in range(200):
        api.create(NODES, node_report(f"n{i:04d}", now, 1 << 20))
    wait_for(lambda: tier_status(api).get("lookups", 0) >= 200 * 100, timeout=60)
    elapsed = time.monotonic() - started
    writes = [u for u in api.emulator.updates[updates_before:] if u == ("kvcachetiers", "llama")]
    # One status write per interval (1 s here) at most, plus the reconcile timer's own.
    assert len(writes) <= 2 * (elapsed + 2) < 200, (len(writes), elapsed)


def test_missing_claim_is_reported_with_an_event_and_nothing_created(
    cluster: tuple[KubeAPI, int], tier: dict[str, Any]
) -> None:
    api, _ = cluster
    broken = copy.deepcopy(TIER)
    broken["metadata"]["name"] = "broken"
    broken["spec"]["tiers"] = [
        {"name": "fs", "filesystem": {"pvc": {"claimName": "no-such-claim"}, "capacity": "1Ti"}}
    ]
    assert api.request("POST", TIERS, broken)[0] in (200, 201)

    def invalid() -> dict[str, Any] | None:
        body = get(api, f"{TIERS}/broken") or {}
        conditions = {c["type"]: c for c in (body.get("status") or {}).get("conditions", [])}
        return (
            conditions.get("ConfigValid")
            if conditions.get("ConfigValid", {}).get("status") == "False"
            else None
        )

    condition = wait_for(invalid)
    assert condition["message"].startswith("spec.tiers[0].filesystem.pvc:")
    assert "no-such-claim" in condition["message"]
    assert get(api, f"/apis/apps/v1/namespaces/{NS}/daemonsets/kvtier-broken") is None

    def warned() -> bool:
        events = (get(api, f"/api/v1/namespaces/{NS}/events") or {}).get("items", [])
        return any(
            e.get("reason") == "ConfigValidFalse"
            and e.get("involvedObject", {}).get("name") == "broken"
            for e in events
        )

    wait_for(warned)


def test_a_named_secret_is_not_read_by_the_operator(
    cluster: tuple[KubeAPI, int], tier: dict[str, Any]
) -> None:
    """The operator may not read Secrets (charts/kvtier/templates/rbac.yaml): a tier naming
    one that does not exist gets its agents, whose pods then fail to mount it, which the
    agents' condition reports, not ConfigValid."""
    api, _ = cluster
    s3 = copy.deepcopy(TIER)
    s3["metadata"]["name"] = "s3"
    s3["spec"]["tiers"] = [
        {
            "name": "s3",
            "objectStore": {
                "bucket": "kv-cache",
                "capacity": "1Ti",
                "credentialsSecret": {"name": "no-such-secret"},
            },
        }
    ]
    assert api.request("POST", TIERS, s3)[0] in (200, 201)
    daemonset = wait_for(lambda: get(api, f"/apis/apps/v1/namespaces/{NS}/daemonsets/kvtier-s3"))
    volumes = daemonset["spec"]["template"]["spec"]["volumes"]
    assert any((v.get("secret") or {}).get("secretName") == "no-such-secret" for v in volumes)

    def config_valid() -> dict[str, Any] | None:
        conditions = {c["type"]: c for c in tier_status_of(api, "s3").get("conditions", [])}
        return conditions.get("ConfigValid")

    assert wait_for(config_valid)["status"] == "True"


def test_injected_pods_are_counted(cluster: tuple[KubeAPI, int], tier: dict[str, Any]) -> None:
    api, _ = cluster
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "llama-1",
            "namespace": NS,
            "annotations": {"kvtier.io/tier": "llama", "kvtier.io/injected": "{}"},
        },
        "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.33.0"}]},
    }
    assert api.request("POST", f"/api/v1/namespaces/{NS}/pods", pod)[0] in (200, 201)
    wait_for(lambda: tier_status(api).get("injectedPods") == 1)
