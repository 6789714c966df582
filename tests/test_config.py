"""Every bad config is refused at start with a message naming the field and the fix."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvtier.agent.runtime_checks import check_runtime
from kvtier.agent.tiers import nixl_path
from kvtier.api.config import ConfigError, load_config, parse_config
from kvtier.api.units import parse_bytes
from tests.conftest import config_data


def start_agent(
    scratch: Path, name: str, data: dict[str, Any], *flags: str
) -> subprocess.CompletedProcess[str]:
    """The agent process itself, on `data` written as `name`: what a user runs."""
    path = scratch / name
    path.write_text(yaml.safe_dump(data))
    return subprocess.run(
        [sys.executable, "-m", "kvtier.agent", "--config", str(path), *flags],
        capture_output=True,
        text=True,
        timeout=60,
    )


def refuse(data: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    return str(info.value)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("4Gi", 4 << 30), ("512Mi", 512 << 20), ("1G", 10**9), (4096, 4096), ("1.5Ki", 1536)],
)
def test_quantities(text: str | int, expected: int) -> None:
    assert parse_bytes(text) == expected


def test_defaults_and_camel_case(scratch: Path) -> None:
    config = parse_config(config_data(scratch))
    assert config.host.policy == "lru"
    assert config.socket_path == scratch / "run" / "agent.sock"
    assert config.host.slot_count == 64
    again = parse_config(yaml.safe_load(config.to_yaml()))
    assert again == config


@pytest.mark.parametrize("capacity", [-1, 0, "-4Gi"])
def test_capacity_must_be_positive(scratch: Path, capacity: Any) -> None:
    message = refuse(config_data(scratch, capacity=capacity))
    assert "host.capacity must be positive" in message
    assert "fix:" in message


def test_zero_chunk_refused(scratch: Path) -> None:
    message = refuse(config_data(scratch, chunkBytes=0))
    assert "host.chunkBytes must be positive (got 0)" in message
    assert "fix: write the size of one vLLM offload row" in message


@pytest.mark.parametrize(
    ("kind", "fields", "fix"),
    [
        ("filesystem", {"path": "/mnt/kv"}, "write a positive size such as 100Gi"),
        ("objectStore", {"bucket": "kv-cache"}, "write a positive size such as 1Ti"),
    ],
)
def test_a_tier_of_no_capacity_is_refused_by_its_place_with_the_fix(
    scratch: Path, kind: str, fields: dict[str, Any], fix: str
) -> None:
    data = config_data(scratch)
    fast = {"name": "fast", "filesystem": {"path": "/mnt/fast", "capacity": "1Gi"}}
    data["tiers"] = [fast, {"name": "slow", kind: {**fields, "capacity": "-1Gi"}}]
    message = refuse(data)
    assert f"tiers.1.{kind}.capacity must be positive (got {-(1 << 30)}); fix: {fix}" in message
    assert "tiers.0" not in message


def test_a_tiers_watermarks_are_named_by_its_place_with_the_fix(scratch: Path) -> None:
    """Inverted watermarks were named `filesystem.lowWatermark`, not by the tier's place;
    a watermark past 1 had no fix."""
    data = config_data(scratch)
    fs = {"path": "/mnt/fast", "capacity": "1Gi"}
    data["tiers"] = [
        {"name": "a", "filesystem": fs},
        {"name": "b", "filesystem": {**fs, "lowWatermark": 0.9, "highWatermark": 0.5}},
    ]
    assert "  - tiers.1.filesystem.lowWatermark (0.9) must be below" in refuse(data)
    data["tiers"] = [{"name": "a", "filesystem": {**fs, "highWatermark": 5}}]
    message = refuse(data)
    assert "  - tiers.0.filesystem.highWatermark" in message and "fix: a share" in message


def test_a_file_that_is_not_yaml_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text("name: [unclosed\nhost: {}\n")
    with pytest.raises(ConfigError) as refused:
        load_config(path)
    (problem,) = refused.value.problems
    assert "not valid YAML" in problem and "\n" not in problem


def test_slot_larger_than_pool_refused(scratch: Path) -> None:
    message = refuse(config_data(scratch, capacity="1Mi", chunkBytes="2Mi"))
    assert "host.chunkBytes" in message and "host.capacity" in message
    assert "raise host.capacity or lower host.chunkBytes" in message


def test_unknown_policy_refused(scratch: Path) -> None:
    message = refuse(config_data(scratch, policy="fifo"))
    assert "host.policy" in message and "'fifo'" in message
    assert "use one of: lru, arc, prefix" in message


def test_unreadable_size_refused(scratch: Path) -> None:
    message = refuse(config_data(scratch, capacity="lots"))
    assert "host.capacity" in message and "quantity" in message


def test_unknown_field_refused(scratch: Path) -> None:
    data = config_data(scratch)
    data["host"]["capacityy"] = "1Gi"
    assert "host.capacityy: unknown field" in refuse(data)


def test_missing_host_refused(scratch: Path) -> None:
    data = config_data(scratch)
    del data["host"]
    assert "host: required field is missing" in refuse(data)


def test_unwritable_pool_dir_refused(scratch: Path) -> None:
    blocker = scratch / "a-file"
    blocker.write_text("not a directory")
    config = parse_config(config_data(scratch, poolDir=str(blocker / "pool")))
    with pytest.raises(ConfigError) as info:
        check_runtime(config)
    assert "host.poolDir" in str(info.value) and "not a writable directory" in str(info.value)


def test_unwritable_run_dir_refused(scratch: Path) -> None:
    data = config_data(scratch)
    data["runDir"] = "/proc/kvtier-run"
    with pytest.raises(ConfigError) as info:
        check_runtime(parse_config(data))
    assert "runDir" in str(info.value)


def test_nixl_data_path_without_nixl_refused(
    scratch: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NIXL absent (as on an image built without it): asking for it is refused by name, and
    `auto` still starts (over the stream or ZMQ)."""
    monkeypatch.setattr(nixl_path, "_nixl", None)
    data = config_data(scratch)
    data["report"] = {"target": "file", "directory": str(scratch / "registry")}
    data["tiers"] = [{"name": "peers", "peer": {"dataPath": "nixl"}}]
    with pytest.raises(ConfigError) as info:
        check_runtime(parse_config(data))
    assert "tiers[0].peer.dataPath is 'nixl' but NIXL is not installed" in str(info.value)
    data["tiers"][0]["peer"]["dataPath"] = "auto"
    check_runtime(parse_config(data))
    data["tiers"][0]["peer"]["dataPath"] = "rdma"
    assert "tiers.0.peer.dataPath: Input should be 'auto', 'nixl', 'tcp' or 'zmq'" in refuse(data)


def test_encrypted_bytes_never_take_nixl(scratch: Path) -> None:
    """NIXL moves bytes in the clear: `encryptBytes` with `dataPath: nixl` is refused by
    name, with the fix; with `auto` it is accepted (the agent then leaves NIXL out:
    `tests/test_peer_stream.py`)."""
    data = config_data(scratch)
    data["report"] = {"target": "file", "directory": str(scratch / "registry")}
    data["tiers"] = [{"name": "peers", "peer": {"dataPath": "nixl", "encryptBytes": True}}]
    message = refuse(data)
    assert "encryptBytes with dataPath 'nixl'" in message and "'auto' or 'tcp'" in message
    data["tiers"][0]["peer"]["dataPath"] = "auto"
    peer = parse_config(data).tiers[0].peer
    assert peer is not None and peer.encrypt_bytes and peer.data_path == "auto"


def test_not_yaml_mapping(tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="YAML mapping"):
        load_config(path)


def test_agent_refuses_bad_config_at_start(scratch: Path) -> None:
    """The agent process itself exits non-zero with the field named, and creates nothing."""
    proc = start_agent(scratch, "bad.yaml", config_data(scratch, capacity=0))
    assert proc.returncode == 2
    assert "host.capacity must be positive" in proc.stderr
    assert not (scratch / "pool").exists()


def test_access_log_size_and_sampling_are_checked(scratch: Path) -> None:
    data = config_data(scratch)
    config = parse_config({**data, "accessLog": {"maxKeys": 4096, "sampleRate": 0.25}})
    assert (config.access_log.max_keys, config.access_log.sample_rate) == (4096, 0.25)
    message = refuse({**data, "accessLog": {"sampleRate": 0}})
    assert "accessLog.sampleRate" in message


def test_an_event_topic_naming_another_field_is_refused_with_the_fix() -> None:
    """The topic is filled in with str.format: a field other than {node} and {namespace}
    would fail every batch the agent publishes."""
    from kvtier.api.config import EventStreamConfig

    assert EventStreamConfig(topic="kv@{node}@{namespace}").topic
    with pytest.raises(ValueError, match=r"events\.topic .*fix: use only those two"):
        EventStreamConfig(topic="kv@{node}@{model}")


@pytest.mark.parametrize(
    "field",
    ["reapIntervalSeconds", "leaseTimeoutSeconds", "tierBudgetSeconds"],
)
@pytest.mark.parametrize("value", [float("inf"), 1e10, 1e300])
def test_periods_past_an_hour_are_refused_with_the_fix(
    scratch: Path, field: str, value: float
) -> None:
    """`.inf` and 1e10 used to pass, then crash the agent's loop (zmq's poll timeout) or
    lease arithmetic at run time."""
    message = refuse({**config_data(scratch), field: value})
    assert field in message and "up to 3600" in message, message


def test_report_periods_past_an_hour_are_refused(scratch: Path) -> None:
    """An infinite report period used to kill the report thread (time_t overflow), and with
    it every peer's view of this agent."""
    for field in ("intervalSeconds", "minIntervalSeconds"):
        report = {"target": "file", "directory": str(scratch / "reports"), field: float("inf")}
        message = refuse({**config_data(scratch), "report": report})
        assert f"report.{field}" in message and "up to 3600" in message, message


def test_a_run_dir_too_long_for_its_socket_is_refused_with_the_fix(scratch: Path) -> None:
    data = config_data(scratch)
    message = refuse({**data, "runDir": str(scratch / ("r" * 100))})
    assert "runDir" in message and "a shorter runDir" in message, message
    fits = scratch / ("r" * (107 - len(str(scratch)) - len("/agent.sock") - 1))
    assert parse_config({**data, "runDir": str(fits)}).run_dir == fits


def test_an_infinite_reap_interval_never_reaches_a_running_agent(scratch: Path) -> None:
    """What `--check` accepts, the agent starts with: the refusal is the same in both."""
    data = {**config_data(scratch), "reapIntervalSeconds": float("inf")}
    for flags in (["--check"], []):
        proc = start_agent(scratch, "inf.yaml", data, *flags)
        assert proc.returncode == 2 and "reapIntervalSeconds" in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr


def test_a_metrics_port_already_taken_stops_the_agent_with_the_field(scratch: Path) -> None:
    """It used to end in an OSError traceback; now the field and the fix, and exit code 2,
    before any other thread of the agent starts (so nothing keeps the process alive)."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        data = {
            **config_data(scratch),
            "metrics": {"host": "127.0.0.1", "port": taken.getsockname()[1]},
        }
        proc = start_agent(scratch, "port.yaml", data)
    assert proc.returncode == 2, proc.stderr
    assert "metrics.port: cannot listen on 127.0.0.1" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_messages_say_what_they_got_once_and_a_bad_name_has_its_fix(scratch: Path) -> None:
    message = refuse(config_data(scratch, capacity=1.5))
    assert message.count("1.5") == 1, message
    message = refuse({**config_data(scratch), "name": "Bad_Name"})
    assert "name:" in message and "fix: use the KVCacheTier's name" in message, message
