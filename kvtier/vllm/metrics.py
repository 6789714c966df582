"""The Prometheus series the kvtier plug-in adds to vLLM's, and the observations it gathers
between two of vLLM's `get_stats` calls.

Threading: copy threads and the lookup thread record; vLLM's scheduler thread takes.
"""

from __future__ import annotations

import threading
from typing import Any

from vllm.v1.kv_offload.base import (
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingHistogramMetadata,
    OffloadingMetricMetadata,
)


class Metrics:
    """Names of the Prometheus series this tier adds to vLLM's."""

    LOOKUPS = "vllm:kvtier_lookup_keys"
    HITS = "vllm:kvtier_lookup_hits"
    STORE_BYTES = "vllm:kvtier_store_bytes"
    LOAD_BYTES = "vllm:kvtier_load_bytes"
    STORE_SECONDS = "vllm:kvtier_store_seconds"
    LOAD_SECONDS = "vllm:kvtier_load_seconds"
    FAILED_JOBS = "vllm:kvtier_failed_jobs"
    AGENT_AVAILABLE = "vllm:kvtier_agent_available"


_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)


def metric_definitions() -> dict[str, OffloadingMetricMetadata]:
    return {
        Metrics.LOOKUPS: OffloadingCounterMetadata("Chunk keys looked up in the agent."),
        Metrics.HITS: OffloadingCounterMetadata("Chunk keys the agent held."),
        Metrics.STORE_BYTES: OffloadingCounterMetadata("Bytes copied into the agent."),
        Metrics.LOAD_BYTES: OffloadingCounterMetadata("Bytes copied from the agent."),
        Metrics.STORE_SECONDS: OffloadingHistogramMetadata(
            "Duration of one store job into the agent.", buckets=_SECONDS_BUCKETS
        ),
        Metrics.LOAD_SECONDS: OffloadingHistogramMetadata(
            "Duration of one load job from the agent.", buckets=_SECONDS_BUCKETS
        ),
        Metrics.FAILED_JOBS: OffloadingCounterMetadata(
            "Store or load jobs that failed (agent unavailable or refused).", ("op",)
        ),
        Metrics.AGENT_AVAILABLE: OffloadingGaugeMetadata(
            "1 while the node agent answers, 0 during an outage."
        ),
    }


class Observations:
    """What the plug-in observed since vLLM last asked: counter increments and histogram
    samples in order, and each gauge's last value only (a gauge set on every lookup must
    not grow a list between two reports)."""

    def __init__(self) -> None:
        self._seen: list[tuple[str, str, float, tuple[str, ...]]] = []
        self._gauges: dict[tuple[str, tuple[str, ...]], float] = {}
        self._lock = threading.Lock()

    def record(self, kind: str, name: str, value: float, labels: tuple[str, ...] = ()) -> None:
        with self._lock:
            if kind == "gauge":
                self._gauges[(name, labels)] = value
            else:
                self._seen.append((kind, name, value, labels))

    def stats(self) -> Any:
        """vLLM's OffloadingConnectorStats of what was recorded since last asked, or None."""
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
            OffloadingConnectorStats,
        )

        with self._lock:
            observations, self._seen = self._seen, []
            gauges, self._gauges = self._gauges, {}
        if not observations and not gauges:
            return None
        stats = OffloadingConnectorStats()
        for kind, name, value, labels in observations:
            if kind == "counter":
                stats.increase_counter(name, value, labels)
            else:
                stats.observe_histogram(name, value, labels)
        for (name, labels), value in gauges.items():
            stats.set_gauge(name, value, labels)
        return stats
