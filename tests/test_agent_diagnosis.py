"""Why a tier's agents are not running, derived from pods and events shaped exactly as the
scheduler and kubelet write them (Kubernetes' Pod lifecycle and API reference):
`status.conditions[type=PodScheduled]` False with reason `Unschedulable` and the scheduler's
message; `status.containerStatuses[].state.waiting.reason` (CrashLoopBackOff,
ContainerCreating, ImagePullBackOff, CreateContainerConfigError) and `.message`;
`status.containerStatuses[].lastState.terminated.message`, which under
`terminationMessagePolicy: FallbackToLogsOnError` holds the tail of the container's log;
core/v1 Events with `involvedObject`, `type: Warning`, `reason`, `message`, `lastTimestamp`
(kubelet) or `eventTime` (the scheduler). No cluster: the operator passes these in."""

from __future__ import annotations

import copy
import datetime as dt
from typing import Any

from kvtier.operator.builders import build_children
from kvtier.operator.diagnosis import (
    capacity_warning,
    current_pods,
    pod_problem,
    quantity,
    request_note,
    wants_events,
)
from kvtier.operator.status import aggregate, event_type, transitions
from tests.apiserver_rules import admit, load_crd
from tests.chart_render import render
from tests.operator_fixtures import SETTINGS, by_kind, tier
from tests.pod_states import (
    MISSING_SECRET,
    S3_ERROR,
    agent_pod,
    bound,
    container,
    crash_looping,
    creating,
    event,
    node,
    running,
    unschedulable,
)

NOW = dt.datetime(2026, 11, 29, 12, 0, 0, tzinfo=dt.UTC)
FRESH, STALE = "2026-11-29T11:59:50Z", "2026-11-29T11:40:00Z"
SPEC: dict[str, Any] = {"host": {"capacity": "64Gi"}, "nodeSelector": {"pool": "gpu"}}


def report(node: str, beat: str, failing: str | None = None) -> dict[str, Any]:
    conditions = [
        {"type": "TiersHealthy", "status": "False", "reason": "TierFailing", "message": failing}
        if failing
        else {"type": "TiersHealthy", "status": "True", "reason": "AllHealthy"}
    ]
    return {
        "spec": {"tier": "llama", "node": node},
        "status": {"heartbeat": beat, "conditions": conditions, "tiers": []},
    }


def conditions_of(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in status["conditions"]}


def test_unschedulable_pod_names_node_scheduler_message_and_what_the_agent_requests() -> None:
    found = pod_problem(unschedulable(), note=request_note(SPEC))
    assert found is not None
    assert (found.node, found.pod, found.phase) == ("node-a", "kvtier-llama-x7k2p", "Pending")
    assert found.reason == "Unschedulable"
    assert found.message == (
        "0/1 nodes are available: 1 Insufficient memory "
        "(agent requests 64.7Gi: host.capacity 64Gi + 512Mi + page tables 128Mi + "
        "79.84Mi for 32,704 chunks (lru))"
    )
    status = aggregate([], 1, NOW, 60, pods=[unschedulable()], spec=SPEC)
    agents_ready = conditions_of(status)["AgentsReady"]
    assert agents_ready["status"] == "False" and agents_ready["reason"] == "Unschedulable"
    assert agents_ready["message"] == (
        "1/1 agents not running: node-a: Unschedulable: 0/1 nodes are available: "
        "1 Insufficient memory (agent requests 64.7Gi: host.capacity 64Gi + 512Mi + "
        "page tables 128Mi + 79.84Mi for 32,704 chunks (lru))"
    )
    assert status["agents"] == [
        {
            "node": "node-a",
            "pod": "kvtier-llama-x7k2p",
            "phase": "Pending",
            "reason": "Unschedulable",
            "message": found.message,
        }
    ]
    assert conditions_of(status)["TiersHealthy"]["status"] == "False"


def test_resources_given_in_the_spec_are_named_as_the_source() -> None:
    spec = {**SPEC, "agent": {"resources": {"requests": {"memory": "10Gi", "cpu": "1"}}}}
    assert request_note(spec) == "agent requests 10Gi: spec.agent.resources"


def test_crash_loop_says_the_last_log_line_and_tiers_are_not_healthy() -> None:
    """The agent crash-loops on its S3 credentials; its report from before still says its
    tiers are healthy, but it is stale: TiersHealthy is False, naming the S3 error."""
    found = pod_problem(crash_looping())
    assert found is not None and found.reason == "CrashLoopBackOff"
    assert found.message == S3_ERROR
    status = aggregate([report("node-a", STALE)], 1, NOW, 60, pods=[crash_looping()])
    conditions = conditions_of(status)
    assert conditions["TiersHealthy"]["status"] == "False"
    assert conditions["TiersHealthy"]["reason"] == "AgentsNotRunning"
    assert f"node-a: CrashLoopBackOff: {S3_ERROR}" in conditions["TiersHealthy"]["message"]
    assert conditions["AgentsReady"]["reason"] == "CrashLoopBackOff"
    assert status["agents"][0]["message"] == S3_ERROR


def test_without_a_log_tail_the_crash_says_how_the_container_ended() -> None:
    pod = crash_looping()
    last = pod["status"]["containerStatuses"][0]["lastState"]["terminated"]
    last.update(reason="OOMKilled", exitCode=137, message="")
    found = pod_problem(pod)
    assert found is not None and found.message == "OOMKilled (exit code 137)"
    last["message"] = "pool mapped\n"
    found = pod_problem(pod)
    assert found is not None and found.message == "OOMKilled: pool mapped"
    # what the limit was made of, as for an unschedulable agent
    found = pod_problem(pod, note=request_note(SPEC))
    assert found is not None and found.message == (
        "OOMKilled: pool mapped (agent requests 64.7Gi: host.capacity 64Gi + 512Mi + "
        "page tables 128Mi + 79.84Mi for 32,704 chunks (lru))"
    )
    last["reason"] = "Error"  # another exit: the note says nothing of it
    found = pod_problem(pod, note=request_note(SPEC))
    assert found is not None and found.message == "pool mapped"


def test_a_missing_secret_shows_through_the_pods_newest_warning_event() -> None:
    """With no Secret check of its own, the operator learns of a missing Secret the way a
    user would: kubelet's FailedMount event about the pod stuck in ContainerCreating."""
    pod = creating()
    assert wants_events(pod)
    events = [
        event(pod, "Scheduled", "Successfully assigned", "2026-11-29T11:59:59Z", kind="Normal"),
        event(pod, "FailedMount", "an older failure", "2026-11-29T11:30:00Z"),
        event(pod, "FailedMount", MISSING_SECRET, "2026-11-29T11:59:00Z"),
        event(creating("node-b"), "FailedMount", "another pod's", "2026-11-29T11:59:58Z"),
    ]
    events[-1]["involvedObject"]["uid"] = "someone-else"
    found = pod_problem(pod, events)
    assert found is not None and found.reason == "ContainerCreating"
    assert found.message == f"FailedMount: {MISSING_SECRET}"
    status = aggregate([], 1, NOW, 60, pods=[pod], events=events, spec=SPEC)
    message = conditions_of(status)["AgentsReady"]["message"]
    assert (
        message
        == f"1/1 agents not running: node-a: ContainerCreating: FailedMount: {MISSING_SECRET}"
    )
    # without its events, the same pod says only that it is being created
    alone = pod_problem(pod)
    assert alone is not None and alone.message == ""


def test_waiting_reasons_kubelet_gives_with_a_message() -> None:
    cases = {
        "ImagePullBackOff": 'Back-off pulling image "ghcr.io/kvtier/kvtier:0.9"',
        "ErrImagePull": 'rpc error: code = NotFound desc = "ghcr.io/kvtier/kvtier:0.9": not found',
        "CreateContainerConfigError": 'configmap "kvtier-llama" not found',
    }
    for reason, message in cases.items():
        waiting = {"waiting": {"reason": reason, "message": message}}
        pod = bound("node-a", "Pending", [container(waiting)], False)
        found = pod_problem(pod)
        assert found is not None and (found.reason, found.message) == (reason, message)
        assert not wants_events(pod)


def test_running_but_not_ready_says_the_probe_failure() -> None:
    pod = running("node-a", ready=False)
    probe = (
        'Readiness probe failed: Get "http://10.244.0.7:9400/metrics": dial tcp '
        "10.244.0.7:9400: connect: connection refused"
    )
    found = pod_problem(pod, [event(pod, "Unhealthy", probe, "2026-11-29T11:59:30Z")])
    assert found is not None and found.reason == "ReadinessFailing"
    assert found.message == f"Unhealthy: {probe}"
    without = pod_problem(pod)
    assert without is not None and without.message == "containers with unready status: [agent]"


def test_an_evicted_pod_says_why() -> None:
    pod = agent_pod(
        "node-a",
        {
            "phase": "Failed",
            "reason": "Evicted",
            "message": "The node was low on resource: memory.",
        },
    )
    found = pod_problem(pod)
    assert found is not None and (found.reason, found.phase) == ("Evicted", "Failed")


def test_a_ready_agent_is_judged_by_its_report() -> None:
    assert pod_problem(running("node-a")) is None
    pods = [running("node-a"), running("node-b"), running("node-c")]
    reports = [
        report("node-a", FRESH),
        report("node-b", STALE),
        report("node-c", FRESH, "s3: 5 errors"),
    ]
    status = aggregate(reports, 3, NOW, 60, pods=pods)
    assert [(a["node"], a["reason"]) for a in status["agents"]] == [
        ("node-b", "NoHeartbeat"),
        ("node-c", "TierFailing"),
    ]
    conditions = conditions_of(status)
    assert conditions["AgentsReady"]["reason"] == "NoHeartbeat"
    assert conditions["AgentsReady"]["message"].startswith("2/3 agents report a fresh heartbeat: ")
    assert conditions["TiersHealthy"]["reason"] == "TierFailing"
    assert "node-c: TierFailing: s3: 5 errors" in conditions["TiersHealthy"]["message"]
    # a running agent that never reported, and the stale report of a node that left
    status = aggregate([report("gone", STALE)], 1, NOW, 60, pods=[running("node-a")])
    assert [(a["node"], a["reason"]) for a in status["agents"]] == [("node-a", "NoReport")]


def test_all_running_and_reporting_is_healthy() -> None:
    pods = [running("node-a"), running("node-b")]
    status = aggregate([report("node-a", FRESH), report("node-b", FRESH)], 2, NOW, 60, pods=pods)
    conditions = conditions_of(status)
    assert conditions["AgentsReady"]["status"] == "True"
    assert conditions["TiersHealthy"]["status"] == "True"
    assert status["agents"] == []


def test_no_agent_yet_says_why_instead_of_counting_zero() -> None:
    """The status written before the DaemonSet controller counted the nodes was '0/0 agents
    report a fresh heartbeat'; now it says what is awaited."""
    counted = conditions_of(aggregate([], None, NOW, 60, pods=[]))
    assert counted["AgentsReady"]["reason"] == "NotCounted"
    assert "has not counted" in counted["AgentsReady"]["message"]
    assert counted["TiersHealthy"]["status"] == "Unknown"
    none = conditions_of(aggregate([], 0, NOW, 60, pods=[]))
    assert none["AgentsReady"]["reason"] == "NoNodes"
    assert "spec.nodeSelector" in none["AgentsReady"]["message"]
    waiting = conditions_of(aggregate([], 2, NOW, 60, pods=[unschedulable()], spec=SPEC))
    assert waiting["AgentsReady"]["message"].endswith("; 1 without an agent pod yet")


def test_a_new_reason_is_a_transition_with_an_event() -> None:
    before = aggregate([], 1, NOW, 60, pods=[unschedulable()], spec=SPEC)["conditions"]
    after = aggregate([], 1, NOW, 60, pods=[crash_looping()], spec=SPEC)["conditions"]
    changed = {c["type"]: c for c in transitions(before, after)}
    assert set(changed) == {"AgentsReady"}
    assert changed["AgentsReady"]["reason"] == "CrashLoopBackOff"
    assert event_type(changed["AgentsReady"]) == "Warning"
    assert transitions(after, after) == []
    assert event_type({"type": "TiersHealthy", "status": "Unknown"}) == "Normal"
    assert event_type({"type": "FingerprintConflict", "status": "True"}) == "Warning"
    assert event_type({"type": "AgentsReady", "status": "True"}) == "Normal"


def test_many_agents_down_stay_within_bounds_and_the_crd_keeps_them() -> None:
    pods = [unschedulable(f"node-{i:02d}", f"p{i:02d}") for i in range(30)]
    status = aggregate([], 30, NOW, 60, pods=pods, spec=SPEC)
    assert len(status["agents"]) == 20 and status["agents"][0]["node"] == "node-00"
    message = conditions_of(status)["AgentsReady"]["message"]
    assert message.startswith("30/30 agents not running: node-00: Unschedulable")
    assert "25 more in status.agents" in message and len(message) <= 1024
    resource = tier()
    resource["status"] = status
    stored, errors = admit(load_crd("kvcachetier.yaml"), resource)
    assert errors == []
    from tests.crd_rules import _prune

    schema = load_crd("kvcachetier.yaml")["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert _prune(stored, schema)["status"]["agents"] == status["agents"]  # nothing pruned
    long = copy.deepcopy(resource)
    long["status"]["agents"] = status["agents"] * 2
    assert admit(load_crd("kvcachetier.yaml"), long)[1] != []  # maxItems holds


def test_newest_pod_per_node() -> None:
    old, new = running("node-a"), creating("node-a")
    new["metadata"]["creationTimestamp"] = "2026-11-29T11:50:00Z"
    new["metadata"]["name"] = "kvtier-llama-newer"
    assert current_pods([new, old])["node-a"] is new
    assert current_pods([old, new])["node-a"] is new


def test_capacity_beyond_every_selected_node_is_a_warning() -> None:
    """The real node: 23 GiB, a 64Gi tier. The warning names the largest allocatable."""
    nodes = [
        node("small", "23820416Ki", pool="gpu"),
        node("big", "512Gi"),  # not selected
    ]
    warning = capacity_warning(SPEC, nodes)
    assert warning is not None
    assert warning.startswith(
        "agent requests 64.7Gi of memory "
        "(host.capacity 64Gi + 512Mi + page tables 128Mi + 79.84Mi for 32,704 chunks (lru))"
    )
    assert "largest 22.71Gi on small" in warning
    assert "lower spec.host.capacity to at most 22.14Gi" in warning
    assert capacity_warning({**SPEC, "host": {"capacity": "4Gi"}}, nodes) is None
    assert capacity_warning({**SPEC, "nodeSelector": {}}, nodes) is None  # "big" fits
    assert capacity_warning({**SPEC, "nodeSelector": {"pool": "none"}}, nodes) is None
    given = {**SPEC, "agent": {"resources": {"requests": {"memory": "30Gi"}}}}
    assert "spec.agent.resources" in (capacity_warning(given, nodes) or "")


def test_quantities_read_like_kubernetes_ones_and_never_round_up() -> None:
    assert quantity((64 << 30) + (512 << 20)) == "64.5Gi"
    assert quantity(512 << 20) == "512Mi"
    assert quantity((1 << 30) - 1) == "1023.99Mi"
    assert quantity(100) == "100"


def test_the_agent_keeps_its_log_tail_and_fits_a_small_node() -> None:
    daemonset = by_kind(build_children(tier(), SETTINGS))["DaemonSet"]
    (agent,) = daemonset["spec"]["template"]["spec"]["containers"]
    assert agent["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert agent["resources"]["requests"]["cpu"] == "100m"


def test_the_operator_may_read_what_it_diagnoses_and_no_more() -> None:
    role = next(
        o for o in render() if o["kind"] == "ClusterRole" and o["metadata"]["name"] == "kv-kvtier"
    )
    verbs: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                verbs.setdefault((group, resource), set()).update(rule["verbs"])
    assert {"get", "list", "watch"} <= verbs[("", "pods")]
    assert "list" in verbs[("", "events")] and "watch" not in verbs[("", "events")]
    assert verbs[("", "nodes")] == {"get", "list"}
