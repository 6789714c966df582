"""Prometheus metrics of one agent, on a registry of its own so several agents can live in
one test process. Tier-level series carry a `tier` label so secondary tiers share names."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvtier.api.stats import AgentStats, TierCounts

_LATENCY_BUCKETS = (
    0.00002,
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    1.0,
)


class AgentMetrics:
    """What only Prometheus keeps (bytes moved, refusals, latencies) and gauges read from
    their source at each scrape; the counters the stats hold are exported from them
    (`count_from`)."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        tier, op = ("tier",), ("op",)
        # what each tier holds
        self.capacity_bytes = Gauge(
            "kvtier_tier_capacity_bytes", "Bytes the tier may hold.", tier, registry=r
        )
        self.used_bytes = Gauge(
            "kvtier_tier_used_bytes", "Bytes of chunks the tier holds.", tier, registry=r
        )
        self.chunks = Gauge("kvtier_tier_chunks", "Chunks the tier holds.", tier, registry=r)
        self.free_slots = Gauge("kvtier_host_free_slots", "Unused pool slots.", registry=r)
        self.leases = Gauge("kvtier_host_leases", "Leases held by clients.", registry=r)
        self.tier_healthy = Gauge(
            "kvtier_tier_healthy",
            "1 while a secondary tier answers; 0 after repeated failures, until a probe succeeds.",
            tier,
            registry=r,
        )
        # stores, loads and requests as clients see them
        self.store_bytes = Counter(
            "kvtier_store_bytes", "Bytes committed by clients.", tier, registry=r
        )
        self.load_bytes = Counter("kvtier_load_bytes", "Bytes handed to clients.", tier, registry=r)
        self.refused = Counter(
            "kvtier_requests_refused",
            "Requests refused without effect, by op and code (not_registered, lease, invalid).",
            (*op, "code"),
            registry=r,
        )
        self.request_seconds = Histogram(
            "kvtier_request_seconds",
            "Time the agent spent on a control request.",
            op,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tier_seconds = Histogram(
            "kvtier_tier_op_seconds",
            "Duration of one secondary-tier operation (exists: per batch).",
            (*tier, *op),
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )

    def count_from(self, stats: Callable[[], AgentStats]) -> None:
        """Export the counters the agent's stats hold, read from them at each scrape, so
        each is kept in one place."""
        self.registry.register(_StatsCollector(stats))

    def serve(self, host: str, port: int) -> int:
        """Start the /metrics HTTP endpoint; returns the bound port (port 0 picks one)."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return int(server.server_port)


# Counters of every tier, the host's included: (metric, help, TierCounts field).
_ALL_TIERS = [
    ("kvtier_hits", "Keys found, by tier.", "hits"),
    ("kvtier_corrupt_chunks", "Chunks that failed verification.", "corrupt"),
    ("kvtier_evictions", "Chunks evicted.", "evictions"),
]
# Counters of the secondary tiers alone: (metric, help, label, {label value: field}); with
# label None, one series per tier of the one field.
_SECONDARY: list[tuple[str, str, str | None, dict[str, str]]] = [
    ("kvtier_tier_misses", "Keys a secondary tier was asked for and lacked.", None, {"": "misses"}),
    (
        "kvtier_promotions",
        "Chunks copied from a secondary tier into the pool.",
        None,
        {"": "promotions"},
    ),
    (
        "kvtier_writebacks",
        "Chunks written from the pool to a secondary tier.",
        None,
        {"": "writebacks"},
    ),
    (
        "kvtier_writeback_dropped",
        "Write-backs not done, by reason (queue_full: the tier fell behind; pool_pressure: "
        "half the pool pinned by write-backs; unhealthy; error).",
        "reason",
        {
            "queue_full": "dropped_queue_full",
            "pool_pressure": "dropped_pool_pressure",
            "unhealthy": "dropped_unhealthy",
            "error": "write_errors",
        },
    ),
    (
        "kvtier_tier_errors",
        "Failed secondary-tier operations.",
        "op",
        {
            "write": "write_errors",
            "read": "read_errors",
            "exists": "exists_errors",
            "probe": "probe_errors",
            "maintain": "maintain_errors",
        },
    ),
]


def _labelled(name: str, doc: str, label: str, values: dict[str, int]) -> CounterMetricFamily:
    """A counter with one series per value of `label`."""
    family = CounterMetricFamily(name, doc, labels=[label])
    for value, count in values.items():
        family.add_metric([value], count)
    return family


class _StatsCollector(Collector):
    """The counters of `AgentStats` as Prometheus series, taken from one stats call."""

    def __init__(self, stats: Callable[[], AgentStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        host = s.host
        lookups = CounterMetricFamily("kvtier_lookups", "Keys looked up.", value=host.lookups)
        misses = CounterMetricFamily(
            "kvtier_misses", "Keys the pool lacked.", value=host.lookups - host.hits
        )
        yield lookups
        yield misses
        yield _labelled(
            "kvtier_store_skipped",
            "Keys of store requests not written, by reason (exists, busy, full, staging).",
            "reason",
            msgspec.structs.asdict(host.store_skipped),
        )
        yield _labelled(
            "kvtier_leases_reclaimed",
            "Leases released because they expired or their client died.",
            "reason",
            {"expired": host.leases_expired, "client_gone": host.leases_reclaimed},
        )
        yield from self._per_tier(s)
        yield from self._peer(s)

    def _per_tier(self, s: AgentStats) -> Iterator[Metric]:
        host = TierCounts(hits=s.host.hits, corrupt=s.host.corrupt, evictions=s.host.evictions)
        tiers = [("host", host)] + [(t.name, t.counts) for t in s.tiers]
        for name, doc, field in _ALL_TIERS:
            family = CounterMetricFamily(name, doc, labels=["tier"])
            for tier_name, counts in tiers:
                family.add_metric([tier_name], getattr(counts, field))
            yield family
        for name, doc, label, fields in _SECONDARY:
            family = CounterMetricFamily(name, doc, labels=["tier", *([label] if label else [])])
            for tier in s.tiers:
                for value, field in fields.items():
                    family.add_metric(
                        [tier.name, *([value] if label else [])], getattr(tier.counts, field)
                    )
            yield family

    def _peer(self, s: AgentStats) -> Iterator[Metric]:
        peer = next((t.peer for t in s.tiers if t.peer is not None), None)
        if peer is None:
            return
        yield _labelled(
            "kvtier_peer_chunks",
            "Chunks fetched from other agents, by data path (nixl, tcp: the stream, zmq).",
            "path",
            {"nixl": peer.nixl_reads, "tcp": peer.stream_reads, "zmq": peer.zmq_reads},
        )
        yield CounterMetricFamily(
            "kvtier_peer_nixl_failures",
            "NIXL connections or transfers that failed (the chunks came another way).",
            value=peer.nixl_failures,
        )
        yield CounterMetricFamily(
            "kvtier_peer_stream_failures",
            "Sealed streams that broke or could not connect (the chunks came as ZMQ frames).",
            value=peer.stream_failures,
        )
        yield CounterMetricFamily(
            "kvtier_peer_busy",
            "Chunks busy holders refused to lend to this agent.",
            value=peer.busy,
        )
        yield CounterMetricFamily(
            "kvtier_peer_refused",
            "Chunks this agent refused to lend, its maxLentChunks being reached.",
            value=peer.refused,
        )
        yield _labelled(
            "kvtier_peer_requests_refused",
            "Peer requests refused: from or naming a non-member, or a failed handshake.",
            "reason",
            {
                "not_member": peer.refused_requests,
                "source_not_member": peer.refused_sources,
                "handshake": peer.refused_handshakes,
            },
        )
        yield GaugeMetricFamily(
            "kvtier_peer_lent_slots", "Pool slots lent to other agents right now.", value=peer.lent
        )
