"""The agent's report: what it holds and how it serves, published through its registry
(`registry.py`: its own KVCacheNode, where the operator and `kubectl` read it) at a bounded
rate. The report's shape is `node_status.py`.

Published when something meaningful changed, but at most every `minIntervalSeconds`, and at
least every `intervalSeconds` as a heartbeat: a thousand agents with steady traffic cost the
API server one small write per agent per heartbeat, not one per request.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from kvtier.agent.report.registry import Registry
from kvtier.api.config import ReportConfig
from kvtier.api.node_status import build_report
from kvtier.api.stats import AgentStats

log = logging.getLogger("kvtier.agent.report.publisher")


class Reporter:
    """A thread publishing `collect()` through the registry at a bounded rate."""

    def __init__(
        self, config: ReportConfig, registry: Registry, collect: Callable[[], AgentStats]
    ) -> None:
        self.config = config
        self.registry = registry
        self.collect = collect
        self.publishes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kvtier-report", daemon=True)

    def start(self) -> Reporter:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=15)

    def _loop(self) -> None:
        last_sent: dict[str, Any] | None = None
        last_time = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            status = build_report(self.collect(), dt.datetime.now(dt.UTC)).to_manifest()
            comparable = {k: v for k, v in status.items() if k != "heartbeat"}
            due = now - last_time >= self.config.interval_seconds
            changed = last_sent is not None and comparable != last_sent
            if last_sent is None or due or changed:
                try:
                    self.registry.publish(status)
                    self.publishes += 1
                    last_sent, last_time = comparable, now
                except Exception as exc:  # the API server may be briefly unreachable
                    log.warning("could not publish the agent report: %s", exc)
            self._stop.wait(self.config.min_interval_seconds)
