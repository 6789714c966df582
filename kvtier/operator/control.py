"""What the operator's handlers do; kopf-free apart from the objects handlers pass in, so
main.py only registers and delegates."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import time
from collections.abc import Iterable
from typing import Any

import jsonpatch

from kvtier.api.config import ConfigError
from kvtier.api.names import agent_name
from kvtier.kube import FIELD_MANAGER, ApiError, AsyncClient, as_dict
from kvtier.operator import diagnosis
from kvtier.operator.reconcile import ensure_children, fetch
from kvtier.operator.settings import OperatorSettings
from kvtier.operator.status import aggregate, merge_conditions, transitions
from kvtier.operator.uninstall import (
    FINALIZER,
    delete_tier_volumes,
    release_finalizers,
    sweep_orphan_volumes,
)
from kvtier.operator.webhook import mutate_pod, selects

Manifest = dict[str, Any]


class State:
    """Per-process operator state: settings, and the API client, which finds the same
    credentials kopf logs in with (the service account in a pod, else the kubeconfig)."""

    def __init__(self, settings: OperatorSettings) -> None:
        self.settings = settings
        self._client: AsyncClient | None = None
        self.config_errors: dict[tuple[str, str], str] = {}
        # The generation of each tier's spec last acted on (children applied or the spec
        # refused): what status.observedGeneration reports, per Kubernetes' API conventions.
        self.observed: dict[tuple[str, str], int] = {}
        # Per tier: (generation, monotonic time, warning) of the last look at the nodes'
        # allocatable memory, so nodes are listed once per reconcile interval and a
        # warning becomes one event, not one per status interval.
        self.capacity_checked: dict[tuple[str, str], tuple[int, float, str | None]] = {}
        # The namespaces it serves (empty: all), as `kvtier operator --namespace` names them.
        self.namespaces: tuple[str, ...] = ()
        self.sweeper: asyncio.Task[None] | None = None

    @property
    def client(self) -> AsyncClient:
        if self._client is None:
            self._client = AsyncClient(field_manager=FIELD_MANAGER)
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()


async def reconcile_tier(state: State, tier: Manifest, logger: logging.Logger) -> list[str]:
    key = (tier["metadata"]["namespace"], tier["metadata"]["name"])
    generation = int(tier["metadata"].get("generation", 0))
    try:
        actions = await ensure_children(state.client, tier, state.settings)
    except ConfigError as exc:
        # What only the operator can check; existing agents are left running as they are.
        state.config_errors[key] = "; ".join(exc.problems)
        state.observed[key] = generation
        logger.warning("invalid KVCacheTier, children left unchanged: %s", exc)
        return []
    state.config_errors.pop(key, None)
    state.observed[key] = generation
    if actions:
        logger.info("reconciled: %s", ", ".join(actions))
    return actions


async def release_tier(state: State, tier: Manifest, logger: logging.Logger) -> None:
    """What garbage collection cannot do: the tier's cluster-wide PersistentVolumes (NFS
    exports) have no owner reference to it, so they are deleted by their labels. A tier
    deleted while no operator ran loses them in `sweep_volumes` instead."""
    meta = tier["metadata"]
    for name in await delete_tier_volumes(state.client, meta["namespace"], meta["name"]):
        logger.info("deleted PersistentVolume %s", name)


async def sweep_volumes(state: State, logger: logging.Logger) -> None:
    """Runs for the operator's lifetime: at start and then every reconcile interval, deletes
    the PersistentVolumes of tiers that no longer exist (level-based, so no finalizer is
    needed for them to go). A failed pass is logged and tried again on the next."""
    while True:
        try:
            for name in await sweep_orphan_volumes(state.client, state.namespaces):
                logger.info("deleted PersistentVolume %s: its KVCacheTier is gone", name)
        except Exception as exc:  # an API error or an unreachable server: the next pass
            logger.warning("sweeping PersistentVolumes of deleted tiers failed: %s", exc)
        await asyncio.sleep(state.settings.reconcile_interval_seconds)


async def shutdown(state: State, logger: logging.Logger) -> None:
    """On a graceful stop: stop sweeping, then remove kvtier's finalizer from every tier this
    operator serves, so a tier deleted while no operator runs is deleted at once (its owned
    children by garbage collection, its volumes by the next operator's sweep). A replica
    still running, or the next operator, adds the finalizer again when it sees the tier.
    Errors are logged, never raised: the operator must still stop."""
    if state.sweeper is not None:
        state.sweeper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await state.sweeper
        state.sweeper = None
    try:
        released = await release_finalizers(state.client, state.namespaces)
    except Exception as exc:
        logger.warning("could not remove the finalizer %s from the tiers: %s", FINALIZER, exc)
    else:
        if released:
            logger.info("removed the finalizer %s from %s", FINALIZER, ", ".join(released))


async def desired_agents(state: State, tier: Manifest) -> int | None:
    """How many nodes should run an agent, as the DaemonSet controller says; None until it
    has counted them (no DaemonSet yet, or a status it has not written: the API server
    shows a new DaemonSet's counts as zeros, and only `observedGeneration` tells them from
    a count of none)."""
    meta = tier["metadata"]
    current = await fetch(
        state.client, "apps/v1", "DaemonSet", meta["namespace"], agent_name(meta["name"])
    )
    status = (current or {}).get("status") or {}
    desired = int(status.get("desiredNumberScheduled") or 0)
    if desired == 0 and "observedGeneration" not in status:
        return None
    return desired


async def pod_events(
    state: State, pods: Iterable[Manifest], logger: logging.Logger
) -> list[Manifest]:
    """The Warning events of the agent pods whose status leaves their reason to events
    (ContainerCreating on a missing Secret, a failing readiness probe), the first
    diagnosis.LIMIT by node: one list per such pod, by its uid, so a namespace's other
    events are never read. Without the permission (an older chart) the reasons come from
    the pods alone."""
    from lightkube.resources.core_v1 import Event

    current = sorted(diagnosis.current_pods(pods).items())
    chosen = [pod for _, pod in current if diagnosis.wants_events(pod)][: diagnosis.LIMIT]
    events: list[Manifest] = []
    for pod in chosen:
        meta = pod.get("metadata") or {}
        if not meta.get("uid") or not meta.get("namespace"):
            continue
        selector = {"involvedObject.uid": meta["uid"], "type": "Warning"}
        try:
            async for event in state.client.list(
                Event, namespace=meta["namespace"], fields=selector
            ):
                events.append(as_dict(event))
        except ApiError as exc:
            logger.warning("cannot list the events of pod %s: %s", meta.get("name"), exc)
            break
    return events


async def capacity_warning(
    state: State, tier: Manifest, logger: logging.Logger, now: float | None = None
) -> str | None:
    """A warning to emit when the agent requests more memory than any selected node can
    allocate (diagnosis.capacity_warning), once per new finding. The nodes are listed by
    the tier's nodeSelector, at most once per reconcile interval or spec change."""
    from lightkube.resources.core_v1 import Node

    meta = tier["metadata"]
    key = (meta["namespace"], meta["name"])
    generation = int(meta.get("generation", 0))
    now = time.monotonic() if now is None else now
    checked = state.capacity_checked.get(key)
    if (
        checked is not None
        and checked[0] == generation
        and now - checked[1] < state.settings.reconcile_interval_seconds
    ):
        return None
    selector = dict(tier["spec"].get("nodeSelector") or {})
    try:
        nodes = [as_dict(n) async for n in state.client.list(Node, labels=selector or None)]
    except ApiError as exc:
        logger.warning("cannot list nodes to compare with host.capacity: %s", exc)
        return None
    warning = diagnosis.capacity_warning(tier["spec"], nodes)
    state.capacity_checked[key] = (generation, now, warning)
    previous = checked[2] if checked is not None else None
    return warning if warning is not None and warning != previous else None


def next_status(
    state: State,
    tier: Manifest,
    reports: Iterable[Manifest],
    desired: int | None,
    now: dt.datetime,
    injected_pods: int = 0,
    pods: Iterable[Manifest] | None = None,
    events: Iterable[Manifest] = (),
) -> tuple[Manifest | None, list[Manifest]]:
    """The status to write (None when nothing changed) and the condition transitions. Its
    observedGeneration, and each condition's, is the generation last reconciled (by this
    process, else as the status already says), never merely the current one."""
    meta = tier["metadata"]
    current = dict(tier.get("status") or {})
    key = (meta["namespace"], meta["name"])
    observed = state.observed.get(key, int(current.get("observedGeneration", 0)))
    new = aggregate(
        reports,
        desired,
        now,
        state.settings.heartbeat_timeout_seconds,
        config_error=state.config_errors.get(key),
        injected_pods=injected_pods,
        pods=pods,
        events=events,
        spec=tier.get("spec"),
    )
    old_conditions = list(current.get("conditions") or [])
    stamped = [{**c, "observedGeneration": observed} for c in new["conditions"]]
    new["conditions"] = merge_conditions(old_conditions, stamped)
    new["observedGeneration"] = observed
    if all(current.get(k) == v for k, v in new.items()):
        return None, []
    return new, transitions(old_conditions, new["conditions"])


def inject(state: State, pod: Manifest, tiers: Iterable[Manifest], logger: logging.Logger) -> Any:
    """The first KVCacheTier of the pod's namespace whose podSelector matches; returns a
    transformation of the pod body for kopf's patch, or None to leave it alone."""
    labels = pod.get("metadata", {}).get("labels") or {}
    for tier in tiers:
        if not selects(tier["spec"].get("podSelector", {}), labels):
            continue
        try:
            mutation = mutate_pod(pod, tier, state.settings)
        except ConfigError as exc:
            logger.warning(
                "pod not injected, KVCacheTier %s is invalid: %s", tier["metadata"]["name"], exc
            )
            return None
        if not mutation.patch:
            return None
        ops = mutation.patch
        return lambda body: jsonpatch.apply_patch(body, ops, in_place=True)
    return None
