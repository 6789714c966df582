"""The node's KV event stream from the operator's side: `spec.agent.events` (off by default)
rendered into the agent's config, container ports and the headless Service, authenticated
with the peer tier's key pair where the tier has one, within Pod Security `restricted`; and
the stream's addresses in the agent's KVCacheNode status, where routers find them."""

from __future__ import annotations

import copy
import datetime as dt
import os
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from msgspec.structs import replace

from kvtier.api.config import ConfigError, parse_config
from kvtier.api.node_status import build_report, read_node_status
from kvtier.api.stats import EventStreamStats
from kvtier.operator.builders import build_children
from tests.apiserver_rules import admit, load_crd
from tests.manifests import example_tier
from tests.operator_fixtures import SETTINGS, by_kind, tier
from tests.pod_security import restricted
from tests.stats_fixtures import STATS

GOLDEN = Path(__file__).resolve().parent / "golden" / "llama-events-children.yaml"
PEERS = {"name": "peers", "peer": {"port": 5557}}


def with_events(events: dict[str, Any] | None, *more_tiers: dict[str, Any]) -> dict[str, Any]:
    """The example tier (with `more_tiers`) as the API server stores it, with
    `spec.agent.events`."""
    resource = copy.deepcopy(example_tier("8Gi", *more_tiers))
    if events is not None:
        resource["spec"]["agent"] = {"events": events}
    stored, errors = admit(load_crd("kvcachetier.yaml"), resource)
    assert errors == []
    return stored


def agent_config(children: list[dict[str, Any]]) -> Any:
    return parse_config(yaml.safe_load(by_kind(children)["ConfigMap"]["data"]["agent.yaml"]))


def test_the_stream_is_off_by_default() -> None:
    children = build_children(tier(), SETTINGS)
    assert not agent_config(children).events.enabled
    ports = by_kind(children)["DaemonSet"]["spec"]["template"]["spec"]["containers"][0]["ports"]
    assert [p["name"] for p in ports] == ["metrics"]
    assert [p["name"] for p in by_kind(children)["Service"]["spec"]["ports"]] == ["metrics"]


def test_a_port_turns_on_the_stream_its_ports_and_service() -> None:
    children = build_children(with_events({"port": 5558, "topic": "kv@{node}@llama"}), SETTINGS)
    events = agent_config(children).events
    assert events.enabled and events.topic == "kv@{node}@llama"
    assert (events.bind, events.replay_bind) == ("tcp://0.0.0.0:5558", "tcp://0.0.0.0:5559")
    assert events.curve_key_dir is None  # no peer tier: no key pair to serve with
    pod = by_kind(children)["DaemonSet"]["spec"]["template"]["spec"]
    ports = {p["name"]: p["containerPort"] for p in pod["containers"][0]["ports"]}
    assert ports == {"metrics": 9400, "events": 5558, "events-replay": 5559}
    service = by_kind(children)["Service"]["spec"]
    assert service["clusterIP"] == "None"
    assert {p["name"]: (p["port"], p["targetPort"]) for p in service["ports"]} == {
        "metrics": (9400, "metrics"),
        "events": (5558, "events"),
        "events-replay": (5559, "events-replay"),
    }
    for child in children:
        kubernetes_validate.validate(child, "1.33", strict=True)
    assert restricted(pod) == []


def test_with_a_peer_tier_the_stream_serves_with_the_peers_key_pair() -> None:
    """The key pair the pod already mounts for its peer tier; no second Secret or volume."""
    plain = build_children(with_events(None, PEERS), SETTINGS)
    children = build_children(with_events({"port": 6000, "replayPort": 6100}, PEERS), SETTINGS)
    config = agent_config(children)
    assert str(config.events.curve_key_dir) == "/etc/kvtier/curve/peers"
    assert config.events.replay_bind == "tcp://0.0.0.0:6100"
    (peer,) = [t for t in config.tiers if t.peer is not None]
    assert config.events.curve_key_dir == peer.peer.curve_key_dir
    pod = by_kind(children)["DaemonSet"]["spec"]["template"]["spec"]
    plain_pod = by_kind(plain)["DaemonSet"]["spec"]["template"]["spec"]
    assert pod["volumes"] == plain_pod["volumes"]
    assert pod["containers"][0]["volumeMounts"] == plain_pod["containers"][0]["volumeMounts"]
    assert restricted(pod) == []


def test_children_with_the_stream_match_the_golden_manifests() -> None:
    """Regenerate with KVTIER_UPDATE_GOLDEN=1."""
    resource = with_events({"port": 5558, "topic": "kv@{node}@llama"}, PEERS)
    rendered = yaml.safe_dump_all(build_children(resource, SETTINGS), sort_keys=True)
    if os.environ.get("KVTIER_UPDATE_GOLDEN"):
        GOLDEN.write_text(rendered)
    assert rendered == GOLDEN.read_text()


@pytest.mark.parametrize(
    ("events", "error"),
    [
        ({}, "spec.agent.events: 'port' is a required"),
        ({"port": 0}, "spec.agent.events.port"),
        ({"port": 65536}, "spec.agent.events.port"),
        ({"port": 5558, "replayPort": 5558}, "replayPort"),
        ({"port": 65535}, "replayPort"),  # port + 1 is no port
        ({"port": 5558, "topic": ""}, "spec.agent.events.topic"),
    ],
)
def test_the_schema_refuses_bad_ports(events: dict[str, Any], error: str) -> None:
    resource = copy.deepcopy(example_tier("8Gi"))
    resource["spec"]["agent"] = {"events": events}
    _, errors = admit(load_crd("kvcachetier.yaml"), resource)
    assert any(error in e for e in errors), errors


@pytest.mark.parametrize(
    ("events", "taken"),
    [
        ({"port": 9400}, "spec.agent.metricsPort"),
        ({"port": 9399}, "spec.agent.metricsPort"),  # its replay port, 9400
        ({"port": 5556}, "spec.tiers[2].peer.port"),
    ],
)
def test_a_port_another_endpoint_has_is_refused_naming_both(
    events: dict[str, Any], taken: str
) -> None:
    with pytest.raises(ConfigError) as raised:
        build_children(with_events(events, PEERS), SETTINGS)
    assert "spec.agent.events" in str(raised.value) and taken in str(raised.value)


def test_the_node_status_names_the_stream_for_routers() -> None:
    stream = EventStreamStats(
        endpoint="tcp://10.0.0.7:5558",
        replay_endpoint="tcp://10.0.0.7:5559",
        topic="kv@gpu-1@{namespace}",
        curve_key="rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7",
    )
    now = dt.datetime.now(dt.UTC)
    report = build_report(replace(STATS, events=stream), now).to_manifest()
    assert report["events"] == {
        "endpoint": "tcp://10.0.0.7:5558",
        "replayEndpoint": "tcp://10.0.0.7:5559",
        "topic": "kv@gpu-1@{namespace}",
        "curveKey": stream.curve_key,
    }
    node = {
        "apiVersion": "kvtier.io/v1alpha1",
        "kind": "KVCacheNode",
        "metadata": {"name": "llama-gpu-1", "namespace": "inference"},
        "spec": {"tier": "llama", "node": "gpu-1"},
        "status": report,
    }
    stored, errors = admit(load_crd("kvcachenode.yaml"), node)
    assert errors == [] and stored["status"]["events"] == report["events"]  # not pruned
    status = read_node_status(stored)
    assert status.events is not None and status.events.endpoint == "tcp://10.0.0.7:5558"
    assert "events" not in build_report(STATS, now).to_manifest()  # no stream, no field
