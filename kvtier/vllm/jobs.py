"""The vLLM plug-in's job runner: copies between vLLM's host buffer and the agent's pool on
worker threads, never in the scheduler step, each job's result queued for vLLM to collect.

Threading: `submit` and `run_soon` are called from vLLM's scheduler thread; jobs run on the
runner's threads and queue their results (`finish`), which the scheduler thread takes with
`finished`. The set of running jobs is guarded by a lock of its own.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any


class JobRunner:
    def __init__(self, threads: int) -> None:
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kvtier-copy")
        self._running: set[Future[None]] = set()
        self._lock = threading.Lock()
        self._results: queue.SimpleQueue[Any] = queue.SimpleQueue()

    def submit(self, job: Callable[[], None]) -> None:
        """Run `job` on a worker thread; it reports its result with `finish`."""
        future = self._pool.submit(job)
        with self._lock:
            self._running.add(future)
        future.add_done_callback(self._done)

    def run_soon(self, task: Callable[[], None]) -> Future[None]:
        """Background work that is not a job (nothing waits for its result)."""
        return self._pool.submit(task)

    def _done(self, future: Future[None]) -> None:
        with self._lock:
            self._running.discard(future)

    def finish(self, result: Any) -> None:
        self._results.put(result)

    def finished(self) -> list[Any]:
        """The results queued since last asked."""
        results = []
        while True:
            try:
                results.append(self._results.get_nowait())
            except queue.Empty:
                return results

    def pending(self) -> bool:
        with self._lock:
            return bool(self._running)

    def drain(self) -> None:
        """Wait for every job in flight; none is ever cut short."""
        with self._lock:
            running = list(self._running)
        wait_futures(running)

    def shutdown(self) -> None:
        self.drain()
        self._pool.shutdown(wait=True)
