"""KV events for vLLM: what the agent stored or evicted in this engine's namespace, from
every engine on the node, fetched in the background every `EVENTS_POLL_SECONDS` and handed
to vLLM (medium CPU) when it asks.

Threading: `due` and `take` run on vLLM's scheduler thread, `poll` on a worker thread; the
pending events are guarded by a lock, and one poll runs at a time.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future

from vllm.v1.kv_offload.base import Locality, Medium, OffloadingEvent, OffloadKey

from kvtier.agent.client import AgentClient

log = logging.getLogger("vllm.kvtier")
EVENTS_POLL_SECONDS = 0.5


class EventFeed:
    def __init__(self, medium: Medium, locality: Locality) -> None:
        self._medium = medium
        self._locality = locality
        self._events: list[OffloadingEvent] = []
        self._lock = threading.Lock()
        self._after = 0  # the agent's event sequence number read up to
        self._poll: Future[None] | None = None
        self._next_poll = 0.0

    def due(self, now: float) -> bool:
        """Whether to start a poll now (none running, the interval passed)."""
        if now < self._next_poll or (self._poll is not None and not self._poll.done()):
            return False
        self._next_poll = now + EVENTS_POLL_SECONDS
        return True

    def polling(self, future: Future[None]) -> None:
        self._poll = future

    def poll(self, client: AgentClient, namespace: str) -> None:
        batch = client.events(namespace, self._after)
        if batch.truncated:
            log.warning("kvtier KV events fell behind the agent's log; some were lost")
        self._after = batch.seq
        new = [
            OffloadingEvent(
                keys=[OffloadKey(k) for k in keys],
                medium=self._medium,
                removed=removed,
                locality=self._locality,
            )
            for keys, removed in ((batch.stored, False), (batch.evicted, True))
            if keys
        ]
        if new:
            with self._lock:
                self._events.extend(new)

    def take(self) -> list[OffloadingEvent]:
        with self._lock:
            events, self._events = self._events, []
        return events

    def running(self) -> Future[None] | None:
        return self._poll
