"""Why a tier's agents are not running, read from what Kubernetes itself writes: the agent
pods' status (the scheduler's `PodScheduled` condition, kubelet's container states), the
pods' Warning events (kubelet's `FailedMount`, `Unhealthy`, ...) and the nodes' allocatable
memory. Pure: the operator passes the objects in, so every rule is tested on manifests shaped
as the API server returns them, without a cluster.

The scheduler and kubelet are the only ones who know why a pod does not run, and they say it
in these places only: a pod that fits no node stays `Pending` with the reason in its
`PodScheduled` condition; a missing Secret keeps a pod in `ContainerCreating` with the reason
in an event; a crash loop's cause is in the container's last log lines, which kubelet copies
into `lastState.terminated.message` under `terminationMessagePolicy: FallbackToLogsOnError`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kvtier.api.agent_memory import OVERHEAD, PAGE_TABLE_SHARE, largest_capacity, state_bytes
from kvtier.api.pool_layout import pool_slot_count
from kvtier.api.units import parse_bytes
from kvtier.operator.builders import agent_resources, host_sizes

Manifest = dict[str, Any]
LIMIT = 20  # agents named in status.agents (the CRD's maxItems)
MESSAGE_LIMIT = 256  # characters of one agent's message (the CRD allows 1024)
# Waiting reasons kubelet gives without a message of their own: the cause is in the events.
_SILENT = {"ContainerCreating", "PodInitializing"}


@dataclass(frozen=True)
class AgentProblem:
    """One agent that is not running its tiers: where, which pod, and why."""

    node: str
    pod: str
    phase: str  # the pod's phase (Pending, Running, Failed, ...)
    reason: str  # CamelCase, as Kubernetes gives it (Unschedulable, CrashLoopBackOff, ...)
    message: str

    def line(self) -> str:
        return (
            f"{self.node}: {self.reason}: {self.message}"
            if self.message
            else (f"{self.node}: {self.reason}")
        )

    def to_manifest(self) -> Manifest:
        """An entry of status.agents."""
        return {
            "node": self.node,
            "pod": self.pod,
            "phase": self.phase,
            "reason": self.reason,
            "message": self.message,
        }


def quantity(n: int) -> str:
    """Bytes as a Kubernetes quantity with a binary suffix, e.g. 64.5Gi; rounded down, so an
    allocatable size is never shown larger than it is."""
    for suffix, shift in (("Ti", 40), ("Gi", 30), ("Mi", 20), ("Ki", 10)):
        if abs(n) >= 1 << shift:
            value = math.floor(n / (1 << shift) * 100) / 100
            return f"{value:.2f}".rstrip("0").rstrip(".") + suffix
    return str(n)


def clip(text: str, limit: int = MESSAGE_LIMIT) -> str:
    """One line of at most `limit` characters: a log tail or an event can be long, and a
    status entry is read in a table."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _requested_memory(spec: Mapping[str, Any]) -> tuple[int, str] | None:
    """What an agent pod of this spec requests in memory, and where that figure comes from:
    the scheduler places a pod only where its requests fit a node's allocatable memory."""
    try:
        resources = agent_resources(dict(spec))
        memory = (resources.get("requests") or {}).get("memory") or (
            resources.get("limits") or {}
        ).get("memory")
        if memory is None:
            return None
        amount = parse_bytes(memory)
    except (KeyError, TypeError, ValueError):
        return None
    if (spec.get("agent") or {}).get("resources"):
        return amount, "spec.agent.resources"
    capacity, chunk, policy = host_sizes(spec)
    slots = pool_slot_count(capacity, chunk)
    return amount, (
        f"host.capacity {spec['host']['capacity']} + {quantity(OVERHEAD)} + page tables "
        f"{quantity(capacity // PAGE_TABLE_SHARE)} + {quantity(state_bytes(policy, slots))} "
        f"for {slots:,} chunks ({policy})"
    )


def request_note(spec: Mapping[str, Any] | None) -> str:
    """What an agent requests, e.g. `agent requests 64.7Gi: host.capacity 64Gi + 512Mi +
    page tables 128Mi + 79.84Mi for 32,704 chunks (lru)`: appended to the scheduler's
    `Insufficient memory`, which names no amount."""
    requested = _requested_memory(spec) if spec else None
    if requested is None:
        return ""
    amount, source = requested
    return f"agent requests {quantity(amount)}: {source}"


def pod_node(pod: Mapping[str, Any]) -> str:
    """The pod's node: `spec.nodeName` once bound, else the node the DaemonSet controller
    pinned it to (a `metadata.name` matchFields term of its node affinity), which is all an
    unschedulable DaemonSet pod says of where it belongs."""
    spec = pod.get("spec") or {}
    if spec.get("nodeName"):
        return str(spec["nodeName"])
    required = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    ) or {}
    for term in required.get("nodeSelectorTerms") or []:
        for field in term.get("matchFields") or []:
            if field.get("key") == "metadata.name" and field.get("values"):
                return str(field["values"][0])
    return "?"


def _condition(pod: Mapping[str, Any], kind: str) -> Mapping[str, Any] | None:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c.get("type") == kind), None)


def is_ready(pod: Mapping[str, Any]) -> bool:
    """The pod's `Ready` condition is True (kubelet sets it once every container's readiness
    probe passes)."""
    ready = _condition(pod, "Ready")
    return ready is not None and ready.get("status") == "True"


def _event_time(event: Mapping[str, Any]) -> str:
    """When an event last happened: core/v1 events from kubelet carry `lastTimestamp`, those
    from the scheduler (written through events.k8s.io) `eventTime` or `series`; RFC 3339 in
    UTC sorts as text."""
    series = event.get("series") or {}
    return str(
        series.get("lastObservedTime")
        or event.get("lastTimestamp")
        or event.get("eventTime")
        or (event.get("metadata") or {}).get("creationTimestamp")
        or ""
    )


def _about(event: Mapping[str, Any], pod: Mapping[str, Any]) -> bool:
    """The event is about this pod: by uid (a pod of the same name made later is another
    pod), by name where the event names no uid."""
    meta = pod.get("metadata") or {}
    involved = event.get("involvedObject") or event.get("regarding") or {}
    if involved.get("kind", "Pod") != "Pod":
        return False
    if meta.get("uid") and involved.get("uid"):
        return bool(involved["uid"] == meta["uid"])
    return bool(involved.get("name") == meta.get("name"))


def newest_warning(pod: Mapping[str, Any], events: Iterable[Mapping[str, Any]]) -> str:
    """`Reason: message` of the newest Warning event about the pod, e.g. `FailedMount:
    MountVolume.SetUp failed for volume "s3-x" : secret "creds" not found`; "" for none."""
    mine = [e for e in events if e.get("type") == "Warning" and _about(e, pod)]
    if not mine:
        return ""
    newest = max(mine, key=_event_time)
    text = newest.get("message") or newest.get("note") or ""
    return f"{newest.get('reason', 'Warning')}: {text}" if text else str(newest.get("reason", ""))


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _last_exit(terminated: Mapping[str, Any], note: str = "") -> str:
    """A terminated container's last words: the last line of `terminated.message` (the log
    tail, under FallbackToLogsOnError), prefixed by kubelet's reason when it says more than
    `Error`; after OOMKilled (the pool, its index and the overhead outgrew the memory limit),
    `note`: what the agent requests."""
    reason = str(terminated.get("reason") or "")
    line = _last_line(str(terminated.get("message") or ""))
    code = terminated.get("exitCode")
    if not line:
        said = f"{reason or 'exited'} (exit code {code})" if code is not None else reason
    else:
        said = line if reason in ("", "Error") else f"{reason}: {line}"
    return f"{said} ({note})" if note and reason == "OOMKilled" else said


def _statuses(pod: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    status = pod.get("status") or {}
    return [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]


def pod_problem(
    pod: Mapping[str, Any], events: Iterable[Mapping[str, Any]] = (), note: str = ""
) -> AgentProblem | None:
    """Why the agent pod does not run, or None when it is ready. `note` (what the agent
    requests) goes with an unschedulable pod's message, and an OOM-killed one's: what its
    limit was made of says which part to raise."""
    if is_ready(pod):
        return None
    status = pod.get("status") or {}
    phase = str(status.get("phase") or "Pending")
    node, name = pod_node(pod), str((pod.get("metadata") or {}).get("name", "?"))
    events = list(events)

    def problem(reason: str, message: str) -> AgentProblem:
        return AgentProblem(node, name, phase, reason, clip(message))

    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return problem("Terminating", "the pod is being deleted")
    if phase in ("Failed", "Succeeded"):
        # e.g. Evicted: "The node was low on resource: memory."
        return problem(str(status.get("reason") or phase), str(status.get("message") or ""))
    scheduled = _condition(pod, "PodScheduled")
    if scheduled is not None and scheduled.get("status") == "False":
        # The scheduler's message ends in what preemption could not do either ("preemption:
        # 0/1 nodes are available: ..."), which says nothing more; what the agent requests
        # is what the scheduler's "Insufficient memory" leaves out.
        message = str(scheduled.get("message") or "").partition(" preemption:")[0].rstrip(". ")
        if note:
            message = f"{message} ({note})"
        return problem(str(scheduled.get("reason") or "Unschedulable"), message)
    for container in _statuses(pod):
        state = container.get("state") or {}
        if (waiting := state.get("waiting")) is not None:
            reason = str(waiting.get("reason") or "Waiting")
            if reason == "CrashLoopBackOff":
                last = (container.get("lastState") or {}).get("terminated")
                message = _last_exit(last, note) if last else str(waiting.get("message") or "")
            elif reason in _SILENT or not waiting.get("message"):
                message = newest_warning(pod, events)
            else:
                message = str(waiting["message"])
            return problem(reason, message)
        if (terminated := state.get("terminated")) is not None and terminated.get("exitCode"):
            return problem(str(terminated.get("reason") or "Error"), _last_exit(terminated, note))
    if phase == "Running":
        ready = _condition(pod, "Ready") or {}
        # kubelet's `Unhealthy: Readiness probe failed: ...` event says more than the
        # condition's "containers with unready status: [agent]".
        message = newest_warning(pod, events) or str(ready.get("message") or "")
        return problem("ReadinessFailing", message)
    waiting_for = "kubelet to start it" if scheduled is not None else "the scheduler"
    return problem(phase, newest_warning(pod, events) or f"waiting for {waiting_for}")


def wants_events(pod: Mapping[str, Any]) -> bool:
    """Whether the pod's own status leaves its reason to its events (ContainerCreating,
    readiness failing, ...): the operator lists events only for these pods."""
    found = pod_problem(pod)
    return found is not None and (
        found.reason in (*_SILENT, "ReadinessFailing", found.phase) or not found.message
    )


def current_pods(pods: Iterable[Mapping[str, Any]]) -> dict[str, Mapping[str, Any]]:
    """The newest pod per node: during a rolling update a node briefly has two."""
    newest: dict[str, Mapping[str, Any]] = {}
    for pod in pods:
        node = pod_node(pod)
        stamp = str((pod.get("metadata") or {}).get("creationTimestamp") or "")
        if node not in newest or stamp >= str(
            (newest[node].get("metadata") or {}).get("creationTimestamp") or ""
        ):
            newest[node] = pod
    return newest


def _node_selected(node: Mapping[str, Any], selector: Mapping[str, str]) -> bool:
    labels = (node.get("metadata") or {}).get("labels") or {}
    return all(labels.get(k) == v for k, v in selector.items())


def _capacity_fix(spec: Mapping[str, Any], memory: int) -> str:
    """What to lower so that an agent fits in `memory`: the capacity that does, or under
    another policy than lru also lru's (which remembers no evicted chunk), or, where no
    pool of one chunk fits, the chunk size."""
    _, chunk, policy = host_sizes(spec)
    fitting = largest_capacity(memory, chunk, policy)
    if not fitting:
        return "no host.capacity fits with this host.chunkSize: lower spec.host.chunkSize"
    fix = f"lower spec.host.capacity to at most {quantity(fitting)}"
    lean = largest_capacity(memory, chunk, "lru")
    if policy != "lru" and lean > fitting * 1.01:
        fix += f" ({quantity(lean)} with host.policy lru)"
    return fix


def capacity_warning(spec: Mapping[str, Any], nodes: Iterable[Mapping[str, Any]]) -> str | None:
    """A warning when what each agent requests exceeds the allocatable memory of every node
    the tier's nodeSelector selects, so that no agent can ever be scheduled; None when one
    node fits, or no node is selected (nothing to compare with). The spec itself is valid:
    a larger node may join later, so this never makes the config invalid."""
    requested = _requested_memory(spec)
    if requested is None:
        return None
    amount, source = requested
    selector = spec.get("nodeSelector") or {}
    sizes = []
    for node in nodes:
        if not _node_selected(node, selector):
            continue
        memory = ((node.get("status") or {}).get("allocatable") or {}).get("memory")
        if memory is None:
            continue
        try:
            sizes.append((parse_bytes(memory), str(node["metadata"]["name"])))
        except (KeyError, TypeError, ValueError):
            continue
    if not sizes or any(size >= amount for size, _ in sizes):
        return None
    largest, where = max(sizes)
    if source.startswith("host.capacity"):
        fix = _capacity_fix(spec, largest)
    else:
        fix = "lower spec.agent.resources' memory"
    return (
        f"agent requests {quantity(amount)} of memory ({source}), more than the allocatable "
        f"memory of every selected node ({len(sizes)}; largest {quantity(largest)} on "
        f"{where}): the agents stay Pending; {fix}, or select larger nodes"
    )
