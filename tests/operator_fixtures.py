"""The operator's inputs the tests build on: its settings, an example tier as the API server
stores it, a plain vLLM pod, and children looked up by kind."""

from __future__ import annotations

import copy
from typing import Any

from kvtier.operator.settings import OperatorSettings
from tests.apiserver_rules import admit, load_crd
from tests.manifests import example_tier

SETTINGS = OperatorSettings(
    image="registry.local/kvtier:test", allowed_nfs_servers=["nfs.storage.svc.cluster.local"]
)
RESOURCE = example_tier("8Gi")


def tier() -> dict[str, Any]:
    """The resource as the API server stores it: with the schema's defaults."""
    stored, errors = admit(load_crd("kvcachetier.yaml"), copy.deepcopy(RESOURCE))
    assert errors == []
    return stored


def by_kind(children: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {c["kind"]: c for c in children}


POD: dict[str, Any] = {
    "apiVersion": "v1",
    "kind": "Pod",
    "metadata": {"name": "llama-0", "namespace": "inference", "labels": {"app": "vllm"}},
    "spec": {
        "containers": [
            {
                "name": "vllm",
                "image": "vllm/vllm-openai:v0.33.0",
                "args": ["--model", "meta-llama/Llama-3.1-8B"],
                "env": [{"name": "PYTHONPATH", "value": "/app"}],
            }
        ]
    },
}
