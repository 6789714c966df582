"""Why a tier is not ready, end to end through `kvtier operator` against the emulated API
server: agent pods made Pending/Unschedulable, crash-looping, or stuck in ContainerCreating
on a missing Secret (the reason only in a kubelet event) show up in the tier's AgentsReady
condition, status.agents and an event; host.capacity beyond every selected node's
allocatable memory is a Warning event while ConfigValid stays True. The pods, events and
nodes are written as the scheduler and kubelet write them (pod_states.py)."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest

from kvtier.api.names import labels
from tests.kube_api import KubeAPI
from tests.operator_process import running_operator, wait_for
from tests.pod_states import (
    MISSING_SECRET,
    S3_ERROR,
    crash_looping,
    creating,
    event,
    node,
    unschedulable,
)

NS = "inference"
TIER = "small"
TIERS = f"/apis/kvtier.io/v1alpha1/namespaces/{NS}/kvcachetiers"
DAEMONSET = f"/apis/apps/v1/namespaces/{NS}/daemonsets/kvtier-{TIER}"
PODS = f"/api/v1/namespaces/{NS}/pods"
EVENTS = f"/api/v1/namespaces/{NS}/events"
POD = f"kvtier-{TIER}-x7k2p"
RESOURCE: dict[str, Any] = {
    "apiVersion": "kvtier.io/v1alpha1",
    "kind": "KVCacheTier",
    "metadata": {"name": TIER, "namespace": NS},
    "spec": {
        "nodeSelector": {"pool": "gpu"},
        "podSelector": {"matchLabels": {"app": "vllm"}},
        "host": {"capacity": "64Gi", "chunkSize": "2Mi"},
    },
}
UNSCHEDULABLE = (
    "node-a: Unschedulable: 0/1 nodes are available: 1 Insufficient memory "
    "(agent requests 64.7Gi: host.capacity 64Gi + 512Mi + page tables 128Mi + "
    "79.84Mi for 32,704 chunks (lru))"
)


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeAPI]:
    directory = tmp_path_factory.mktemp("kube")
    with KubeAPI(directory) as api, running_operator(api.kubeconfig, directory):
        # the node of the user who saw it: 23 GiB allocatable, a 64Gi tier
        api.create("/api/v1/nodes", node("node-a", "23820416Ki", pool="gpu"))
        api.create("/api/v1/nodes", node("node-big", "512Gi"))  # not selected
        assert api.request("POST", TIERS, copy.deepcopy(RESOURCE))[0] in (200, 201)
        wait_for(lambda: get(api, DAEMONSET))
        # the DaemonSet controller's part: one node should run an agent
        ds_status = {
            "currentNumberScheduled": 1,
            "desiredNumberScheduled": 1,
            "numberMisscheduled": 0,
            "numberReady": 0,
            "observedGeneration": 1,
        }
        api.request(
            "PATCH", f"{DAEMONSET}/status", {"status": ds_status}, "application/merge-patch+json"
        )
        yield api


def get(api: KubeAPI, path: str) -> dict[str, Any] | None:
    status, body = api.request("GET", path)
    return body if status == 200 else None


def as_ours(pod: dict[str, Any]) -> dict[str, Any]:
    """The pod as the tier's DaemonSet makes it: its name and selector labels."""
    pod = copy.deepcopy(pod)
    meta = pod["metadata"]
    meta.update(name=POD, labels=labels(TIER))
    meta["ownerReferences"][0]["name"] = f"kvtier-{TIER}"
    del meta["uid"], meta["creationTimestamp"]  # the API server's
    return pod


def set_pod_status(api: KubeAPI, pod: dict[str, Any]) -> None:
    """What kubelet (or the scheduler) does: write the pod's status."""
    code, body = api.request(
        "PATCH", f"{PODS}/{POD}/status", {"status": pod["status"]}, "application/merge-patch+json"
    )
    assert code == 200, body


def agents_ready(api: KubeAPI) -> dict[str, Any]:
    status = (get(api, f"{TIERS}/{TIER}") or {}).get("status") or {}
    return next((c for c in status.get("conditions", []) if c["type"] == "AgentsReady"), {})


def tier_events(api: KubeAPI, reason: str) -> list[dict[str, Any]]:
    items = (get(api, EVENTS) or {}).get("items", [])
    return [
        e
        for e in items
        if e.get("reason") == reason and e.get("involvedObject", {}).get("name") == TIER
    ]


def test_unschedulable_agent_is_named_in_condition_status_and_event(api: KubeAPI) -> None:
    api.create(PODS, as_ours(unschedulable("node-a")))
    condition = wait_for(lambda: (c := agents_ready(api)).get("reason") == "Unschedulable" and c)
    assert condition["status"] == "False"
    assert condition["message"] == f"1/1 agents not running: {UNSCHEDULABLE}"
    status = (get(api, f"{TIERS}/{TIER}") or {})["status"]
    assert status["agents"] == [
        {
            "node": "node-a",
            "pod": POD,
            "phase": "Pending",
            "reason": "Unschedulable",
            "message": UNSCHEDULABLE.split(": Unschedulable: ")[1],
        }
    ]
    tiers_healthy = next(c for c in status["conditions"] if c["type"] == "TiersHealthy")
    assert tiers_healthy["status"] == "False"
    (warned,) = wait_for(
        lambda: [e for e in tier_events(api, "AgentsReadyFalse") if UNSCHEDULABLE in e["message"]]
    )
    assert warned["type"] == "Warning"


def test_capacity_beyond_every_selected_node_warns_and_config_stays_valid(api: KubeAPI) -> None:
    (warning,) = wait_for(lambda: tier_events(api, "CapacityExceedsNodes"))
    assert warning["type"] == "Warning"
    assert "largest 22.71Gi on node-a" in warning["message"]  # node-big is not selected
    status = (get(api, f"{TIERS}/{TIER}") or {})["status"]
    valid = next(c for c in status["conditions"] if c["type"] == "ConfigValid")
    assert valid["status"] == "True"


def test_crash_loop_shows_the_agents_last_log_line(api: KubeAPI) -> None:
    wait_for(lambda: get(api, f"{PODS}/{POD}"))
    set_pod_status(api, crash_looping("node-a"))
    condition = wait_for(lambda: (c := agents_ready(api)).get("reason") == "CrashLoopBackOff" and c)
    assert condition["message"] == f"1/1 agents not running: node-a: CrashLoopBackOff: {S3_ERROR}"
    assert wait_for(
        lambda: [e for e in tier_events(api, "AgentsReadyFalse") if S3_ERROR in e["message"]]
    )


def test_a_missing_secret_shows_through_kubelets_event(api: KubeAPI) -> None:
    """No Secret is read by the operator: a pod stuck in ContainerCreating and kubelet's
    FailedMount event about it are how a missing Secret shows."""
    pod = wait_for(lambda: get(api, f"{PODS}/{POD}"))
    set_pod_status(api, creating("node-a"))
    failed = event(pod, "FailedMount", MISSING_SECRET, "2026-11-29T11:59:00Z")
    failed["metadata"]["name"] = f"{POD}.17f3a9"
    assert api.request("POST", EVENTS, failed)[0] in (200, 201)
    expected = f"node-a: ContainerCreating: FailedMount: {MISSING_SECRET}"
    condition = wait_for(
        lambda: (c := agents_ready(api)).get("reason") == "ContainerCreating" and c
    )
    assert condition["message"] == f"1/1 agents not running: {expected}"
    status = (get(api, f"{TIERS}/{TIER}") or {})["status"]
    assert status["agents"][0]["message"] == f"FailedMount: {MISSING_SECRET}"
    assert wait_for(
        lambda: [e for e in tier_events(api, "AgentsReadyFalse") if expected in e["message"]]
    )
