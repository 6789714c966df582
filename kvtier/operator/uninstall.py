"""What keeps the operator's absence from stranding anything (docs/uninstall.md).

kopf puts the finalizer `kvtier.io/operator` on every KVCacheTier it serves: the tiers have
timers and a delete handler, and the delete handler deletes the tier's NFS PersistentVolumes,
which are cluster-wide and so cannot be owned by the namespaced tier. With no operator left
(after `helm uninstall`, or a crash), nothing would remove that finalizer, and the tier, and
with it its namespace, could never be deleted. So:

* an operator that stops gracefully removes its finalizer from every tier it serves
  (`release_finalizers`); another replica still running, or the next operator to start,
  adds it again when it next sees the tier, as kopf does for any tier without it;
* the finalizer is not needed for correctness: the operator deletes, at start and then
  periodically, the PersistentVolumes labelled for a tier that no longer exists
  (`sweep_orphan_volumes`), so a tier deleted while no operator ran loses its volumes too;
* `kvtier operator release-finalizers` does the same from outside, for an operator that was
  killed before it could, and the chart's pre-delete hook runs it after stopping the
  operator's Deployment (`stop_deployment`), while the operator's RBAC still exists.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from typing import Any

from lightkube import ALL_NS
from lightkube.resources.apps_v1 import Deployment
from lightkube.resources.core_v1 import PersistentVolume, Pod
from lightkube.types import PatchType

from kvtier.api.names import GROUP, MANAGED_BY
from kvtier.kube import FIELD_MANAGER, ApiError, AsyncClient, KVCacheTier, as_dict, not_found
from kvtier.operator.builders import volume_labels

Manifest = dict[str, Any]
FINALIZER = f"{GROUP}/operator"  # kopf's finalizer, as configure() in main.py names it
NAMESPACE_LABEL = f"{GROUP}/namespace"  # on the PersistentVolumes, with f"{GROUP}/tier"
TIER_LABEL = f"{GROUP}/tier"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"


def finalizer_patch(tier: Manifest) -> list[Manifest] | None:
    """A JSON patch removing only kvtier's own finalizer, or None when the tier has none.
    The `test` op makes the server refuse it (422) if the list changed since it was read,
    so another controller's finalizer is never removed in its place."""
    finalizers = list(tier.get("metadata", {}).get("finalizers") or [])
    if FINALIZER not in finalizers:
        return None
    path = f"/metadata/finalizers/{finalizers.index(FINALIZER)}"
    return [{"op": "test", "path": path, "value": FINALIZER}, {"op": "remove", "path": path}]


async def remove_finalizer(client: AsyncClient, tier: Manifest, attempts: int = 5) -> bool:
    """Removes kvtier's finalizer from one tier; True when it removed it. A refused `test`
    (the finalizers changed meanwhile) is retried on the tier as it is now."""
    meta = tier["metadata"]
    for _ in range(attempts):
        patch = finalizer_patch(tier)
        if patch is None:
            return False
        try:
            await client.patch(
                KVCacheTier,
                meta["name"],
                patch,
                namespace=meta["namespace"],
                patch_type=PatchType.JSON,
            )
            return True
        except ApiError as exc:
            if not_found(exc):
                return False
            if exc.status.code != 422:
                raise
        try:
            tier = as_dict(await client.get(KVCacheTier, meta["name"], namespace=meta["namespace"]))
        except ApiError as exc:
            if not_found(exc):
                return False
            raise
    raise RuntimeError(f"{meta['namespace']}/{meta['name']}: finalizers kept changing")


async def list_tiers(client: AsyncClient, namespaces: Iterable[str]) -> list[Manifest]:
    """The tiers of these namespaces (none given: of all); none when the CRD is not
    installed, as after it was deleted."""
    found: list[Manifest] = []
    for namespace in list(namespaces) or [ALL_NS]:
        try:
            found += [as_dict(t) async for t in client.list(KVCacheTier, namespace=namespace)]
        except ApiError as exc:
            if not_found(exc):
                continue
            raise
    return found


async def release_finalizers(client: AsyncClient, namespaces: Iterable[str] = ()) -> list[str]:
    """Removes kvtier's finalizer from every tier of these namespaces (none given: of all);
    returns the tiers it was removed from, as `namespace/name`."""
    released = []
    for tier in await list_tiers(client, namespaces):
        if await remove_finalizer(client, tier):
            meta = tier["metadata"]
            released.append(f"{meta['namespace']}/{meta['name']}")
    return released


def tier_of_volume(volume: Manifest) -> tuple[str, str] | None:
    """(namespace, tier) of a PersistentVolume kvtier made for a tier, else None. The list's
    label selector only narrows what the server sends; this check is what decides."""
    labels = volume.get("metadata", {}).get("labels") or {}
    if labels.get(MANAGED_BY_LABEL) != MANAGED_BY:
        return None
    namespace, tier = labels.get(NAMESPACE_LABEL), labels.get(TIER_LABEL)
    if not namespace or not tier:
        return None
    return namespace, tier


async def delete_tier_volumes(client: AsyncClient, namespace: str, tier: str) -> list[str]:
    """Deletes the PersistentVolumes kvtier made for one tier; returns their names."""
    deleted = []
    selector = volume_labels({"metadata": {"namespace": namespace, "name": tier}})
    async for found in client.list(PersistentVolume, labels=dict(selector)):
        volume = as_dict(found)
        if tier_of_volume(volume) == (namespace, tier):
            deleted += await _delete_volume(client, volume["metadata"]["name"])
    return deleted


async def sweep_orphan_volumes(client: AsyncClient, namespaces: Iterable[str] = ()) -> list[str]:
    """Deletes the PersistentVolumes kvtier made for a tier that no longer exists (only of
    these namespaces' tiers; none given: of all), as a tier deleted without its finalizer
    leaves them; returns their names. Asks for each tier itself rather than trusting a
    list, so a tier created meanwhile keeps its volumes."""
    served = set(namespaces)
    deleted = []
    gone: dict[tuple[str, str], bool] = {}
    async for found in client.list(PersistentVolume, labels={MANAGED_BY_LABEL: MANAGED_BY}):
        volume = as_dict(found)
        owner = tier_of_volume(volume)
        if owner is None or (served and owner[0] not in served):
            continue
        if owner not in gone:
            gone[owner] = await _tier_is_gone(client, *owner)
        if gone[owner]:
            deleted += await _delete_volume(client, volume["metadata"]["name"])
    return deleted


async def _tier_is_gone(client: AsyncClient, namespace: str, name: str) -> bool:
    try:
        await client.get(KVCacheTier, name, namespace=namespace)
    except ApiError as exc:
        if not_found(exc):
            return True
        raise
    return False


async def _delete_volume(client: AsyncClient, name: str) -> list[str]:
    try:
        await client.delete(PersistentVolume, name)
    except ApiError as exc:
        if not_found(exc):
            return []
        raise
    return [name]


async def stop_deployment(
    client: AsyncClient, namespace: str, name: str, timeout: float = 120.0
) -> None:
    """Scales the operator's Deployment to zero and waits until none of its pods is left:
    each operator removes its finalizers as it stops, and none is left to add them again.
    A Deployment that does not exist is already stopped."""
    try:
        deployment = as_dict(
            await client.patch(
                Deployment,
                name,
                {"spec": {"replicas": 0}},
                namespace=namespace,
                patch_type=PatchType.MERGE,
            )
        )
    except ApiError as exc:
        if not_found(exc):
            return
        raise
    selector = dict(deployment["spec"]["selector"].get("matchLabels") or {})
    deadline = time.monotonic() + timeout
    while True:
        pods = [
            as_dict(p)
            async for p in client.list(Pod, namespace=namespace, labels=selector)
            if _labelled(as_dict(p), selector)
        ]
        if not pods:
            return
        if time.monotonic() > deadline:
            names = ", ".join(p["metadata"]["name"] for p in pods)
            raise TimeoutError(f"operator pods still running after {timeout:.0f} s: {names}")
        await asyncio.sleep(1.0)


def _labelled(obj: Manifest, selector: dict[str, str]) -> bool:
    labels = obj.get("metadata", {}).get("labels") or {}
    return all(labels.get(k) == v for k, v in selector.items())


async def release_all(
    namespaces: Iterable[str] = (),
    stop: tuple[str, str] | None = None,
    timeout: float = 120.0,
) -> dict[str, Any]:
    """What `kvtier operator release-finalizers` does: stop the operator's Deployment when
    `stop` names it, remove kvtier's finalizer from the tiers, delete the volumes of tiers
    that are gone. Returns a report of each step."""
    namespaces = tuple(namespaces)
    client = AsyncClient(field_manager=f"{FIELD_MANAGER}-uninstall")
    try:
        if stop is not None:
            await stop_deployment(client, *stop, timeout=timeout)
        released = await release_finalizers(client, namespaces)
        deleted = await sweep_orphan_volumes(client, namespaces)
    finally:
        await client.close()
    return {
        "stopped": "/".join(stop) if stop else None,
        "released": released,
        "deletedVolumes": deleted,
    }
