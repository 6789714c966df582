"""KVCacheTier status from its agents' KVCacheNode reports and their pods: pure, so a
thousand nodes aggregate in one pass, and the handler writes the result at most once per
interval and only when it changed (a thousand node updates never become a thousand status
writes). An agent that is not running is named with the reason Kubernetes gives for it
(diagnosis.py), in AgentsReady, TiersHealthy and status.agents: a report that is merely
missing says nothing a user can act on."""

from __future__ import annotations

import datetime as dt
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from kvtier.api.fingerprint import differing_components, parse_namespace
from kvtier.api.node_status import TIMESTAMP, read_node_status
from kvtier.api.units import format_bytes
from kvtier.operator.diagnosis import (
    LIMIT,
    AgentProblem,
    clip,
    current_pods,
    pod_problem,
    request_note,
)

Manifest = dict[str, Any]
CONDITION_MESSAGE_LIMIT = 1024  # characters; the event of a transition carries the message
NAMED = 5  # agents named in a condition's message; status.agents names up to LIMIT
# Agents whose pod is ready but whose report says they are not running their tiers.
_REPORTED = ("NoReport", "NoHeartbeat", "TierFailing")


def _condition(kind: str, ok: bool | str, reason: str, message: str, now: str) -> Manifest:
    """`ok`: True or False, or the status itself ("Unknown")."""
    return {
        "type": kind,
        "status": ok if isinstance(ok, str) else "True" if ok else "False",
        "reason": reason,
        "message": message,
        "lastTransitionTime": now,
    }


def _model_of(fingerprint: str) -> str:
    """Namespaces are `<model>-<digest>.<component tags>` (`<model>-<digest>` before
    fingerprint version 2): engines of one model with different digests run with different
    weights or settings and cannot share chunks."""
    parsed = parse_namespace(fingerprint)
    return parsed.model if parsed is not None else re.sub(r"-[0-9a-f]{8,}$", "", fingerprint)


def _conflict(model: str, fingerprints: Iterable[str]) -> str:
    """What differs between the engines of one model, by fingerprint component: what
    `kubectl kvtier explain-miss` shows, e.g. "same model name, different weights"."""
    differing = differing_components([f for f in fingerprints if _model_of(f) == model])
    if not differing:
        return f"engines of {model} run with different settings"
    return f"engines of {model}: same model name, different {', '.join(differing)}"


@dataclass(frozen=True)
class _Report:
    """What one node's KVCacheNode says of its agent."""

    fresh: bool
    heartbeat: str | None
    failing: str | None  # its TiersHealthy message while False


@dataclass
class _Totals:
    """What the tier's nodes add up to, gathered in one pass over them."""

    ready: int = 0  # nodes whose heartbeat is recent
    healthy: int = 0  # of those, nodes whose tiers all run
    host_used: int = 0
    host_capacity: int = 0
    lookups: int = 0
    hits: int = 0  # on any tier
    peers: set[str] = field(default_factory=set)
    fingerprints: set[str] = field(default_factory=set)
    tiers: dict[str, dict[str, int]] = field(default_factory=dict)
    reports: dict[str, _Report] = field(default_factory=dict)  # by node

    def add(self, node: Manifest, now: dt.datetime, heartbeat_timeout: float) -> None:
        status = read_node_status(node)
        healthy = status.condition("TiersHealthy")
        failing = healthy.message if healthy is not None and healthy.status == "False" else None
        beat = status.heartbeat_time()
        fresh = beat is not None and (now - beat).total_seconds() <= heartbeat_timeout
        self.ready += fresh
        self.healthy += fresh and failing is None
        where = str((node.get("spec") or {}).get("node", "?"))
        self.reports[where] = _Report(fresh, status.heartbeat, failing)
        self.lookups += status.lookups
        self.hits += status.hits
        self.peers.update(status.peers)
        self.fingerprints.update(status.fingerprints)
        if (host := status.host) is not None:
            self.host_used += host.used_bytes
            self.host_capacity += host.capacity_bytes
        for tier in status.secondaries:
            sums = self.tiers.setdefault(
                tier.name, {"usedBytes": 0, "capacityBytes": 0, "chunks": 0, "hits": 0}
            )
            sums["usedBytes"] += tier.used_bytes
            sums["capacityBytes"] += tier.capacity_bytes
            sums["chunks"] += tier.chunks
            sums["hits"] += tier.hits


def _from_report(
    node: str, pod: str, report: _Report | None, timeout: float
) -> AgentProblem | None:
    """What a node's report says of an agent whose pod (if known) is ready."""
    if report is None:
        return AgentProblem(
            node, pod, "Running", "NoReport", "the agent has written no KVCacheNode report"
        )
    if not report.fresh:
        return AgentProblem(
            node,
            pod,
            "Running" if pod else "",
            "NoHeartbeat",
            f"last report {report.heartbeat or 'never'}, more than {timeout:.0f}s ago",
        )
    if report.failing is not None:
        return AgentProblem(
            node, pod, "Running" if pod else "", "TierFailing", clip(report.failing)
        )
    return None


def agent_problems(
    totals: _Totals,
    pods: Iterable[Manifest] | None,
    events: Iterable[Manifest],
    note: str,
    timeout: float,
) -> list[AgentProblem]:
    """Every agent not running its tiers, by node: from its pod where the pod is not ready,
    else from its report. `pods` None (not observed): from the reports alone. A stale report
    of a node that has no agent pod any more (the node left) names nobody."""
    problems: list[AgentProblem] = []
    if pods is None:
        for node, report in sorted(totals.reports.items()):
            if (found := _from_report(node, "", report, timeout)) is not None:
                problems.append(found)
        return problems
    events = list(events)
    by_node = current_pods(pods)
    for node, pod in sorted(by_node.items()):
        found = pod_problem(pod, events, note)
        if found is None:
            name = str((pod.get("metadata") or {}).get("name", ""))
            found = _from_report(node, name, totals.reports.get(node), timeout)
        if found is not None:
            problems.append(found)
    for node, report in sorted(totals.reports.items()):
        if node not in by_node and report.fresh and report.failing is not None:
            problems.append(AgentProblem(node, "", "", "TierFailing", clip(report.failing)))
    return sorted(problems, key=lambda p: p.node)


def _named(problems: list[AgentProblem], missing: int = 0) -> str:
    """The first few problems as `node: Reason: message`, the rest counted."""
    parts = [p.line() for p in problems[:NAMED]]
    if len(problems) > NAMED:
        parts.append(f"{len(problems) - NAMED} more in status.agents")
    if missing:
        parts.append(f"{missing} without an agent pod yet")
    return "; ".join(parts)


def _clipped(text: str) -> str:
    if len(text) <= CONDITION_MESSAGE_LIMIT:
        return text
    return text[: CONDITION_MESSAGE_LIMIT - 1] + "…"


def _agents_ready(
    totals: _Totals, desired: int | None, problems: list[AgentProblem], missing: int
) -> tuple[bool, str, str]:
    """AgentsReady: every desired agent's pod is ready and its report fresh. Its reason is
    the commonest of the agents' reasons (Unschedulable, CrashLoopBackOff, ...), so a
    change of cause is a transition, with an event."""
    if desired is None:
        return False, "NotCounted", "the agent DaemonSet has not counted its nodes yet"
    if desired == 0:
        return (
            False,
            "NoNodes",
            "no node runs an agent: none has the labels of spec.nodeSelector with taints "
            "that spec.tolerations tolerate",
        )
    down = [p for p in problems if p.reason not in _REPORTED]
    if down:
        reason = Counter(p.reason for p in down).most_common(1)[0][0]
        return False, reason, f"{len(down)}/{desired} agents not running: {_named(down, missing)}"
    beats = f"{totals.ready}/{desired} agents report a fresh heartbeat"
    if totals.ready < desired:
        silent = [p for p in problems if p.reason != "TierFailing"]
        detail = _named(silent, missing)
        return False, "NoHeartbeat", f"{beats}: {detail}" if detail else beats
    return True, "AllReady", beats


def _tiers_healthy(
    totals: _Totals, desired: int | None, problems: list[AgentProblem], missing: int
) -> tuple[str, str, str]:
    """TiersHealthy: every desired agent runs all of its tiers, which only a fresh report
    without a failing tier shows; an agent that is not running (crash-looping on its
    credentials, unschedulable) runs none of them."""
    failing = any(p.reason == "TierFailing" for p in problems)
    if not failing and not desired:
        return "Unknown", "NoAgents", "no agent runs"
    down = max(len(problems), (desired or 0) - totals.healthy)
    if not failing and not down:
        return "True", "AllHealthy", ""
    reason = "TierFailing" if failing else "AgentsNotRunning"
    return (
        "False",
        reason,
        f"{down}/{desired or 0} agents not running their tiers: " + _named(problems, missing),
    )


def _conditions(
    totals: _Totals,
    desired: int | None,
    config_error: str | None,
    stamp: str,
    problems: list[AgentProblem],
    missing: int,
) -> list[Manifest]:
    agents_ready, agents_reason, agents_message = _agents_ready(totals, desired, problems, missing)
    healthy, healthy_reason, healthy_message = _tiers_healthy(totals, desired, problems, missing)
    per_model = Counter(_model_of(f) for f in totals.fingerprints)
    conflicts = sorted(m for m, engines in per_model.items() if engines > 1)
    conflict = "; ".join(_conflict(m, totals.fingerprints) for m in conflicts)
    ready = config_error is None and agents_ready
    return [
        _condition(
            "ConfigValid",
            config_error is None,
            "Invalid" if config_error else "Valid",
            config_error or "",
            stamp,
        ),
        _condition("AgentsReady", agents_ready, agents_reason, _clipped(agents_message), stamp),
        _condition(
            "FingerprintConflict",
            bool(conflicts),
            "Conflict" if conflicts else "NoConflict",
            f"{conflict} (cannot share chunks)" if conflicts else "",
            stamp,
        ),
        _condition("TiersHealthy", healthy, healthy_reason, _clipped(healthy_message), stamp),
        _condition("Ready", ready, "Ready" if ready else "NotReady", "", stamp),
    ]


def aggregate(
    nodes: Iterable[Manifest],
    desired: int | None,
    now: dt.datetime,
    heartbeat_timeout: float,
    config_error: str | None = None,
    injected_pods: int = 0,
    pods: Iterable[Manifest] | None = None,
    events: Iterable[Manifest] = (),
    spec: Manifest | None = None,
) -> Manifest:
    """The tier's status. `desired`: the agents the DaemonSet controller counts (None: not
    counted yet); `pods`: the agent pods (None: not observed), `events`: Warning events about
    them, `spec`: the tier's spec, for what an unschedulable agent requests."""
    totals = _Totals()
    for node in nodes:
        totals.add(node, now, heartbeat_timeout)
    pods = None if pods is None else list(pods)
    problems = agent_problems(totals, pods, events, request_note(spec), heartbeat_timeout)
    with_pods = len(current_pods(pods)) if pods is not None else None
    missing = max(0, (desired or 0) - with_pods) if with_pods is not None else 0
    summary_tiers = ", ".join(
        f"{name} {format_bytes(t['usedBytes'])}/{format_bytes(t['capacityBytes'])}"
        for name, t in totals.tiers.items()
    )
    return {
        "nodes": {"desired": desired or 0, "ready": totals.ready},
        "host": {"usedBytes": totals.host_used, "capacityBytes": totals.host_capacity},
        "tiers": [{"name": name, **sums} for name, sums in totals.tiers.items()],
        "lookups": totals.lookups,
        "hits": totals.hits,
        "peers": len(totals.peers),
        "injectedPods": injected_pods,
        "fingerprints": sorted(totals.fingerprints),
        "agents": [p.to_manifest() for p in problems[:LIMIT]],
        "conditions": _conditions(
            totals, desired, config_error, now.strftime(TIMESTAMP), problems, missing
        ),
        "summary": {
            "host": f"{format_bytes(totals.host_used)}/{format_bytes(totals.host_capacity)}",
            "hitRate": f"{totals.hits / totals.lookups:.0%}" if totals.lookups else "-",
            "tiers": summary_tiers or "host only",
        },
    }


def merge_conditions(old: list[Manifest], new: list[Manifest]) -> list[Manifest]:
    """Keep lastTransitionTime of conditions whose status did not change."""
    before = {c["type"]: c for c in old}
    merged = []
    for condition in new:
        previous = before.get(condition["type"])
        if previous is not None and previous.get("status") == condition["status"]:
            condition = {**condition, "lastTransitionTime": previous["lastTransitionTime"]}
        merged.append(condition)
    return merged


def transitions(old: list[Manifest], new: list[Manifest]) -> list[Manifest]:
    """Conditions whose status or reason changed: each becomes a Kubernetes Event carrying
    the condition's message. A new reason is news even while the status stays (an agent
    that was unschedulable now crash-loops); a new message alone is not (its counts move
    every interval)."""
    before = {c["type"]: (c.get("status"), c.get("reason")) for c in old}
    return [c for c in new if before.get(c["type"]) != (c["status"], c.get("reason"))]


def event_type(condition: Manifest) -> str:
    """`Warning` for a condition in its bad state (FingerprintConflict True, any other
    False), else `Normal`: Unknown is not yet known to be bad."""
    bad = "True" if condition["type"] == "FingerprintConflict" else "False"
    return "Warning" if condition["status"] == bad else "Normal"
