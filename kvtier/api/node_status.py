"""The KVCacheNode status, defined once: the agent writes it, the operator aggregates it into
the KVCacheTier's status, and `kubectl kvtier` shows it.

The field names are the CRD's (camelCase on the wire). Reading is lenient on purpose: a node
written by an older agent, or damaged by hand, reads as what it says and zero for the rest,
so one bad KVCacheNode never stops the tier's status from being computed.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import Any

import msgspec

from kvtier.api.stats import AgentStats

TIMESTAMP = "%Y-%m-%dT%H:%M:%SZ"


class TierStatus(msgspec.Struct, rename="camel", kw_only=True):
    """One tier of one node: the host tier first, then the secondaries in lookup order."""

    name: str
    used_bytes: int = 0
    capacity_bytes: int = 0
    chunks: int = 0
    hits: int = 0  # keys looked up and found on this tier
    misses: int = 0  # keys looked up and asked of this tier in vain
    healthy: bool = True  # False while the agent skips it (see TiersHealthy)


class Condition(msgspec.Struct, rename="camel", kw_only=True, omit_defaults=True):
    type: str
    status: str
    reason: str = ""
    message: str = ""
    last_transition_time: str | None = None


class NodeSummary(msgspec.Struct, rename="camel", kw_only=True):
    host: str = ""
    hit_rate: str = "-"
    peers: int = 0


class EventStreamStatus(msgspec.Struct, rename="camel", kw_only=True, omit_defaults=True):
    """Where a router subscribes to this node's KV events (vLLM's KV-event wire format)."""

    endpoint: str
    replay_endpoint: str
    topic: str
    curve_key: str | None = None


class NodeStatus(msgspec.Struct, rename="camel", kw_only=True):
    heartbeat: str | None = None
    ready: bool = False
    tiers: list[TierStatus] = []
    lookups: int = 0
    hits: int = 0
    peers: list[str] = []
    fingerprints: list[str] = []
    conditions: list[Condition] = []
    summary: NodeSummary = msgspec.field(default_factory=NodeSummary)
    events: EventStreamStatus | None = None

    @property
    def host(self) -> TierStatus | None:
        return next((t for t in self.tiers if t.name == "host"), None)

    @property
    def secondaries(self) -> list[TierStatus]:
        return [t for t in self.tiers if t.name != "host"]

    @property
    def hit_rate(self) -> float | None:
        return self.hits / self.lookups if self.lookups else None

    def heartbeat_time(self) -> dt.datetime | None:
        return parse_time(self.heartbeat)

    def condition(self, kind: str) -> Condition | None:
        return next((c for c in self.conditions if c.type == kind), None)

    def to_manifest(self) -> dict[str, Any]:
        manifest: dict[str, Any] = msgspec.to_builtins(self)
        if self.events is None:  # no stream: no field (the registry's patch clears one
            del manifest["events"]  # an earlier agent of the node left)
        return manifest


def parse_time(value: str | None) -> dt.datetime | None:
    """A Kubernetes timestamp (RFC 3339, `Z` for UTC), or None for none or an unreadable one."""
    if not value:
        return None
    try:
        return dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None


def read_node_status(node: Mapping[str, Any]) -> NodeStatus:
    """The status of a KVCacheNode object; an empty one where it is missing or unreadable."""
    try:
        return msgspec.convert(node.get("status") or {}, NodeStatus, strict=False)
    except msgspec.ValidationError:
        return NodeStatus()


def build_report(stats: AgentStats, now: dt.datetime) -> NodeStatus:
    """KVCacheNode status from the agent's stats."""
    host = stats.host
    tiers = [
        TierStatus(
            name="host",
            used_bytes=host.used_bytes,
            capacity_bytes=host.capacity_bytes,
            chunks=host.chunks,
            hits=host.hits,
            misses=host.lookups - host.hits,
        )
    ]
    tiers += [
        TierStatus(
            name=tier.name,
            used_bytes=tier.used_bytes,
            capacity_bytes=tier.capacity_bytes,
            chunks=tier.chunks,
            hits=tier.counts.hits,
            misses=tier.counts.misses,
            healthy=tier.healthy,
        )
        for tier in stats.tiers
    ]
    unhealthy = [t.name for t in tiers if not t.healthy]
    stream = stats.events
    hits = sum(t.hits for t in tiers)
    return NodeStatus(
        heartbeat=now.strftime(TIMESTAMP),
        ready=True,
        tiers=tiers,
        lookups=host.lookups,
        hits=hits,
        peers=list(stats.peers),
        fingerprints=sorted(host.namespaces),
        conditions=[tiers_healthy(unhealthy)],
        summary=NodeSummary(
            host=f"{host.used_bytes >> 20}Mi/{host.capacity_bytes >> 20}Mi",
            hit_rate=f"{hits / host.lookups:.0%}" if host.lookups else "-",
            peers=len(stats.peers),
        ),
        events=(
            EventStreamStatus(
                endpoint=stream.endpoint,
                replay_endpoint=stream.replay_endpoint,
                topic=stream.topic,
                curve_key=stream.curve_key,
            )
            if stream is not None
            else None
        ),
    )


def tiers_healthy(unhealthy: list[str]) -> Condition:
    """The node's TiersHealthy condition: False naming the secondary tiers it skips."""
    return Condition(
        type="TiersHealthy",
        status="False" if unhealthy else "True",
        reason="TierFailing" if unhealthy else "AllHealthy",
        message=(
            f"skipped until a probe succeeds: {', '.join(unhealthy)}"
            if unhealthy
            else "every tier answers"
        ),
    )
