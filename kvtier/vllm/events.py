"""KV events for vLLM: what the node stored or let go of in this engine's namespace, on
every tier (the pool, the filesystem and object store; not peers, whose chunks are on their
own nodes' events, see `events.py`), from every engine on the node, fetched in the
background every `EVENTS_POLL_SECONDS` and handed to vLLM when it asks. Each event carries
the tier's medium and locality (`Medium.CPU` LOCAL for the pool, `Medium.STORAGE` LOCAL for
the filesystem and object store) and, where
the engine's vLLM has the field, `ownership` set to the node: one owner for every engine on
it, so a router counts the node's holdings once, whichever engine stored them. An agent
older than its events' tiers sends only the pool's, reported as this tier's medium.

Threading: `due` and `take` run on vLLM's scheduler thread, `poll` on a worker thread; the
pending events are guarded by a lock, and one poll runs at a time.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from concurrent.futures import Future
from typing import Any

from vllm.v1.kv_offload.base import Locality, Medium, OffloadingEvent, OffloadKey

from kvtier.client.connection import AgentClient

log = logging.getLogger("vllm.kvtier")
EVENTS_POLL_SECONDS = 0.5
# vLLM 0.32 and 0.33 have `ownership` on OffloadingEvent; older releases do not
HAS_OWNERSHIP = any(f.name == "ownership" for f in dataclasses.fields(OffloadingEvent))


def offloading_event(
    keys: list[bytes], medium: Medium, locality: Locality, removed: bool, owner: str
) -> OffloadingEvent:
    extra: dict[str, Any] = {"ownership": owner} if owner and HAS_OWNERSHIP else {}
    return OffloadingEvent(
        keys=[OffloadKey(k) for k in keys],
        medium=medium,
        removed=removed,
        locality=locality,
        **extra,
    )


class EventFeed:
    def __init__(self, medium: Medium, locality: Locality) -> None:
        self._medium = medium
        self._locality = locality
        self._events: list[OffloadingEvent] = []
        self._lock = threading.Lock()
        self._after = 0  # the agent's event sequence number read up to
        self._boot = 0  # the agent process that numbered them
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
        if batch.boot and self._boot and batch.boot != self._boot:
            # a new agent process numbers afresh: what it re-announced is read from its start
            batch = client.events(namespace, 0)
        self._boot = batch.boot
        if batch.truncated:
            log.warning("kvtier KV events fell behind the agent's log; some were lost")
        self._after = batch.seq
        if batch.runs:
            new = [
                offloading_event(
                    run.keys, *self._residency(run.medium, run.locality), run.removed, batch.owner
                )
                for run in batch.runs
            ]
        else:
            new = [
                offloading_event(keys, self._medium, self._locality, removed, batch.owner)
                for keys, removed in ((batch.stored, False), (batch.evicted, True))
                if keys
            ]
        if new:
            with self._lock:
                self._events.extend(new)

    def _residency(self, medium: str, locality: str) -> tuple[Medium, Locality]:
        """The agent names where a chunk is relative to its node; this tier's configured
        locality says where the node is for the engine: the pool is this tier's medium, and
        what is remote to either is remote."""
        if (medium, locality) == ("CPU", "LOCAL"):
            return self._medium, self._locality
        remote = Locality.REMOTE in (self._locality, Locality(locality))
        return Medium(medium), Locality.REMOTE if remote else Locality.LOCAL

    def take(self) -> list[OffloadingEvent]:
        with self._lock:
            events, self._events = self._events, []
        return events

    def running(self) -> Future[None] | None:
        return self._poll
