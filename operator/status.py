"""KVCacheTier status from its agents' KVCacheNode reports: pure, so a thousand nodes
aggregate in one pass, and the handler writes the result at most once per interval and only
when it changed (a thousand node updates never become a thousand status writes)."""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Iterable
from typing import Any

from kvtier.agent.fingerprint import differing_components, parse_namespace
from kvtier.agent.units import format_bytes

Manifest = dict[str, Any]


def _parse_time(value: str | None) -> dt.datetime | None:
    if not value:
        return None
    return dt.datetime.fromisoformat(value.replace("Z", "+00:00"))


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


def aggregate(
    nodes: Iterable[Manifest],
    desired: int,
    now: dt.datetime,
    heartbeat_timeout: float,
    config_error: str | None = None,
    injected_pods: int = 0,
) -> Manifest:
    ready = 0
    host_used = host_capacity = lookups = hits = 0
    peers: set[str] = set()
    fingerprints: set[str] = set()
    tiers: dict[str, dict[str, int]] = {}
    failing: list[str] = []  # "node: the nodes' TiersHealthy message"
    for node in nodes:
        status = node.get("status") or {}
        for condition in status.get("conditions") or []:
            if condition.get("type") == "TiersHealthy" and condition.get("status") == "False":
                where = (node.get("spec") or {}).get("node", "?")
                failing.append(f"{where}: {condition.get('message', '')}")
        beat = _parse_time(status.get("heartbeat"))
        if beat is not None and (now - beat).total_seconds() <= heartbeat_timeout:
            ready += 1
        lookups += int(status.get("lookups", 0))
        hits += int(status.get("hits", 0))
        peers.update(status.get("peers", []))
        fingerprints.update(status.get("fingerprints", []))
        for tier in status.get("tiers", []):
            if tier.get("name") == "host":
                host_used += int(tier.get("usedBytes", 0))
                host_capacity += int(tier.get("capacityBytes", 0))
                continue
            sums = tiers.setdefault(tier["name"], {})
            for key in ("usedBytes", "capacityBytes", "chunks", "hits"):
                sums[key] = sums.get(key, 0) + int(tier.get(key, 0))
    stamp = now.strftime("%Y-%m-%dT%H:%M:%SZ")
    models = [_model_of(f) for f in fingerprints]
    conflicts = sorted({m for m in models if models.count(m) > 1})
    agents_ready = desired > 0 and ready >= desired
    conditions = [
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
            f"{ready}/{desired} agents report a fresh heartbeat",
            stamp,
        ),
        _condition(
            "FingerprintConflict",
            bool(conflicts),
            "Conflict" if conflicts else "NoConflict",
            "; ".join(_conflict(m, fingerprints) for m in conflicts) + " (cannot share chunks)"
            if conflicts
            else "",
            stamp,
        ),
    ]
    conditions.append(
        _condition(
            "TiersHealthy",
            not failing,
            "TierFailing" if failing else "AllHealthy",
            "; ".join(sorted(failing)),
            stamp,
        )
    )
    conditions.append(
        _condition(
            "Ready",
            config_error is None and agents_ready,
            "Ready" if config_error is None and agents_ready else "NotReady",
            "",
            stamp,
        )
    )
    hit_rate = f"{hits / lookups:.0%}" if lookups else "-"
    summary_tiers = ", ".join(
        f"{name} {format_bytes(t.get('usedBytes', 0))}/{format_bytes(t.get('capacityBytes', 0))}"
        for name, t in tiers.items()
    )
    return {
        "nodes": {"desired": desired, "ready": ready},
        "host": {"usedBytes": host_used, "capacityBytes": host_capacity},
        "tiers": [{"name": name, **sums} for name, sums in tiers.items()],
        "lookups": lookups,
        "hits": hits,
        "peers": len(peers),
        "injectedPods": injected_pods,
        "fingerprints": sorted(fingerprints),
        "conditions": conditions,
        "summary": {
            "host": f"{format_bytes(host_used)}/{format_bytes(host_capacity)}",
            "hitRate": hit_rate,
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
