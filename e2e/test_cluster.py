"""The operator against a real cluster, when KUBECONFIG names one (skipped otherwise, and
it says so). Installs the CRDs, runs `kvtier operator` locally with that kubeconfig, applies
a KVCacheTier and checks that its DaemonSet appears, owned by it, and that the resource
reports status; then removes what it created."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import kopf
import pytest
import yaml

from kvtier.operator.kube import KubeClient

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(
    not os.environ.get("KUBECONFIG"), reason="no cluster: KUBECONFIG is not set"
)


async def scenario() -> None:
    info = kopf.login_with_kubeconfig(
        settings=kopf.OperatorSettings(), logger=logging.getLogger("e2e")
    )
    client = KubeClient(info)
    namespace = os.environ.get("KVTIER_E2E_NAMESPACE", "default")
    name = f"e2e-{uuid.uuid4().hex[:6]}"
    crds = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
    for path in sorted((REPO / "crds").glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        if await client.request("GET", f"{crds}/{crd['metadata']['name']}") is None:
            await client.request("POST", crds, crd)
    operator = subprocess.Popen(
        [str(Path(sys.executable).parent / "kvtier"), "operator", "--namespace", namespace]
    )
    tier: dict[str, Any] = {
        "apiVersion": "kvtier.io/v1alpha1",
        "kind": "KVCacheTier",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "host": {"capacity": "1Gi", "chunkSize": "2Mi"},
            "podSelector": {"matchLabels": {"kvtier-e2e": name}},
        },
    }
    try:
        created = await client.create(tier)
        assert created is not None
        ds_path = f"/apis/apps/v1/namespaces/{namespace}/daemonsets/kvtier-{name}"
        deadline = time.monotonic() + 120
        while (ds := await client.request("GET", ds_path)) is None:
            assert time.monotonic() < deadline, "DaemonSet not created"
            await asyncio.sleep(1)
        assert ds["metadata"]["ownerReferences"][0]["uid"] == created["metadata"]["uid"]
        while not ((await client.get(tier)) or {}).get("status", {}).get("conditions"):
            assert time.monotonic() < deadline, "no status reported"
            await asyncio.sleep(1)
    finally:
        await client.request(
            "DELETE", f"/apis/kvtier.io/v1alpha1/namespaces/{namespace}/kvcachetiers/{name}"
        )
        operator.terminate()
        operator.wait(30)
        await client.close()


def test_operator_in_a_real_cluster() -> None:
    asyncio.run(scenario())
