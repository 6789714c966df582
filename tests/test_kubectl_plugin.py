"""`kubectl kvtier` against a stateful API server on loopback, as a user runs it."""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.kube_api import KubeAPI

NS = "inference"
GROUP = "/apis/kvtier.io/v1alpha1"
# gpu-a's KV event stream as its agent reports it in its KVCacheNode (gpu-b has none)
EVENTS = {
    "endpoint": "tcp://10.0.0.5:5558",
    "replayEndpoint": "tcp://10.0.0.5:5559",
    "topic": "kv@gpu-a@inference",
}


def stamp(seconds_ago: float) -> str:
    when = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=seconds_ago)
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeAPI]:
    with KubeAPI(tmp_path_factory.mktemp("kubectl")) as api:
        tier = {
            "apiVersion": "kvtier.io/v1alpha1",
            "kind": "KVCacheTier",
            "metadata": {"name": "llama", "namespace": NS},
            "spec": {"podSelector": {"matchLabels": {"app": "vllm"}}, "host": {"capacity": "8Gi"}},
            "status": {
                "conditions": [
                    {"type": "ConfigValid", "status": "True"},
                    {
                        "type": "FingerprintConflict",
                        "status": "True",
                        "message": "engines of llama-3-8b run with different settings",
                    },
                ]
            },
        }
        api.create(f"{GROUP}/namespaces/{NS}/kvcachetiers", tier)
        for node, ago in (("gpu-a", 5), ("gpu-b", 600)):
            api.create(
                f"{GROUP}/namespaces/{NS}/kvcachenodes",
                {
                    "apiVersion": "kvtier.io/v1alpha1",
                    "kind": "KVCacheNode",
                    "metadata": {"name": f"llama-{node}", "namespace": NS},
                    "spec": {"tier": "llama", "node": node},
                    "status": {
                        "heartbeat": stamp(ago),
                        "lookups": 10,
                        "hits": 4,
                        "peers": ["gpu-b"],
                        "fingerprints": ["llama-3-8b-aaaa1111"],
                        "tiers": [{"name": "host", "usedBytes": 1 << 30, "capacityBytes": 8 << 30}],
                        **({"events": EVENTS} if node == "gpu-a" else {}),
                    },
                },
            )
        pods = [
            (
                "injected-a",
                "gpu-a",
                {"kvtier.io/tier": "llama", "kvtier.io/injected": "{}"},
                "vllm",
            ),
            (
                "injected-b",
                "gpu-b",
                {"kvtier.io/tier": "llama", "kvtier.io/injected": "{}"},
                "vllm",
            ),
            (
                "skipped",
                "gpu-a",
                {"kvtier.io/tier": "llama", "kvtier.io/skipped": "the command is a shell string"},
                "vllm",
            ),
            ("unselected", "gpu-a", {}, "web"),
        ]
        for name, node, annotations, app in pods:
            api.request(
                "POST",
                f"/api/v1/namespaces/{NS}/pods",
                {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {
                        "name": name,
                        "namespace": NS,
                        "labels": {"app": app},
                        "annotations": annotations,
                    },
                    "spec": {"nodeName": node, "containers": [{"name": "vllm", "image": "x"}]},
                },
            )
        yield api


def run_kubectl_kvtier(api: KubeAPI, *args: str) -> str:
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "kubectl-kvtier"), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "KUBECONFIG": str(api.kubeconfig)},
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def kubectl_kvtier(api: KubeAPI, *args: str) -> dict[str, Any]:
    return dict(json.loads(run_kubectl_kvtier(api, *args, "--json")))


def test_status_per_node_and_tier(api: KubeAPI) -> None:
    report = kubectl_kvtier(api, "status", "-n", NS)
    (tier,) = report["tiers"]
    assert tier["conditions"]["FingerprintConflict"] == "True"
    agents = {a["node"]: a for a in tier["agents"]}
    assert agents["gpu-a"]["ready"] is True and agents["gpu-b"]["ready"] is False
    assert agents["gpu-a"]["hitRate"] == 0.4
    assert agents["gpu-a"]["tiers"][0]["usedBytes"] == 1 << 30
    assert kubectl_kvtier(api, "status", "-A")["tiers"][0]["name"] == "llama"
    assert agents["gpu-a"]["events"] == EVENTS and agents["gpu-b"]["events"] is None


def test_status_table_says_where_routers_subscribe(api: KubeAPI) -> None:
    table = run_kubectl_kvtier(api, "status", "-n", NS)
    lines = [line for line in table.splitlines() if "KV events of" in line]
    assert lines == [
        "  KV events of gpu-a: tcp://10.0.0.5:5558 (replay tcp://10.0.0.5:5559, "
        "topic 'kv@gpu-a@inference')"
    ]


@pytest.mark.parametrize(
    ("pod", "expected"),
    [
        ("skipped", "not injected: the command is a shell string"),
        ("unselected", "no KVCacheTier in inference selects"),
        ("injected-a", "fingerprint mismatch"),
        ("injected-b", "agent down: the agent on gpu-b has not reported"),
        ("missing", "not found"),
    ],
)
def test_explain_miss(api: KubeAPI, pod: str, expected: str) -> None:
    result = kubectl_kvtier(api, "explain-miss", pod, "-n", NS)
    assert any(expected in reason for reason in result["reasons"]), result


def test_status_names_the_node_and_reason_of_an_agent_that_never_reported(api: KubeAPI) -> None:
    """An unschedulable agent writes no KVCacheNode: the row comes from the operator's
    status.agents, with the scheduler's reason, not an empty table."""
    namespace = "edge"
    message = (
        "0/1 nodes are available: 1 Insufficient memory "
        "(agent requests 64.7Gi: host.capacity 64Gi + 512Mi + page tables 128Mi + "
        "79.84Mi for 32,704 chunks (lru))"
    )
    agents_ready = f"1/1 agents not running: node-a: Unschedulable: {message}"
    api.create(
        f"{GROUP}/namespaces/{namespace}/kvcachetiers",
        {
            "apiVersion": "kvtier.io/v1alpha1",
            "kind": "KVCacheTier",
            "metadata": {"name": "small", "namespace": namespace},
            "spec": {"podSelector": {"matchLabels": {"app": "vllm"}}, "host": {"capacity": "64Gi"}},
            "status": {
                "conditions": [
                    {
                        "type": "AgentsReady",
                        "status": "False",
                        "reason": "Unschedulable",
                        "message": agents_ready,
                    }
                ],
                "agents": [
                    {
                        "node": "node-a",
                        "pod": "kvtier-small-x7k2p",
                        "phase": "Pending",
                        "reason": "Unschedulable",
                        "message": message,
                    }
                ],
            },
        },
    )
    (tier,) = kubectl_kvtier(api, "status", "-n", namespace)["tiers"]
    (agent,) = tier["agents"]
    assert agent["node"] == "node-a" and agent["ready"] is False
    assert agent["reason"] == f"Unschedulable: {message}"
    assert tier["messages"]["AgentsReady"] == agents_ready
    table = subprocess.run(
        [str(Path(sys.executable).parent / "kubectl-kvtier"), "status", "-n", namespace],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "KUBECONFIG": str(api.kubeconfig), "COLUMNS": "400"},
    )
    assert table.returncode == 0, table.stderr
    row = next(line for line in table.stdout.splitlines() if "node-a" in line and "│" in line)
    assert "Unschedulable: 0/1 nodes are available" in row
    api.request(
        "POST",
        f"/api/v1/namespaces/{namespace}/pods",
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": "vllm-0",
                "namespace": namespace,
                "labels": {"app": "vllm"},
                "annotations": {"kvtier.io/tier": "small", "kvtier.io/injected": "{}"},
            },
            "spec": {"nodeName": "node-a", "containers": [{"name": "vllm", "image": "x"}]},
        },
    )
    result = kubectl_kvtier(api, "explain-miss", "vllm-0", "-n", namespace)
    assert (
        f"agent down: the agent of small on node-a: Unschedulable: {message}" in result["reasons"]
    )
