"""Which chunks became readable in the pool or left it, per namespace, for KV-event consumers.

vLLM engines forward these to cache-aware routers, so a router learns what the whole node
holds (every engine's stores, and evictions), not only what one engine offloaded. The log
is bounded; a reader that fell too far behind is told so and can treat its view as stale.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class EventBatch:
    seq: int  # pass as `after` next time
    stored: list[bytes]
    evicted: list[bytes]
    truncated: bool  # events after the reader's `after` were dropped before it asked


class ChunkEvents:
    def __init__(self, per_namespace: int = 65536) -> None:
        self._limit = per_namespace
        self._logs: dict[str, deque[tuple[int, bool, bytes]]] = {}
        self._seq = 0

    def record(self, namespace: str, key: bytes, removed: bool) -> None:
        self._seq += 1
        log = self._logs.get(namespace)
        if log is None:
            log = self._logs[namespace] = deque(maxlen=self._limit)
        log.append((self._seq, removed, key))

    def since(self, namespace: str, after: int) -> EventBatch:
        log = self._logs.get(namespace)
        if not log:
            return EventBatch(self._seq, [], [], False)
        newer: list[tuple[int, bool, bytes]] = []
        for item in reversed(log):
            if item[0] <= after:
                break
            newer.append(item)
        newer.reverse()
        truncated = len(log) == self._limit and log[0][0] > after + 1
        return EventBatch(
            self._seq,
            [key for _, removed, key in newer if not removed],
            [key for _, removed, key in newer if removed],
            truncated,
        )
