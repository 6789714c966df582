"""Level-based reconciliation of a KVCacheTier's children: every pass applies what the
builders want with server-side apply, as kvtier's field manager, forcing conflicts. A child
deleted by hand is re-created, a field edited by hand is set back, a field the desired object
no longer has is removed, and fields other controllers own (defaults, status, an HPA's
replicas) are left alone. Run on every change and on a timer, so a missed event is caught up."""

from __future__ import annotations

from typing import Any

import zmq
from lightkube.types import PatchType

from kvtier.api.config import ConfigError
from kvtier.kube import (
    FIELD_MANAGER,
    ApiError,
    AsyncClient,
    as_dict,
    not_found,
    resource_of,
    to_object,
)
from kvtier.operator.builders import (
    build_children,
    build_curve_secret,
    generated_curve_secrets,
)
from kvtier.operator.ownership import upgrade_patch
from kvtier.operator.settings import OperatorSettings

Manifest = dict[str, Any]


async def fetch(
    client: AsyncClient, api_version: str, kind: str, namespace: str | None, name: str
) -> Manifest | None:
    """The object (namespace None: a cluster-wide one), or None when there is none."""
    try:
        found = await client.get(resource_of(api_version, kind), name, namespace=namespace)
    except ApiError as exc:
        if not_found(exc):
            return None
        raise
    return as_dict(found)


async def check_references(client: AsyncClient, tier: Manifest) -> None:
    """What the schema cannot know: the claims the spec names must exist. Raises ConfigError
    naming the field, before anything is changed. Secrets the spec names are not read: the
    operator may not read Secrets (only the agents mount them), and a missing one shows as
    the agent pods' FailedMount in AgentsReady."""
    namespace = tier["metadata"]["namespace"]
    problems = []
    for i, entry in enumerate(tier["spec"].get("tiers", [])):
        claim = entry.get("filesystem", {}).get("pvc", {}).get("claimName")
        if claim is None:
            continue
        if await fetch(client, "v1", "PersistentVolumeClaim", namespace, claim) is None:
            problems.append(
                f"spec.tiers[{i}].filesystem.pvc: PersistentVolumeClaim {claim!r} not found in "
                f"namespace {namespace}; fix: create it or correct the name"
            )
    if problems:
        raise ConfigError(problems)


async def ensure_curve_secrets(client: AsyncClient, tier: Manifest) -> list[str]:
    """Create the CURVE key pair Secret of each peer tier whose spec names none, so every
    peer tier is authenticated. Create, never read or overwrite: the operator may create
    Secrets (of this shape only, the chart's admission policy says) but not read them, so
    every pass tries the create and an existing Secret (perhaps mid-rotation) refuses it
    with 409 AlreadyExists and keeps its keys."""
    actions = []
    for name in generated_curve_secrets(tier):
        public, secret = zmq.curve_keypair()
        manifest = build_curve_secret(tier, name, public, secret)
        try:
            await client.create(to_object(manifest), field_manager=FIELD_MANAGER)
        except ApiError as exc:
            if exc.status.code != 409:
                raise
            continue
        actions.append("created Secret")
    return actions


async def ensure_children(
    client: AsyncClient, tier: Manifest, settings: OperatorSettings
) -> list[str]:
    """Make the children match the resource; returns what was done, e.g. 'created DaemonSet'.
    Raises ConfigError before touching anything when the spec cannot be rendered."""
    await check_references(client, tier)
    children = build_children(tier, settings)  # a spec that cannot be rendered changes nothing
    actions = await ensure_curve_secrets(client, tier)
    for child in children:
        kind, meta = child["kind"], child["metadata"]
        resource = resource_of(child["apiVersion"], kind)
        namespace = meta.get("namespace")
        current = await fetch(client, child["apiVersion"], kind, namespace, meta["name"])
        if current is not None and (patch := upgrade_patch(current, FIELD_MANAGER)) is not None:
            moved = await client.patch(
                resource,
                meta["name"],
                patch,
                namespace=namespace,
                patch_type=PatchType.JSON,
            )
            current = as_dict(moved)
        applied = as_dict(
            await client.apply(to_object(child), field_manager=FIELD_MANAGER, force=True)
        )
        if current is None:
            actions.append(f"created {kind}")
        elif applied["metadata"].get("resourceVersion") != current["metadata"].get(
            "resourceVersion"
        ):
            actions.append(f"updated {kind}")
    return actions
