"""Prometheus metrics of one agent, on a registry of its own so several agents can live in
one test process. Tier-level series carry a `tier` label so secondary tiers share names."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

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
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._occupancy()
        self._traffic()
        self._secondary()
        self._peers()

    def _counter(self, name: str, doc: str, *labels: str) -> Counter:
        return Counter(name, doc, labels, registry=self.registry)

    def _gauge(self, name: str, doc: str, *labels: str) -> Gauge:
        return Gauge(name, doc, labels, registry=self.registry)

    def _histogram(self, name: str, doc: str, *labels: str) -> Histogram:
        return Histogram(name, doc, labels, buckets=_LATENCY_BUCKETS, registry=self.registry)

    def _occupancy(self) -> None:
        """What each tier holds."""
        self.capacity_bytes = self._gauge(
            "kvtier_tier_capacity_bytes",
            "Bytes the tier may hold.",
            "tier",
        )
        self.used_bytes = self._gauge(
            "kvtier_tier_used_bytes", "Bytes of chunks the tier holds.", "tier"
        )
        self.chunks = self._gauge("kvtier_tier_chunks", "Chunks the tier holds.", "tier")
        self.free_slots = self._gauge("kvtier_host_free_slots", "Unused pool slots.")
        self.leases = self._gauge("kvtier_host_leases", "Leases held by clients.")
        self.evictions = self._counter("kvtier_evictions", "Chunks evicted.", "tier")
        self.tier_healthy = self._gauge(
            "kvtier_tier_healthy",
            "1 while a secondary tier answers; 0 after repeated failures, until a probe succeeds.",
            "tier",
        )

    def _traffic(self) -> None:
        """Lookups, stores and loads as clients see them."""
        self.lookups = self._counter("kvtier_lookups", "Keys looked up.")
        self.hits = self._counter("kvtier_hits", "Keys found, by tier.", "tier")
        self.misses = self._counter("kvtier_misses", "Keys found on no tier.")
        self.store_bytes = self._counter(
            "kvtier_store_bytes", "Bytes committed by clients.", "tier"
        )
        self.load_bytes = self._counter("kvtier_load_bytes", "Bytes handed to clients.", "tier")
        self.store_skipped = self._counter(
            "kvtier_store_skipped",
            "Keys of store requests not written, by reason (exists, busy, full).",
            "reason",
        )
        self.corrupt = self._counter(
            "kvtier_corrupt_chunks", "Chunks that failed verification.", "tier"
        )
        self.leases_reclaimed = self._counter(
            "kvtier_leases_reclaimed",
            "Leases released because they expired or their client died.",
            "reason",
        )
        self.refused = self._counter(
            "kvtier_requests_refused",
            "Requests refused without effect, by op and code (not_registered, lease, invalid).",
            "op",
            "code",
        )
        self.request_seconds = self._histogram(
            "kvtier_request_seconds",
            "Time the agent spent on a control request.",
            "op",
        )

    def _secondary(self) -> None:
        """The secondary tiers' work behind the pool."""
        self.tier_misses = self._counter(
            "kvtier_tier_misses",
            "Keys a secondary tier was asked for and lacked.",
            "tier",
        )
        self.promotions = self._counter(
            "kvtier_promotions",
            "Chunks copied from a secondary tier into the pool.",
            "tier",
        )
        self.writebacks = self._counter(
            "kvtier_writebacks",
            "Chunks written from the pool to a secondary tier.",
            "tier",
        )
        self.writeback_dropped = self._counter(
            "kvtier_writeback_dropped",
            "Write-backs not done, by reason (queue_full: the tier fell behind; error).",
            "tier",
            "reason",
        )
        self.tier_errors = self._counter(
            "kvtier_tier_errors",
            "Failed secondary-tier operations.",
            "tier",
            "op",
        )
        self.tier_seconds = self._histogram(
            "kvtier_tier_op_seconds",
            "Duration of one secondary-tier operation (exists: per batch).",
            "tier",
            "op",
        )

    def _peers(self) -> None:
        """The peer tier's transfers and refusals."""
        self.peer_chunks = self._counter(
            "kvtier_peer_chunks",
            "Chunks fetched from other agents, by data path (nixl, zmq).",
            "path",
        )
        self.peer_nixl_failures = self._counter(
            "kvtier_peer_nixl_failures",
            "NIXL connections or transfers that failed (the chunks came over ZMQ).",
        )
        self.peer_busy = self._counter(
            "kvtier_peer_busy",
            "Chunks busy holders refused to lend to this agent.",
        )
        self.peer_refused = self._counter(
            "kvtier_peer_refused",
            "Chunks this agent refused to lend, its maxLentChunks being reached.",
        )
        self.peer_lent = self._gauge(
            "kvtier_peer_lent_slots",
            "Pool slots lent to other agents right now.",
        )

    def serve(self, host: str, port: int) -> int:
        """Start the /metrics HTTP endpoint; returns the bound port (port 0 picks one)."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return int(server.server_port)
