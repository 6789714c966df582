"""Lookups answered from the published index, on their way to the agent.

A client that answers a lookup from the index the agent publishes (shm/table.py) tells the
agent afterwards, in one-way Looked messages, so that its hit counts, the eviction order's
recency and its access log see every lookup. `Reports` is the one batcher of them: whole
requests (`request`), or requests noted key by key over a scheduler step (`key`, sealed by
`end_step`: the vLLM plug-in answers one key at a time), and the bytes loaded without a
lease. They go out at most REPORT_SECONDS late from a reporting thread, at once past
REPORT_KEYS keys, and before any request that waits for the agent (the client flushes
then). Imports only numpy and msgspec, which vLLM has.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from kvtier.client import protocol as p

REPORT_SECONDS = 0.05  # lookups answered here reach the agent at most this late...
REPORT_KEYS = 65536  # ...or once this many keys wait

U64 = npt.NDArray[np.uint64]


def report_parts(requests: list[Any]) -> list[list[Any]]:
    """Requests' digests in messages the agent accepts: at most MAX_KEYS keys (a request
    has at most that many) and MAX_KEYS requests in each; one empty part for none."""
    parts: list[list[Any]] = [[]]
    keys = 0
    for request in requests:
        if parts[-1] and (keys + len(request) > p.MAX_KEYS or len(parts[-1]) == p.MAX_KEYS):
            parts.append([])
            keys = 0
        parts[-1].append(request)
        keys += len(request)
    return parts


class Reports:
    """What waits to be reported. `tick` runs on the reporting thread every REPORT_SECONDS
    (sooner past REPORT_KEYS keys) once there was a first report: it flushes (`take`) and
    does whatever else the owner keeps up while idle. `key` and `end_step` are called from
    one thread (vLLM's scheduler); the rest from any."""

    def __init__(self, tick: Callable[[], None]) -> None:
        self._tick = tick
        self._lock = threading.Lock()
        self._ready: dict[str, list[U64]] = {}  # whole requests' digests, by namespace
        self._keys = 0  # in _ready
        self._loaded = 0  # bytes loaded without a lease since the last report
        self._open: dict[tuple[str, str], list[int]] = {}  # requests noted key by key
        self._thread: threading.Thread | None = None
        self._now = threading.Event()
        self._closing = threading.Event()

    def request(self, namespace: str, digests: U64) -> None:
        """One request's keys, in order, as index digests."""
        if not len(digests):
            return
        with self._lock:
            self._ready.setdefault(namespace, []).append(digests)
            self._keys += len(digests)
            due = self._keys >= REPORT_KEYS
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._loop, name="kvtier-report", daemon=True
                )
                self._thread.start()
        if due:
            self._now.set()

    def key(self, namespace: str, request: str, digest: int) -> None:
        """One key of `request`, looked up in this step: the step's keys of a request are
        reported as one request, at `end_step`."""
        self._open.setdefault((namespace, request), []).append(digest)

    def end_step(self) -> None:
        """The keys noted in this step, one request each, to report."""
        noted, self._open = self._open, {}
        for (namespace, _), digests in noted.items():
            self.request(namespace, np.array(digests, np.uint64))

    def loaded(self, nbytes: int) -> None:
        """Bytes loaded straight from the pool, without a lease (reported with lookups)."""
        if nbytes:
            with self._lock:
                self._loaded += nbytes

    @property
    def pending(self) -> bool:
        """Whether something waits to be taken (keys not yet sealed by `end_step` aside)."""
        return bool(self._ready or self._loaded)

    def take(self) -> list[p.Looked]:
        """The messages to send now, one per namespace (more past the protocol's bounds)."""
        with self._lock:
            reports, self._ready, self._keys = self._ready, {}, 0
            loaded, self._loaded = self._loaded, 0
        if loaded and not reports:
            reports = {"-": []}  # bytes to report even with no lookup waiting
        messages = []
        for namespace, requests in reports.items():
            for part in report_parts(requests):
                messages.append(
                    p.Looked(
                        namespace,
                        np.concatenate(part).astype("<u8").tobytes() if part else b"",
                        [len(r) for r in part],
                        loaded,
                    )
                )
                loaded = 0
        return messages

    def stop(self, timeout: float) -> None:
        """Stop the reporting thread (a later report starts another)."""
        thread = self._thread
        if thread is not None:
            self._closing.set()
            self._now.set()
            thread.join(timeout=timeout)
            self._thread = None
            self._closing.clear()

    def _loop(self) -> None:
        while not self._closing.is_set():
            self._now.wait(REPORT_SECONDS)
            self._now.clear()
            self._tick()
