"""Peer tiers are authenticated by default: the operator gives every peer tier a CURVE key
pair, the one the spec names or a Secret it creates once (and never overwrites, so a key
rotation done by editing it stands), and mounts it for the agents."""

from __future__ import annotations

import asyncio
import base64
import copy
from pathlib import Path
from typing import Any

import pytest
import zmq

from kvtier.kube import FIELD_MANAGER, AsyncClient
from kvtier.operator.builders import (
    build_agent_config,
    build_children,
    build_curve_secret,
    generated_curve_secrets,
)
from kvtier.operator.reconcile import ensure_curve_secrets, fetch
from tests.apiserver_rules import admit, load_crd
from tests.kube_api import KubeAPI
from tests.operator_fixtures import SETTINGS

NS = "inference"


def peer_tier(**peer: Any) -> dict[str, Any]:
    resource = {
        "apiVersion": "kvtier.io/v1alpha1",
        "kind": "KVCacheTier",
        "metadata": {"name": "llama", "namespace": NS, "uid": "0f1e-uid", "generation": 1},
        "spec": {
            "podSelector": {"matchLabels": {"app": "vllm"}},
            "host": {"capacity": "8Gi"},
            "tiers": [{"name": "peers", "peer": peer}],
        },
    }
    stored, errors = admit(load_crd("kvcachetier.yaml"), copy.deepcopy(resource))
    assert errors == []
    return stored


def curve_volume(tier: dict[str, Any]) -> dict[str, Any]:
    (daemonset,) = [c for c in build_children(tier, SETTINGS) if c["kind"] == "DaemonSet"]
    volumes = {v["name"]: v for v in daemonset["spec"]["template"]["spec"]["volumes"]}
    return dict(volumes["curve-peers"])


def test_a_peer_tier_without_a_key_secret_gets_one_made_for_it() -> None:
    tier = peer_tier()
    config = build_agent_config(tier, SETTINGS)
    assert config.tiers[0].peer is not None
    assert str(config.tiers[0].peer.curve_key_dir) == "/etc/kvtier/curve/peers"
    assert generated_curve_secrets(tier) == ["kvtier-llama-peers-curve"]
    volume = curve_volume(tier)["secret"]
    # every key of the Secret: trusted.keys appears when a rotation adds it
    assert volume["secretName"] == "kvtier-llama-peers-curve" and "items" not in volume
    assert volume["defaultMode"] == 0o440  # group-readable: the pod's fsGroup is the tier's group
    public, secret = zmq.curve_keypair()
    manifest = build_curve_secret(tier, "kvtier-llama-peers-curve", public, secret)
    assert manifest["metadata"]["ownerReferences"][0]["uid"] == "0f1e-uid"
    assert base64.b64decode(manifest["data"]["public.key"]) == public
    assert base64.b64decode(manifest["data"]["secret.key"]) == secret


def test_a_named_key_secret_is_used_and_none_is_made() -> None:
    tier = peer_tier(curveKeySecret={"name": "kv-curve"})
    assert generated_curve_secrets(tier) == []
    assert curve_volume(tier)["secret"]["secretName"] == "kv-curve"


def test_the_key_secret_is_created_once_and_never_overwritten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Against the emulated API server: the first pass creates the Secret with a valid key
    pair; later passes leave it alone, also after it was edited (a key rotation)."""
    path = "/api/v1/namespaces/inference/secrets/kvtier-llama-peers-curve"

    async def reconcile(tier: dict[str, Any]) -> tuple[list[str], dict[str, Any] | None]:
        client = AsyncClient(field_manager=FIELD_MANAGER)
        try:
            actions = await ensure_curve_secrets(client, tier)
            return actions, await fetch(client, "v1", "Secret", NS, "kvtier-llama-peers-curve")
        finally:
            await client.close()

    with KubeAPI(tmp_path) as api:
        monkeypatch.setenv("KUBECONFIG", str(api.kubeconfig))
        tier = peer_tier()
        actions, made = asyncio.run(reconcile(tier))
        assert actions == ["created Secret"] and made is not None
        public = base64.b64decode(made["data"]["public.key"])
        secret = base64.b64decode(made["data"]["secret.key"])
        assert zmq.curve_public(secret) == public  # a real pair
        actions, again = asyncio.run(reconcile(tier))
        assert actions == [] and again is not None and again["data"] == made["data"]
        rotated = {**made, "data": {**made["data"], "trusted.keys": "bmV3"}}
        status, _ = api.request(
            "PATCH", path, {"data": rotated["data"]}, "application/merge-patch+json"
        )
        assert status == 200
        # Every pass tries the create (the operator may not read Secrets): refused with
        # 409, so the rotated Secret keeps its keys.
        actions, after = asyncio.run(reconcile(tier))
        assert actions == [] and after is not None and after["data"]["trusted.keys"] == "bmV3"


def test_the_operator_reads_no_secret(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the chart's RBAC the operator may create Secrets but not read them: a whole pass
    over a tier naming a Secret (here one that does not exist) and needing a generated one
    succeeds when every Secret read is refused, as the API server refuses it (403)."""
    from lightkube.core.exceptions import ApiError
    from lightkube.models.meta_v1 import Status
    from lightkube.resources.core_v1 import Secret

    from kvtier.operator.reconcile import ensure_children

    class WithoutSecretReads(AsyncClient):
        async def get(self, res: Any, name: str, **kwargs: Any) -> Any:
            if res is Secret:
                message = f'secrets "{name}" is forbidden'
                raise ApiError(status=Status(code=403, reason="Forbidden", message=message))
            return await super().get(res, name, **kwargs)

    async def reconcile(tier: dict[str, Any]) -> list[str]:
        client = WithoutSecretReads(field_manager=FIELD_MANAGER)
        try:
            return await ensure_children(client, tier, SETTINGS)
        finally:
            await client.close()

    with KubeAPI(tmp_path) as api:
        monkeypatch.setenv("KUBECONFIG", str(api.kubeconfig))
        tier = peer_tier()
        tier["spec"]["tiers"].append(
            {
                "name": "s3",
                "objectStore": {
                    "bucket": "kv-cache",
                    "capacity": "1Ti",
                    "credentialsSecret": {"name": "no-such-secret"},
                },
            }
        )
        actions = asyncio.run(reconcile(tier))
        assert "created Secret" in actions and "created DaemonSet" in actions
        assert asyncio.run(reconcile(tier)).count("created Secret") == 0
        status, _ = api.request("GET", f"/api/v1/namespaces/{NS}/secrets/kvtier-llama-peers-curve")
        assert status == 200


def test_a_spec_that_cannot_be_rendered_creates_no_secret(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The config error is raised before anything is written, the key Secret included."""
    from kvtier.api.config import ConfigError
    from kvtier.operator.reconcile import ensure_children

    async def reconcile(tier: dict[str, Any]) -> dict[str, Any] | None:
        client = AsyncClient(field_manager=FIELD_MANAGER)
        try:
            with pytest.raises(ConfigError, match=r"host\.chunkBytes"):
                await ensure_children(client, tier, SETTINGS)
            return await fetch(client, "v1", "Secret", NS, "kvtier-llama-peers-curve")
        finally:
            await client.close()

    with KubeAPI(tmp_path) as api:
        monkeypatch.setenv("KUBECONFIG", str(api.kubeconfig))
        tier = peer_tier()
        tier["spec"]["host"] = {"capacity": "1Mi", "chunkSize": "2Mi"}  # no slot fits
        assert asyncio.run(reconcile(tier)) is None
