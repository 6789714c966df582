"""The agent's report: built from its stats, published at a bounded rate."""

from __future__ import annotations

import datetime as dt
import itertools
import json
import time
from pathlib import Path
from typing import Any

from kvtier.agent.config import ReportConfig
from kvtier.agent.report import FileRegistry, Reporter, build_report

STATS: dict[str, Any] = {
    "used_bytes": 3 << 20,
    "capacity_bytes": 8 << 20,
    "chunks": 3,
    "hits": 6,
    "lookups": 10,
    "namespaces": {"llama-3-8b-aa": 2, "qwen-bb": 1},
    "tiers": [
        {
            "name": "shared-fs",
            "used_bytes": 100,
            "capacity_bytes": 1000,
            "chunks": 1,
            "hits": 2,
            "misses": 2,
        }
    ],
}


def test_report_from_stats() -> None:
    report = build_report(STATS, dt.datetime(2026, 1, 1, tzinfo=dt.UTC))
    assert report["heartbeat"] == "2026-01-01T00:00:00Z"
    assert [t["name"] for t in report["tiers"]] == ["host", "shared-fs"]
    assert report["tiers"][0]["misses"] == 4
    assert report["hits"] == 8 and report["lookups"] == 10
    assert report["summary"] == {"host": "3Mi/8Mi", "hitRate": "80%"}
    assert report["fingerprints"] == ["llama-3-8b-aa", "qwen-bb"]


def run_reporter(tmp_path: Path, collect: Any, seconds: float) -> tuple[int, dict[str, Any]]:
    config = ReportConfig(
        target="file", directory=tmp_path, interval_seconds=0.3, min_interval_seconds=0.05
    )
    registry = FileRegistry(tmp_path, "node-1")
    reporter = Reporter(config, registry, collect).start()
    time.sleep(seconds)
    reporter.stop()
    return reporter.publishes, json.loads(registry.path.read_text())["status"]


def test_steady_state_publishes_only_heartbeats(tmp_path: Path) -> None:
    publishes, last = run_reporter(tmp_path, lambda: STATS, 1.0)
    assert 3 <= publishes <= 6  # one at start, then one per 0.3 s heartbeat
    assert last["lookups"] == 10


def test_changes_are_published_at_most_every_min_interval(tmp_path: Path) -> None:
    counter = itertools.count()
    publishes, last = run_reporter(tmp_path, lambda: {**STATS, "lookups": next(counter)}, 1.0)
    assert publishes <= 1.0 / 0.05 + 2
    assert last["lookups"] > 0
