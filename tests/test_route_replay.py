"""`kvtier replay --nodes N --route prefix`: routing by the nodes' event streams beats random
routing on two trace families, with the load kept even."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.cli.main import main as cli_main
from kvtier.traces import tracegen
from kvtier.traces.replay import load_trace
from kvtier.traces.route_replay import compare


@pytest.mark.parametrize(
    ("family", "records"),
    [("rag", lambda: tracegen.rag(3, 600)), ("tenants", lambda: tracegen.tenants(3, 600))],
)
def test_prefix_routing_gains_over_random(tmp_path: Path, family: str, records: object) -> None:
    trace = load_trace(tracegen.write(tmp_path / f"{family}.jsonl", records()))  # type: ignore[operator]
    report = compare(trace, 4, ["prefix", "random"])
    assert report["gain"] > 0.05
    prefix = report["routes"]["prefix"]
    assert set(prefix["per_tier"]) == {"pool", "storage"}
    loads = [n["requests"] for n in prefix["per_node"]]
    assert sum(loads) == trace.requests and max(loads) <= 1.25 * min(loads) + 9


def test_cli_reports_the_gain(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tracegen.write(tmp_path / "rag.jsonl", tracegen.rag(4, 300))
    assert cli_main(["replay", str(path), "--nodes", "4", "--route", "prefix"]) == 0
    out = capsys.readouterr().out
    assert "prefix routing gains" in out and "per node" in out
