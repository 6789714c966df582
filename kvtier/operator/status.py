"""KVCacheTier status from its agents' KVCacheNode reports: pure, so a thousand nodes
aggregate in one pass, and the handler writes the result at most once per interval and only
when it changed (a thousand node updates never become a thousand status writes)."""

from __future__ import annotations

import datetime as dt
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from kvtier.agent.fingerprint import differing_components, parse_namespace
from kvtier.agent.node_status import TIMESTAMP, read_node_status
from kvtier.agent.units import format_bytes

Manifest = dict[str, Any]


def _condition(kind: str, ok: bool, reason: str, message: str, now: str) -> Manifest:
    return {
        "type": kind,
        "status": "True" if ok else "False",
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


@dataclass
class _Totals:
    """What the tier's nodes add up to, gathered in one pass over them."""

    ready: int = 0  # nodes whose heartbeat is recent
    host_used: int = 0
    host_capacity: int = 0
    lookups: int = 0
    hits: int = 0  # on any tier
    peers: set[str] = field(default_factory=set)
    fingerprints: set[str] = field(default_factory=set)
    tiers: dict[str, dict[str, int]] = field(default_factory=dict)
    failing: list[str] = field(default_factory=list)  # "node: its TiersHealthy message"

    def add(self, node: Manifest, now: dt.datetime, heartbeat_timeout: float) -> None:
        status = read_node_status(node)
        healthy = status.condition("TiersHealthy")
        if healthy is not None and healthy.status == "False":
            where = (node.get("spec") or {}).get("node", "?")
            self.failing.append(f"{where}: {healthy.message}")
        beat = status.heartbeat_time()
        if beat is not None and (now - beat).total_seconds() <= heartbeat_timeout:
            self.ready += 1
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


def _conditions(
    totals: _Totals, desired: int, config_error: str | None, stamp: str
) -> list[Manifest]:
    agents_ready = desired > 0 and totals.ready >= desired
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
        _condition(
            "AgentsReady",
            agents_ready,
            "AllReady" if agents_ready else "NotReady",
            f"{totals.ready}/{desired} agents report a fresh heartbeat",
            stamp,
        ),
        _condition(
            "FingerprintConflict",
            bool(conflicts),
            "Conflict" if conflicts else "NoConflict",
            f"{conflict} (cannot share chunks)" if conflicts else "",
            stamp,
        ),
        _condition(
            "TiersHealthy",
            not totals.failing,
            "TierFailing" if totals.failing else "AllHealthy",
            "; ".join(sorted(totals.failing)),
            stamp,
        ),
        _condition("Ready", ready, "Ready" if ready else "NotReady", "", stamp),
    ]


def aggregate(
    nodes: Iterable[Manifest],
    desired: int,
    now: dt.datetime,
    heartbeat_timeout: float,
    config_error: str | None = None,
    injected_pods: int = 0,
) -> Manifest:
    totals = _Totals()
    for node in nodes:
        totals.add(node, now, heartbeat_timeout)
    summary_tiers = ", ".join(
        f"{name} {format_bytes(t['usedBytes'])}/{format_bytes(t['capacityBytes'])}"
        for name, t in totals.tiers.items()
    )
    return {
        "nodes": {"desired": desired, "ready": totals.ready},
        "host": {"usedBytes": totals.host_used, "capacityBytes": totals.host_capacity},
        "tiers": [{"name": name, **sums} for name, sums in totals.tiers.items()],
        "lookups": totals.lookups,
        "hits": totals.hits,
        "peers": len(totals.peers),
        "injectedPods": injected_pods,
        "fingerprints": sorted(totals.fingerprints),
        "conditions": _conditions(totals, desired, config_error, now.strftime(TIMESTAMP)),
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
    """Conditions whose status changed: each becomes a Kubernetes Event."""
    before = {c["type"]: c.get("status") for c in old}
    return [c for c in new if before.get(c["type"]) != c["status"]]
