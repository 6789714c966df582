"""kopf handlers of the kvtier operator: they only register and delegate to control.py.

Run with `kvtier operator` (which calls kopf) in the operator's Deployment.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from typing import Any

import kopf

from kvtier.api.names import GROUP, MANAGED_BY, VERSION
from kvtier.operator import control
from kvtier.operator.settings import OperatorSettings
from kvtier.operator.status import event_type
from kvtier.operator.uninstall import FINALIZER
from kvtier.operator.webhook import INJECTED
from kvtier.operator.webhook import TIER as TIER_ANNOTATION

STATE = control.State(OperatorSettings())  # from the KVTIER_* environment
TIERS = (GROUP, VERSION, "kvcachetiers")
NODES = (GROUP, VERSION, "kvcachenodes")


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.persistence.finalizer = FINALIZER  # removed again on a graceful stop (close)
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP)
    ours = STATE.settings
    settings.peering.standalone = not ours.peering  # replicas coordinate through peering
    if ours.peering:
        settings.peering.name = ours.peering
    # The chart's MutatingWebhookConfiguration points at this server (TLS from the chart);
    # without a certificate it serves plain HTTP, for tests.
    settings.admission.server = kopf.WebhookServer(
        addr="0.0.0.0",
        port=ours.webhook_port,
        certfile=ours.webhook_cert,
        pkeyfile=ours.webhook_key,
        insecure=ours.webhook_cert is None,
    )


@kopf.on.startup()
async def start_sweeping(logger: Any, **_: Any) -> None:
    """PersistentVolumes of tiers deleted while no operator ran go now and on every interval."""
    STATE.sweeper = asyncio.create_task(control.sweep_volumes(STATE, logger))


@kopf.on.cleanup()
async def close(logger: Any, **_: Any) -> None:
    """kopf runs this after its watches stopped: no tier gets the finalizer again from this
    process once `shutdown` removed it (docs/uninstall.md)."""
    await control.shutdown(STATE, logger)
    await STATE.close()


@kopf.on.login()
def login(**kwargs: Any) -> Any:
    """kopf's own client: the service account in a pod, else the kubeconfig (the same order
    kvtier's client follows), whatever other client libraries are installed."""
    return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


@kopf.index(*NODES)
def reports(*, namespace: str | None, spec: kopf.Spec, status: kopf.Status, **_: Any) -> Any:
    return {(namespace, spec.get("tier")): {"status": dict(status)}}


@kopf.index("", "v1", "pods", annotations={INJECTED: kopf.PRESENT})
def injected(*, namespace: str | None, annotations: Any, **_: Any) -> Any:
    return {(namespace, annotations.get(TIER_ANNOTATION)): True}


@kopf.index(
    "",
    "v1",
    "pods",
    labels={"app.kubernetes.io/name": "kvtier-agent", "app.kubernetes.io/managed-by": MANAGED_BY},
)
def agent_pods(
    *, namespace: str | None, meta: kopf.Meta, spec: kopf.Spec, status: kopf.Status, **_: Any
) -> Any:
    """The agent pods by tier, from the pod watch kopf already keeps (no list per status
    interval): only what says where a pod runs and why it does not."""
    labels = dict(meta.get("labels") or {})
    kept = ("name", "namespace", "uid", "creationTimestamp", "deletionTimestamp", "labels")
    return {
        (namespace, labels.get(f"{GROUP}/tier")): {
            "metadata": {k: meta[k] for k in kept if meta.get(k) is not None},
            "spec": {k: spec[k] for k in ("nodeName", "affinity") if spec.get(k) is not None},
            "status": dict(status),
        }
    }


@kopf.index(*TIERS)
def tiers(*, namespace: str | None, body: kopf.Body, **_: Any) -> Any:
    return {namespace: dict(body)}


@kopf.on.resume(*TIERS)
@kopf.on.create(*TIERS)
@kopf.on.update(*TIERS, field="spec")
@kopf.timer(*TIERS, interval=STATE.settings.reconcile_interval_seconds)
async def reconcile(*, body: kopf.Body, logger: Any, **_: Any) -> None:
    await control.reconcile_tier(STATE, dict(body), logger)


@kopf.on.delete(*TIERS)
async def release(*, body: kopf.Body, logger: Any, **_: Any) -> None:
    await control.release_tier(STATE, dict(body), logger)


@kopf.timer(*TIERS, interval=STATE.settings.status_interval_seconds)
async def report_status(
    *,
    body: kopf.Body,
    patch: kopf.Patch,
    logger: Any,
    reports: kopf.Index[Any, Any] | None = None,
    injected: kopf.Index[Any, Any] | None = None,
    agent_pods: kopf.Index[Any, Any] | None = None,
    **_: Any,
) -> None:
    # kopf passes indexes by name
    assert reports is not None and injected is not None and agent_pods is not None
    tier = dict(body)
    key = (tier["metadata"]["namespace"], tier["metadata"]["name"])
    desired = await control.desired_agents(STATE, tier)
    pods = list(agent_pods.get(key, []))
    new, changed = control.next_status(
        STATE,
        tier,
        reports.get(key, []),
        desired,
        dt.datetime.now(dt.UTC),
        injected_pods=len(list(injected.get(key, []))),
        pods=pods,
        events=await control.pod_events(STATE, pods, logger),
    )
    if new is not None:
        patch.status.update(new)
    for condition in changed:
        kopf.event(
            body,
            type=event_type(condition),
            reason=f"{condition['type']}{condition['status']}",
            message=condition.get("message") or condition["type"],
        )
    if (warning := await control.capacity_warning(STATE, tier, logger)) is not None:
        kopf.event(body, type="Warning", reason="CapacityExceedsNodes", message=warning)


@kopf.on.mutate("", "v1", "pods", operation="CREATE", id="kvtier-inject")
def inject(
    *,
    body: kopf.Body,
    patch: kopf.Patch,
    namespace: str | None,
    logger: Any,
    tiers: kopf.Index[Any, Any] | None = None,
    **_: Any,
) -> None:
    assert tiers is not None
    transform = control.inject(STATE, dict(body), tiers.get(namespace, []), logger)
    if transform is not None:
        patch.fns.append(transform)
