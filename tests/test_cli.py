"""The `kvtier` command as a user runs it: help texts, config checking, the demo."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import config_data

KVTIER = [sys.executable, "-m", "kvtier.cli"]


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*KVTIER, *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("command", [[], ["agent"], ["demo"], ["bench"]])
def test_help(command: list[str]) -> None:
    proc = run(*command, "--help")
    assert proc.returncode == 0
    assert "usage: kvtier" in proc.stdout


def test_console_script_installed() -> None:
    script = Path(sys.executable).parent / "kvtier"
    assert script.exists()
    assert subprocess.run([script, "--help"], capture_output=True).returncode == 0


def test_agent_check_prints_defaults(scratch: Path) -> None:
    path = scratch / "agent.yaml"
    path.write_text(yaml.safe_dump(config_data(scratch)))
    proc = run("agent", "--config", str(path), "--check")
    assert proc.returncode == 0, proc.stderr
    printed = yaml.safe_load(proc.stdout)
    assert printed["host"]["policy"] == "lru" and printed["leaseTimeoutSeconds"] == 30


def test_agent_check_names_every_bad_field(scratch: Path) -> None:
    data = config_data(scratch, policy="mru")
    data["leaseTimeoutSeconds"] = -5
    path = scratch / "agent.yaml"
    path.write_text(yaml.safe_dump(data))
    proc = run("agent", "--config", str(path), "--check")
    assert proc.returncode == 2
    assert "host.policy" in proc.stderr and "leaseTimeoutSeconds" in proc.stderr


def test_missing_config_file(scratch: Path) -> None:
    proc = run("agent", "--config", str(scratch / "nope.yaml"))
    assert proc.returncode == 2 and "fix: pass an existing file" in proc.stderr


def test_demo_json_reports_hits_and_cleans_up() -> None:
    before = set(os.listdir("/dev/shm"))
    proc = run("demo", "--clients", "2", "--conversations", "2", "--turns", "3", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    summary = report["summary"]
    assert summary["clients"] == 2 and summary["turns"] == 12
    assert summary["corrupt_loads"] == 0
    # Conversations share system prompts and grow turn by turn, so later turns must hit.
    assert 0.3 < summary["hit_rate"] < 1.0
    assert summary["prefill_tokens_avoided"] > 0
    assert summary["bytes_loaded"] == report["agent"]["slot_bytes"] * sum(
        c["chunks_loaded"] for c in report["clients"]
    )
    assert set(os.listdir("/dev/shm")) - before == set()


def test_demo_small_pool_evicts() -> None:
    proc = run("demo", "--clients", "2", "--capacity", "4Mi", "--turns", "3", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["summary"]["evictions"] > 0
    assert report["agent"]["chunks"] <= report["agent"]["slots"]
