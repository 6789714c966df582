"""The operator as it runs in a cluster: `kvtier operator` (kopf) as its own process against a
stateful Kubernetes API server on loopback (kmock's emulator, see kube_api.py). A real
cluster is exercised by e2e/test_cluster.py when KUBECONFIG names one."""

from __future__ import annotations

import base64
import copy
import datetime as dt
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonpatch
import pytest

from tests.conftest import free_port, wait_port
from tests.kube_api import KubeAPI

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
            "poolDir": "/dev/shm/kvtier",
        },
        "vllm": {"cpuBytes": "4Gi", "timeoutSeconds": 2},
    },
}


def wait_for(check: Callable[[], Any], timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[KubeAPI, int]]:
    directory = tmp_path_factory.mktemp("kube")
    with KubeAPI(directory) as api:
        webhook_port = free_port()
        env = {
            **os.environ,
            "KUBECONFIG": str(api.kubeconfig),
            "KVTIER_RECONCILE_INTERVAL_SECONDS": "1",
            "KVTIER_STATUS_INTERVAL_SECONDS": "1",
            "KVTIER_WEBHOOK_PORT": str(webhook_port),
            "KVTIER_IMAGE": "registry.local/kvtier:test",
        }
        log = open(directory / "operator.log", "w")  # noqa: SIM115
        proc = subprocess.Popen(
            [
                str(Path(sys.executable).parent / "kvtier"),
                "operator",
                "--health-port",
                str(free_port()),
            ],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=directory,
        )
        try:
            wait_port(webhook_port)
            yield api, webhook_port
        finally:
            proc.terminate()
            proc.wait(30)
            log.close()


def get(api: KubeAPI, path: str) -> dict[str, Any] | None:
    status, body = api.request("GET", path)
    return body if status == 200 else None


@pytest.fixture(scope="module")
def tier(cluster: tuple[KubeAPI, int]) -> dict[str, Any]:
    api, _ = cluster
    status, body = api.request("POST", TIERS, copy.deepcopy(TIER))
    assert status in (200, 201)
    return dict(body)


def test_children_created_and_owned(cluster: tuple[KubeAPI, int], tier: dict[str, Any]) -> None:
    api, _ = cluster
    uid = tier["metadata"]["uid"]
    for path in (
        DAEMONSET,
        CONFIGMAP,
        f"/api/v1/namespaces/{NS}/services/kvtier-llama",
        f"/api/v1/namespaces/{NS}/serviceaccounts/kvtier-llama",
        f"/apis/rbac.authorization.k8s.io/v1/namespaces/{NS}/roles/kvtier-llama",
        f"/apis/rbac.authorization.k8s.io/v1/namespaces/{NS}/rolebindings/kvtier-llama",
    ):
        child = wait_for(lambda path=path: get(api, path))
        assert child["metadata"]["ownerReferences"][0]["uid"] == uid, path
    ds = get(api, DAEMONSET)
    assert ds is not None
    assert ds["spec"]["template"]["spec"]["containers"][0]["image"] == "registry.local/kvtier:test"


def test_deleted_child_is_recreated(cluster: tuple[KubeAPI, int], tier: dict[str, Any]) -> None:
    api, _ = cluster
    wait_for(lambda: get(api, CONFIGMAP))
    assert api.request("DELETE", CONFIGMAP)[0] == 200
    assert get(api, CONFIGMAP) is None
    recreated = wait_for(lambda: get(api, CONFIGMAP))
    assert "agent.yaml" in recreated["data"]


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
    body = get(api, f"{TIERS}/llama")
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


def test_spec_change_rolls_the_daemonset(
    cluster: tuple[KubeAPI, int], tier: dict[str, Any]
) -> None:
    api, _ = cluster
    key = "kvtier.io/config-hash"
    before = wait_for(lambda: get(api, DAEMONSET))["spec"]["template"]["metadata"]["annotations"][
        key
    ]
    api.request(
        "PATCH",
        f"{TIERS}/llama",
        {"spec": {"host": {"capacity": "16Gi"}}},
        "application/merge-patch+json",
    )

    def rolled() -> bool:
        ds = get(api, DAEMONSET)
        return bool(ds) and ds["spec"]["template"]["metadata"]["annotations"][key] != before

    wait_for(rolled)


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


def admission_review(pod: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "0000-1111",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "operation": "CREATE",
            "namespace": NS,
            "name": pod["metadata"]["name"],
            "object": pod,
            "userInfo": {"username": "system:serviceaccount:x:y"},
            "dryRun": False,
        },
    }


def call_webhook(port: int, pod: dict[str, Any]) -> dict[str, Any]:
    import urllib.request

    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/kvtier-inject",
        data=json.dumps(admission_review(pod)).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=10) as resp:
        return dict(json.loads(resp.read()))


def test_webhook_injects_selected_pods_over_http(
    cluster: tuple[KubeAPI, int], tier: dict[str, Any]
) -> None:
    _, port = cluster
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "llama-0", "namespace": NS, "labels": {"app": "vllm"}},
        "spec": {
            "containers": [
                {"name": "vllm", "image": "vllm/vllm-openai:v0.33.0", "args": ["--model", "m"]}
            ]
        },
    }
    review = wait_for(lambda: (r := call_webhook(port, pod))["response"].get("patch") and r)
    assert review["response"]["allowed"] is True and review["response"]["uid"] == "0000-1111"
    patch = json.loads(base64.b64decode(review["response"]["patch"]))
    mutated = jsonpatch.apply_patch(pod, patch)
    args = mutated["spec"]["containers"][0]["args"]
    config = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert (
        config["kv_connector_extra_config"]["secondary_tiers"][0]["type"] == "KVTierSecondaryTier"
    )
    assert "kvtier.io/injected" in mutated["metadata"]["annotations"]

    other = copy.deepcopy(pod)
    other["metadata"]["labels"] = {"app": "web"}
    untouched = call_webhook(port, other)["response"]
    assert untouched["allowed"] is True and not untouched.get("patch")


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


def test_missing_secret_is_reported_with_an_event_and_nothing_created(
    cluster: tuple[KubeAPI, int], tier: dict[str, Any]
) -> None:
    api, _ = cluster
    broken = copy.deepcopy(TIER)
    broken["metadata"]["name"] = "broken"
    broken["spec"]["tiers"] = [
        {
            "name": "s3",
            "objectStore": {
                "bucket": "kv-cache",
                "capacity": "1Ti",
                "credentialsSecret": {"name": "no-such-secret"},
            },
        }
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
    assert condition["message"].startswith("spec.tiers[0].objectStore.credentialsSecret:")
    assert "no-such-secret" in condition["message"]
    assert get(api, f"/apis/apps/v1/namespaces/{NS}/daemonsets/kvtier-broken") is None

    def warned() -> bool:
        events = (get(api, f"/api/v1/namespaces/{NS}/events") or {}).get("items", [])
        return any(
            e.get("reason") == "ConfigValidFalse"
            and e.get("involvedObject", {}).get("name") == "broken"
            for e in events
        )

    wait_for(warned)


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


def test_a_real_agent_reports_itself_and_the_tier_status_counts_it(
    cluster: tuple[KubeAPI, int],
    tier: dict[str, Any],
    scratch: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvtier.agent.client import AgentClient
    from kvtier.agent.config import scratch_config
    from kvtier.agent.process import AgentProcess
    from tests.helpers import NS as CHUNKS
    from tests.helpers import key, row

    api, _ = cluster
    monkeypatch.setenv("KUBECONFIG", str(api.kubeconfig))
    config = scratch_config(
        scratch,
        "report-test",
        "4Mi",
        "64Ki",
        report={
            "target": "kubernetes",
            "namespace": NS,
            "tier": "llama",
            "node": "gpu-real",
            "intervalSeconds": 0.5,
            "minIntervalSeconds": 0.2,
        },
    )
    with AgentProcess(config), AgentClient(config.endpoint) as client:
        client.store(CHUNKS, [key(i) for i in range(5)], [row(i, 64 << 10) for i in range(5)])
        client.lookup(CHUNKS, [key(0), key(99)])

        def reported() -> dict[str, Any] | None:
            node = get(api, f"{NODES}/llama-gpu-real") or {}
            status = node.get("status") or {}
            return status if status.get("lookups") == 2 else None

        status = wait_for(reported)
    host = status["tiers"][0]
    assert host["name"] == "host" and host["chunks"] == 5 and host["usedBytes"] == 5 * (64 << 10)
    assert status["hits"] == 1 and status["fingerprints"] == [CHUNKS]
    wait_for(
        lambda: tier_status(api).get("fingerprints") and CHUNKS in tier_status(api)["fingerprints"]
    )
