"""The agent's report: built from its stats, published at a bounded rate."""

from __future__ import annotations

import datetime as dt
import itertools
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from msgspec.structs import replace

from kvtier.agent.report.publisher import Reporter
from kvtier.agent.report.registry import FileRegistry, KubernetesRegistry
from kvtier.api.config import ReportConfig
from kvtier.api.node_status import NodeStatus, build_report, read_node_status
from kvtier.local import wait as polling
from tests.kube_api import KubeAPI
from tests.stats_fixtures import STATS


def test_report_from_stats() -> None:
    report = build_report(STATS, dt.datetime(2026, 1, 1, tzinfo=dt.UTC)).to_manifest()
    assert report["heartbeat"] == "2026-01-01T00:00:00Z"
    assert [t["name"] for t in report["tiers"]] == ["host", "shared-fs"]
    assert report["tiers"][0]["misses"] == 4
    assert report["hits"] == 8 and report["lookups"] == 10
    assert report["summary"] == {"host": "3Mi/8Mi", "hitRate": "80%", "peers": 0}
    with_peers = build_report(
        replace(STATS, peers=["tcp://10.0.0.2:5557"]), dt.datetime.now(dt.UTC)
    )
    assert with_peers.peers == ["tcp://10.0.0.2:5557"] and with_peers.summary.peers == 1
    assert report["fingerprints"] == ["llama-3-8b-aa", "qwen-bb"]
    assert report["conditions"][0]["type"] == "TiersHealthy"
    assert report["conditions"][0]["status"] == "True" and report["tiers"][1]["healthy"]


def test_an_unhealthy_tier_is_a_false_condition_of_the_node_and_of_the_tier() -> None:
    """A tier the agent skips (its operations kept failing) shows on the KVCacheNode and,
    aggregated, on the KVCacheTier, naming node and tier."""
    from kvtier.operator.status import aggregate
    from tests.apiserver_rules import admit, load_crd

    failing = replace(STATS, tiers=[replace(STATS.tiers[0], healthy=False)])
    now = dt.datetime.now(dt.UTC)
    report = build_report(failing, now).to_manifest()
    (condition,) = report["conditions"]
    assert condition["status"] == "False" and "shared-fs" in condition["message"]
    assert report["tiers"][1]["healthy"] is False
    node = {
        "apiVersion": "kvtier.io/v1alpha1",
        "kind": "KVCacheNode",
        "metadata": {"name": "llama-gpu-1", "namespace": "inference"},
        "spec": {"tier": "llama", "node": "gpu-1"},
        "status": report,
    }
    assert admit(load_crd("kvcachenode.yaml"), node)[1] == []  # the CRD keeps the fields
    tier_conditions = {c["type"]: c for c in aggregate([node], 1, now, 60)["conditions"]}
    assert tier_conditions["TiersHealthy"]["status"] == "False"
    assert "gpu-1" in tier_conditions["TiersHealthy"]["message"]
    assert "shared-fs" in tier_conditions["TiersHealthy"]["message"]


def _schema_fields(schema: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """Property names, nested, of a JSON schema (msgspec's or the CRD's)."""
    if "$ref" in schema:
        schema = defs[schema["$ref"].rsplit("/", 1)[1]]
    if "anyOf" in schema:
        return _schema_fields(next(s for s in schema["anyOf"] if s.get("type") != "null"), defs)
    if schema.get("type") == "array":
        return _schema_fields(schema["items"], defs)
    props = schema.get("properties", {})
    return {name: _schema_fields(sub, defs) for name, sub in props.items()}


def test_the_status_model_is_the_crds_status() -> None:
    """The one definition of a KVCacheNode status has exactly the CRD's fields, nested, so
    nothing the agent writes is pruned by the API server and nothing the CRD offers is unset."""
    import msgspec

    from tests.apiserver_rules import load_crd

    crd = load_crd("kvcachenode.yaml")["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    (model,), defs = msgspec.json.schema_components([NodeStatus])
    assert _schema_fields(model, defs) == _schema_fields(crd["properties"]["status"], {})


def test_a_damaged_node_status_reads_as_empty_not_as_an_error() -> None:
    assert read_node_status({"status": {"tiers": "lots", "hits": "x"}}) == NodeStatus()
    assert read_node_status({}) == NodeStatus()
    partial = read_node_status({"status": {"hits": 3, "lookups": 4, "extra": 1}})
    assert (partial.hits, partial.lookups, partial.hit_rate) == (3, 4, 0.75)


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
    publishes, last = run_reporter(
        tmp_path, lambda: replace(STATS, host=replace(STATS.host, lookups=next(counter))), 1.0
    )
    assert publishes <= 1.0 / 0.05 + 2
    assert last["lookups"] > 0


def test_a_restarted_agent_updates_its_kvcachenode_endpoint_and_curve_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over the emulated API server: the agent that replaces a node's previous one finds its
    KVCacheNode (409 on create) and rewrites the peer endpoint and the CURVE public key it
    serves with, which is what the other agents then read (NIXL metadata is never published)."""
    with KubeAPI(tmp_path) as api:
        monkeypatch.setenv("KUBECONFIG", str(api.kubeconfig))
        config = ReportConfig.model_validate(
            {"target": "kubernetes", "namespace": "default", "tier": "llama", "node": "gpu-1"}
        )
        for endpoint, curve_key in (
            ("tcp://10.0.0.1:5557", "old"),
            ("tcp://10.0.0.9:5557", "new"),
        ):
            registry = KubernetesRegistry(config, "gpu-1")
            registry.advertise(endpoint, curve_key)
            registry.publish({"heartbeat": "2026-11-29T10:00:00Z"})
        other = KubernetesRegistry(config, "gpu-2")
        (member,) = other.members()
        other.close()
        assert (member.node, member.endpoint, member.curve_key) == (
            "gpu-1",
            "tcp://10.0.0.9:5557",
            "new",
        )


def test_file_registry_lists_members_with_their_curve_keys(tmp_path: Path) -> None:
    a, b = FileRegistry(tmp_path, "a"), FileRegistry(tmp_path, "b")
    a.advertise("tcp://127.0.0.1:1", "a-public-key")
    b.advertise("tcp://127.0.0.1:2")  # unauthenticated
    for registry in (a, b):
        registry.publish(build_report(STATS, dt.datetime.now(dt.UTC)).to_manifest())
    members = {m.node: m for m in b.members()}
    assert members["a"].curve_key == "a-public-key" and members["b"].curve_key is None
    assert members["a"].endpoint == "tcp://127.0.0.1:1"


def test_membership_follows_kvcachenodes_through_a_watch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An agent learns of agents that come, move and go from one watch on the API server
    (not by listing every KVCacheNode each period)."""
    with KubeAPI(tmp_path) as api:
        monkeypatch.setenv("KUBECONFIG", str(api.kubeconfig))
        config = ReportConfig.model_validate(
            {"target": "kubernetes", "namespace": "default", "tier": "llama"}
        )

        def join(node: str, endpoint: str) -> None:
            registry = KubernetesRegistry(config, node)
            registry.advertise(endpoint)
            registry.publish({"heartbeat": "2026-11-29T10:00:00Z"})

        me = KubernetesRegistry(config, "gpu-0")
        join("gpu-0", "tcp://10.0.0.10:5557")
        assert [m.node for m in me.members()] == ["gpu-0"]

        def endpoints() -> dict[str, str]:
            return {m.node: m.endpoint for m in me.members()}

        join("gpu-1", "tcp://10.0.0.11:5557")
        wait_until(lambda: endpoints().get("gpu-1") == "tcp://10.0.0.11:5557")
        join("gpu-1", "tcp://10.0.0.99:5557")  # its agent restarted elsewhere
        wait_until(lambda: endpoints().get("gpu-1") == "tcp://10.0.0.99:5557")
        code, _ = api.request(
            "DELETE", "/apis/kvtier.io/v1alpha1/namespaces/default/kvcachenodes/llama-gpu-1"
        )
        assert code == 200
        wait_until(lambda: "gpu-1" not in endpoints())
        assert endpoints() == {"gpu-0": "tcp://10.0.0.10:5557"}
        me.close()  # the watch ends with it
        assert "kvtier-members" not in {t.name for t in threading.enumerate()}


def wait_until(predicate: Any, timeout: float = 10.0) -> None:
    polling.wait_for(predicate, timeout)
