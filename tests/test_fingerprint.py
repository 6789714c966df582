"""The run fingerprint's own rules, without vLLM (tests/vllm/ covers it inside vLLM)."""

from __future__ import annotations

from pathlib import Path

from kvtier.agent.chunk import CHUNK_VERSION
from kvtier.agent.tiers.base import namespace_dir
from kvtier.api import fingerprint


def test_chunk_format_version_is_the_agents() -> None:
    assert fingerprint.CHUNK_FORMAT_VERSION == CHUNK_VERSION


def make(**changes: object) -> fingerprint.Fingerprint:
    components: dict[str, object] = {name: {"value": name} for name in fingerprint.TAGS}
    return fingerprint.Fingerprint("org/Llama-3.1-8B-Instruct", {**components, **changes})


def test_namespace_names_the_model_and_a_tag_per_component() -> None:
    namespace = make().namespace
    parsed = fingerprint.parse_namespace(namespace)
    assert parsed is not None
    assert parsed.model == "org_Llama-3.1-8B-Instruct"
    assert set(parsed.tags) == set(fingerprint.TAGS)
    assert namespace_dir(namespace) == namespace  # a directory and object prefix as it is
    assert fingerprint.parse_namespace("llama-3-8b-0a1b2c3d4e") is None  # an older form


def test_any_component_changes_the_namespace_and_is_named() -> None:
    for name in fingerprint.TAGS:
        other = make(**{name: "changed"}).namespace
        assert other != make().namespace
        assert fingerprint.differing_components([make().namespace, other]) == [name]


def test_weights_identity_sees_values_not_only_shapes(tmp_path: Path) -> None:
    header = b'{"w":{"dtype":"F32","shape":[4096],"data_offsets":[0,16384]}}'
    weights = tmp_path / "model.safetensors"
    payload = bytearray(16384)
    weights.write_bytes(len(header).to_bytes(8, "little") + header + payload)
    first = fingerprint.weights_identity(str(tmp_path), None, None)
    payload[-1] = 1  # a fine-tune: same file size, same header
    weights.write_bytes(len(header).to_bytes(8, "little") + header + payload)
    second = fingerprint.weights_identity(str(tmp_path), None, None)
    assert first is not None and second is not None and first != second
    (tmp_path / "notes.txt").write_text("not a weight file")
    assert fingerprint.weights_identity(str(tmp_path), None, None) == second


def test_weights_from_the_hugging_face_cache_carry_the_commit(tmp_path: Path) -> None:
    repo = tmp_path / "hub" / "models--org--tiny"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "snapshots" / commit / "model.bin").write_bytes(b"\0" * 100)
    identity = fingerprint.weights_identity("org/tiny", None, str(tmp_path / "hub"))
    assert identity is not None and identity["commit"] == commit
    assert fingerprint.weights_identity("org/absent", None, str(tmp_path / "hub")) is None


def test_tier_status_says_what_differs_between_engines_of_one_model() -> None:
    """What `kubectl kvtier explain-miss` shows as the FingerprintConflict message."""
    import datetime as dt

    from kvtier.operator.status import aggregate

    now = dt.datetime(2026, 11, 30, tzinfo=dt.UTC)
    namespaces = [make().namespace, make(weights="fine-tuned").namespace]
    nodes = [
        {"status": {"heartbeat": "2026-11-30T00:00:00Z", "fingerprints": [ns]}} for ns in namespaces
    ]
    conditions = {c["type"]: c for c in aggregate(nodes, 2, now, 60)["conditions"]}
    conflict = conditions["FingerprintConflict"]
    assert conflict["status"] == "True"
    assert "org_Llama-3.1-8B-Instruct: same model name, different weights" in conflict["message"]
