"""Agent pods, their events and nodes as the scheduler and kubelet write them (Kubernetes'
Pod lifecycle and API reference): `status.conditions[type=PodScheduled]` False with reason
`Unschedulable`; `status.containerStatuses[].state.waiting.reason` and `.message`;
`lastState.terminated.message`, which under `terminationMessagePolicy:
FallbackToLogsOnError` holds the tail of the container's log; core/v1 Events about a pod
(`involvedObject`, `type`, `reason`, `message`, `lastTimestamp`). For the pure diagnosis
tests and the operator's, which put them into the emulated API server."""

from __future__ import annotations

from typing import Any

from kvtier.api.names import labels

REQUESTS = {"cpu": "100m", "memory": str((64 << 30) + (512 << 20))}
SCHEDULER = (
    "0/1 nodes are available: 1 Insufficient memory. preemption: 0/1 nodes are available: "
    "1 No preemption victims found for incoming pod."
)
S3_ERROR = (
    "kvtier.api.config.ConfigError: tiers[0] (s3): cannot reach bucket kv-cache: "
    "InvalidAccessKeyId: The AWS Access Key Id you provided does not exist in our records."
)


def agent_pod(node: str, status: dict[str, Any], suffix: str = "x7k2p") -> dict[str, Any]:
    """An agent pod as the DaemonSet controller makes it: pinned to its node by a
    `metadata.name` matchFields term (an unscheduled pod has no spec.nodeName yet)."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"kvtier-llama-{suffix}",
            "namespace": "inference",
            "uid": f"uid-{node}-{suffix}",
            "creationTimestamp": "2026-11-29T11:00:00Z",
            "labels": labels("llama"),
            "ownerReferences": [{"kind": "DaemonSet", "name": "kvtier-llama", "controller": True}],
        },
        "spec": {
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [
                            {
                                "matchFields": [
                                    {"key": "metadata.name", "operator": "In", "values": [node]}
                                ]
                            }
                        ]
                    }
                }
            },
            "containers": [
                {
                    "name": "agent",
                    "resources": {"requests": REQUESTS, "limits": {"memory": REQUESTS["memory"]}},
                    "terminationMessagePolicy": "FallbackToLogsOnError",
                }
            ],
        },
        "status": status,
    }


def condition(kind: str, status: str, reason: str = "", message: str = "") -> dict[str, Any]:
    found: dict[str, Any] = {
        "type": kind,
        "status": status,
        "lastProbeTime": None,
        "lastTransitionTime": "2026-11-29T11:00:01Z",
    }
    if reason:
        found["reason"] = reason
    if message:
        found["message"] = message
    return found


def unschedulable(node: str = "node-a", suffix: str = "x7k2p") -> dict[str, Any]:
    """What kube-scheduler leaves on a pod that fits no node (phase Pending, no nodeName)."""
    return agent_pod(
        node,
        {
            "phase": "Pending",
            "qosClass": "Burstable",
            "conditions": [condition("PodScheduled", "False", "Unschedulable", SCHEDULER)],
        },
        suffix,
    )


def bound(node: str, phase: str, containers: list[dict[str, Any]], ready: bool) -> dict[str, Any]:
    """A pod kubelet runs on its node, with kubelet's conditions and container statuses."""
    pod = agent_pod(
        node,
        {
            "phase": phase,
            "hostIP": "10.0.0.4",
            "podIP": "10.244.0.7",
            "startTime": "2026-11-29T11:00:02Z",
            "qosClass": "Burstable",
            "conditions": [
                condition("PodReadyToStartContainers", "True" if phase == "Running" else "False"),
                condition("Initialized", "True"),
                condition(
                    "Ready",
                    "True" if ready else "False",
                    "" if ready else "ContainersNotReady",
                    "" if ready else "containers with unready status: [agent]",
                ),
                condition(
                    "ContainersReady",
                    "True" if ready else "False",
                    "" if ready else "ContainersNotReady",
                ),
                condition("PodScheduled", "True"),
            ],
            "containerStatuses": containers,
        },
    )
    pod["spec"]["nodeName"] = node
    return pod


def container(state: dict[str, Any], last: dict[str, Any] | None = None, **more: Any) -> Any:
    return {
        "name": "agent",
        "image": "ghcr.io/kvtier/kvtier:0.1.0",
        "imageID": "",
        "ready": more.get("ready", False),
        "started": more.get("started", False),
        "restartCount": more.get("restarts", 0),
        "state": state,
        "lastState": {"terminated": last} if last else {},
    }


def crash_looping(node: str = "node-a") -> dict[str, Any]:
    """Kubelet between restarts of a container that keeps exiting 1; the log tail is in
    lastState.terminated.message (FallbackToLogsOnError)."""
    log = "Traceback (most recent call last):\n  File ...\n" + S3_ERROR + "\n"
    waiting = {
        "reason": "CrashLoopBackOff",
        "message": "back-off 1m20s restarting failed container=agent "
        "pod=kvtier-llama-x7k2p_inference(uid-node-a)",
    }
    last = {
        "exitCode": 1,
        "reason": "Error",
        "message": log,
        "startedAt": "2026-11-29T11:58:00Z",
        "finishedAt": "2026-11-29T11:58:03Z",
        "containerID": "containerd://0a1b",
    }
    return bound(node, "Running", [container({"waiting": waiting}, last, restarts=4)], False)


def creating(node: str = "node-a") -> dict[str, Any]:
    """A pod whose volume kubelet cannot set up: ContainerCreating, no message of its own."""
    return bound(node, "Pending", [container({"waiting": {"reason": "ContainerCreating"}})], False)


def running(node: str, ready: bool = True) -> dict[str, Any]:
    state = {"running": {"startedAt": "2026-11-29T11:00:05Z"}}
    return bound(node, "Running", [container(state, ready=ready, started=True)], ready)


def event(pod: dict[str, Any], reason: str, message: str, last: str, kind: str = "Warning") -> Any:
    """A core/v1 Event as kubelet records it about a pod."""
    meta = pod["metadata"]
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": f"{meta['name']}.17f3a", "namespace": "inference"},
        "involvedObject": {
            "apiVersion": "v1",
            "kind": "Pod",
            "name": meta["name"],
            "namespace": "inference",
            "uid": meta["uid"],
        },
        "reason": reason,
        "message": message,
        "source": {"component": "kubelet", "host": "node-a"},
        "firstTimestamp": "2026-11-29T11:00:03Z",
        "lastTimestamp": last,
        "count": 3,
        "type": kind,
        "eventTime": None,
        "reportingComponent": "kubelet",
        "reportingInstance": "node-a",
    }


MISSING_SECRET = 'MountVolume.SetUp failed for volume "s3-s3" : secret "creds" not found'


def node(name: str, memory: str, **labels: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **labels}},
        "status": {
            "capacity": {"cpu": "8", "memory": "24508416Ki", "pods": "110"},
            "allocatable": {"cpu": "8", "memory": memory, "pods": "110"},
        },
    }
