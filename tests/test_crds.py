"""The CRDs: valid CustomResourceDefinitions, self-documenting, and rejecting bad input the
way the API server would (schema plus CEL rules), with the offending field named."""

from __future__ import annotations

import copy
from typing import Any

import kubernetes_validate
import pytest

from kvtier.api.pool_layout import DEFAULT_CHUNK_SIZE
from tests.apiserver_rules import admit, load_crd, schema_of
from tests.manifests import example_tier

TIER = load_crd("kvcachetier.yaml")
NODE = load_crd("kvcachenode.yaml")

GOOD = example_tier("64Gi", {"name": "peers", "peer": {}})


def with_spec(**changes: Any) -> dict[str, Any]:
    obj = copy.deepcopy(GOOD)
    obj["spec"].update(changes)
    return obj


@pytest.mark.parametrize("crd", [TIER, NODE], ids=["KVCacheTier", "KVCacheNode"])
def test_is_a_valid_crd_with_status_subresource(crd: dict[str, Any]) -> None:
    kubernetes_validate.validate(crd, "1.33", strict=True)
    version = crd["spec"]["versions"][0]
    assert crd["spec"]["group"] == "kvtier.io" and version["name"] == "v1alpha1"
    assert version["subresources"] == {"status": {}}


def test_kubectl_get_kvt_columns() -> None:
    assert "kvt" in TIER["spec"]["names"]["shortNames"]
    columns = {
        c["name"]: c["jsonPath"] for c in TIER["spec"]["versions"][0]["additionalPrinterColumns"]
    }
    assert columns == {
        "Ready": ".status.nodes.ready",
        "Desired": ".status.nodes.desired",
        "Host-Used": ".status.summary.host",
        "Hit-Rate": ".status.summary.hitRate",
        "Tiers": ".status.summary.tiers",
        "Peers": ".status.peers",
        "Age": ".metadata.creationTimestamp",
    }


@pytest.mark.parametrize("crd", [TIER, NODE], ids=["KVCacheTier", "KVCacheNode"])
def test_every_spec_field_is_described(crd: dict[str, Any]) -> None:
    """kubectl explain teaches every field."""
    missing = []

    def walk(node: dict[str, Any], path: str) -> None:
        for name, sub in node.get("properties", {}).items():
            if "description" not in sub:
                missing.append(f"{path}.{name}")
            walk(sub, f"{path}.{name}")
        if "items" in node:
            walk(node["items"], f"{path}[]")

    walk(schema_of(crd)["properties"]["spec"], "spec")
    assert missing == []


def test_good_tier_is_admitted_with_defaults() -> None:
    stored, errors = admit(TIER, GOOD)
    assert errors == []
    spec = stored["spec"]
    # the default the operator and the CSI plugin assume when a stored spec lacks one
    assert spec["host"]["chunkSize"] == DEFAULT_CHUNK_SIZE and spec["targetContainer"] == "vllm"
    assert spec["tiers"][0]["filesystem"]["lowWatermark"] == 0.8
    assert spec["tiers"][2]["peer"]["transports"] == ["nixl", "tcp", "zmq"]
    assert spec["isolation"] == "shared"


@pytest.mark.parametrize(
    ("change", "field", "words"),
    [
        ({"host": {"capacity": "-4Gi"}}, "spec.host.capacity", "does not match"),
        ({"host": {"capacity": "0"}}, "spec.host.capacity", "does not match"),
        ({"host": {"capacity": 0}}, "spec.host.capacity", "must be a positive number of bytes"),
        (
            {"host": {"capacity": "8Gi", "chunkSize": -1}},
            "spec.host.chunkSize",
            "must be a positive number of bytes",
        ),
        ({"vllm": {"cpuBytes": "4 Gi"}}, "spec.vllm.cpuBytes", "does not match"),
        (
            {"tiers": [{"name": "s3", "objectStore": {"bucket": "abc", "capacity": 0}}]},
            "spec.tiers[0].objectStore.capacity",
            "must be a positive number of bytes",
        ),
        ({"host": {"capacity": True}}, "spec.host.capacity", "is not valid under any"),
        ({"host": {"capacity": "8Gi", "policy": "fifo"}}, "spec.host.policy", "is not one of"),
        ({"host": {}}, "spec.host", "'capacity' is a required property"),
        (
            {"tiers": [{"name": "a", "peer": {}}, {"name": "a", "peer": {}}]},
            "spec.tiers",
            "tier names must be unique",
        ),
        (
            {"tiers": [{"name": "x", "peer": {}, "objectStore": {"bucket": "abc", "capacity": 1}}]},
            "spec.tiers[0]",
            "exactly one of filesystem, objectStore or peer",
        ),
        ({"tiers": [{"name": "x"}]}, "spec.tiers[0]", "exactly one of"),
        ({"tiers": [{"name": "host", "peer": {}}]}, "spec.tiers[0].name", "host-memory tier"),
        (
            {
                "tiers": [
                    {
                        "name": "fs",
                        "filesystem": {
                            "capacity": "1Ti",
                            "pvc": {"claimName": "kv"},
                            "lowWatermark": 0.95,
                        },
                    }
                ]
            },
            "spec.tiers[0].filesystem",
            "lowWatermark must be below highWatermark",
        ),
        (
            {"tiers": [{"name": "fs", "filesystem": {"capacity": "1Ti"}}]},
            "spec.tiers[0].filesystem",
            "exactly one of pvc or nfs",
        ),
        (
            {"tiers": [{"name": "p", "peer": {"port": 6000, "dataPort": 6000}}]},
            "spec.tiers[0].peer",
            "dataPort must differ from port",
        ),
        ({"tiers": [{"name": "p", "peer": {"port": 5560}}]}, "spec.tiers[0].peer", "differ"),
        (
            {"tiers": [{"name": "p", "peer": {"encryptBytes": True, "transports": ["nixl"]}}]},
            "spec.tiers[0].peer",
            "encryptBytes needs the tcp transport",
        ),
        ({"isolation": "cluster"}, "spec.isolation", "is not one of"),
    ],
)
def test_bad_tier_is_rejected_naming_the_field(
    change: dict[str, Any], field: str, words: str
) -> None:
    _stored, errors = admit(TIER, with_spec(**change))
    assert any(e.startswith(f"{field}:") and words in e for e in errors), errors


def test_node_report_is_admitted() -> None:
    report = {
        "apiVersion": "kvtier.io/v1alpha1",
        "kind": "KVCacheNode",
        "metadata": {"name": "llama-gpu-node-1", "namespace": "inference"},
        "spec": {
            "tier": "llama",
            "node": "gpu-node-1",
            "endpoints": {"control": "tcp://10.0.0.7:5557"},
        },
        "status": {
            "tiers": [{"name": "host", "usedBytes": 1, "capacityBytes": 2}],
            "lookups": 10,
            "hits": 7,
        },
    }
    assert admit(NODE, report)[1] == []
    del report["spec"]["node"]
    assert any("'node' is a required property" in e for e in admit(NODE, report)[1])
