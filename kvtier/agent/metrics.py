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
        r = self.registry = CollectorRegistry()
        self.capacity_bytes = Gauge(
            "kvtier_tier_capacity_bytes", "Bytes the tier may hold.", ["tier"], registry=r
        )
        self.used_bytes = Gauge(
            "kvtier_tier_used_bytes", "Bytes of chunks the tier holds.", ["tier"], registry=r
        )
        self.chunks = Gauge("kvtier_tier_chunks", "Chunks the tier holds.", ["tier"], registry=r)
        self.free_slots = Gauge("kvtier_host_free_slots", "Unused pool slots.", registry=r)
        self.leases = Gauge("kvtier_host_leases", "Leases held by clients.", registry=r)
        self.lookups = Counter("kvtier_lookups", "Keys looked up.", registry=r)
        self.hits = Counter("kvtier_hits", "Keys found, by tier.", ["tier"], registry=r)
        self.misses = Counter("kvtier_misses", "Keys found on no tier.", registry=r)
        self.evictions = Counter("kvtier_evictions", "Chunks evicted.", ["tier"], registry=r)
        self.store_bytes = Counter(
            "kvtier_store_bytes", "Bytes committed by clients.", ["tier"], registry=r
        )
        self.load_bytes = Counter(
            "kvtier_load_bytes", "Bytes handed to clients.", ["tier"], registry=r
        )
        self.store_skipped = Counter(
            "kvtier_store_skipped",
            "Keys of store requests not written, by reason (exists, busy, full).",
            ["reason"],
            registry=r,
        )
        self.corrupt = Counter(
            "kvtier_corrupt_chunks", "Chunks that failed verification.", ["tier"], registry=r
        )
        self.leases_reclaimed = Counter(
            "kvtier_leases_reclaimed",
            "Leases released because they expired or their client died.",
            ["reason"],
            registry=r,
        )
        self.tier_misses = Counter(
            "kvtier_tier_misses",
            "Keys a secondary tier was asked for and lacked.",
            ["tier"],
            registry=r,
        )
        self.promotions = Counter(
            "kvtier_promotions",
            "Chunks copied from a secondary tier into the pool.",
            ["tier"],
            registry=r,
        )
        self.writebacks = Counter(
            "kvtier_writebacks",
            "Chunks written from the pool to a secondary tier.",
            ["tier"],
            registry=r,
        )
        self.writeback_dropped = Counter(
            "kvtier_writeback_dropped",
            "Write-backs not done, by reason (queue_full: the tier fell behind; error).",
            ["tier", "reason"],
            registry=r,
        )
        self.tier_errors = Counter(
            "kvtier_tier_errors", "Failed secondary-tier operations.", ["tier", "op"], registry=r
        )
        self.tier_seconds = Histogram(
            "kvtier_tier_op_seconds",
            "Duration of one secondary-tier operation (exists: per batch).",
            ["tier", "op"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.peer_chunks = Counter(
            "kvtier_peer_chunks",
            "Chunks fetched from other agents, by data path (nixl, zmq).",
            ["path"],
            registry=r,
        )
        self.peer_nixl_failures = Counter(
            "kvtier_peer_nixl_failures",
            "NIXL connections or transfers that failed (the chunks came over ZMQ).",
            registry=r,
        )
        self.peer_busy = Counter(
            "kvtier_peer_busy", "Chunks busy holders refused to lend to this agent.", registry=r
        )
        self.peer_refused = Counter(
            "kvtier_peer_refused",
            "Chunks this agent refused to lend, its maxLentChunks being reached.",
            registry=r,
        )
        self.peer_lent = Gauge(
            "kvtier_peer_lent_slots", "Pool slots lent to other agents right now.", registry=r
        )
        self.refused = Counter(
            "kvtier_requests_refused",
            "Requests refused without effect, by op and code (not_registered, lease, invalid).",
            ["op", "code"],
            registry=r,
        )
        self.tier_healthy = Gauge(
            "kvtier_tier_healthy",
            "1 while a secondary tier answers; 0 after repeated failures, until a probe succeeds.",
            ["tier"],
            registry=r,
        )
        self.request_seconds = Histogram(
            "kvtier_request_seconds",
            "Time the agent spent on a control request.",
            ["op"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )

    def serve(self, host: str, port: int) -> int:
        """Start the /metrics HTTP endpoint; returns the bound port (port 0 picks one)."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return int(server.server_port)
