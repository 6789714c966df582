"""The `kvtier` command as a user runs it: help texts, config checking, the demo."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import config_data

KVTIER = [sys.executable, "-m", "kvtier.cli.main"]


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*KVTIER, *args], capture_output=True, text=True, timeout=timeout)


def demo(fs_dir: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    """A small demo: two clients, its filesystem tier in `fs_dir`."""
    return run("demo", "--clients", "2", "--fs-dir", str(fs_dir), *flags)


@pytest.mark.parametrize("command", [[], ["agent"], ["demo"], ["bench"], ["peer-keys"]])
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


def test_demo_json_reports_hits_and_cleans_up(tmp_path: Path) -> None:
    before = {p for p in os.listdir("/dev/shm") if p.startswith("kvtier-demo-")}
    fs_dir = tmp_path / "demo-fs"
    proc = demo(fs_dir, "--conversations", "2", "--turns", "3", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    summary = report["summary"]
    assert summary["clients"] == 2 and summary["turns"] == 12
    assert summary["corrupt_loads"] == 0
    # Conversations share system prompts and grow turn by turn, so later turns must hit.
    assert 0.3 < summary["hit_rate"] < 1.0
    assert summary["prefill_tokens_avoided"] > 0
    assert summary["bytes_loaded"] == report["agent"]["host"]["slot_bytes"] * sum(
        c["chunks_loaded"] for c in report["clients"]
    )
    # The second node loads, verified, what the first node's agent holds: every chunk it
    # did not already hold came through the peer tier.
    second = report["second_node"]
    assert second["corrupt_loads"] == 0 and second["chunks_from_peer"] > 0
    assert second["chunks_loaded"] == second["chunks_from_peer"] + second["chunks_local"]
    assert second["nixl_reads"] + second["zmq_reads"] == second["chunks_from_peer"]
    after = {p for p in os.listdir("/dev/shm") if p.startswith("kvtier-demo-")}
    assert after - before == set()  # the demo's pool and socket directory are gone
    assert not fs_dir.exists()


def test_demo_filesystem_tier_serves_what_the_small_pool_evicted(tmp_path: Path) -> None:
    def small_pool(*extra: str) -> dict[str, Any]:
        proc = demo(tmp_path / "fs", "--capacity", "4Mi", "--turns", "4", "--json", *extra)
        assert proc.returncode == 0, proc.stderr
        return dict(json.loads(proc.stdout))

    tiered, host_only = small_pool(), small_pool("--no-fs")
    assert tiered["summary"]["evictions"] > 0
    assert tiered["summary"]["hits_from_filesystem"] > 0
    assert tiered["agent"]["tiers"][0]["counts"]["promotions"] > 0
    assert host_only["summary"]["hits_from_filesystem"] == 0
    assert tiered["summary"]["hit_rate"] > host_only["summary"]["hit_rate"]


def test_demo_plot_is_a_png(tmp_path: Path) -> None:
    png = tmp_path / "demo.png"
    proc = demo(tmp_path / "fs", "--conversations", "2", "--turns", "2", "--plot", str(png))
    assert proc.returncode == 0, proc.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_peer_keys_writes_a_matching_pair_and_never_overwrites_it(tmp_path: Path) -> None:
    import zmq

    proc = run("peer-keys", str(tmp_path / "curve"))
    assert proc.returncode == 0, proc.stderr
    assert "kubectl create secret generic" in proc.stdout
    public = (tmp_path / "curve" / "public.key").read_bytes()
    secret = (tmp_path / "curve" / "secret.key").read_bytes()
    assert len(public) == len(secret) == 40 and zmq.curve_public(secret) == public
    # the secret is its owner's alone whatever the umask (the CLI runs under the default 022)
    assert (tmp_path / "curve" / "secret.key").stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "curve" / "public.key").stat().st_mode & 0o777 == 0o644
    again = run("peer-keys", str(tmp_path / "curve"))
    assert again.returncode == 2 and "not overwriting" in again.stderr
    assert (tmp_path / "curve" / "secret.key").read_bytes() == secret
    assert (tmp_path / "curve" / "public.key").read_bytes() == public


def test_peer_keys_into_a_file_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    for where in (tmp_path / "a-file", tmp_path / "a-file" / "sub"):
        proc = run("peer-keys", str(where))
        assert proc.returncode == 2 and "cannot write the keys" in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr


def test_trace_with_a_bad_endpoint_or_timeout_is_a_message() -> None:
    proc = run("trace", "--agent", "garbage")
    assert proc.returncode == 2 and "must be ipc://PATH" in proc.stderr
    assert "Traceback" not in proc.stderr
    for timeout in ("nan", "inf", "0", "-1"):
        proc = run("trace", "--agent", "ipc:///nonexistent/agent.sock", "--timeout", timeout)
        assert proc.returncode == 2 and "argument --timeout" in proc.stderr, proc.stderr


def test_demo_refuses_a_directory_it_did_not_write_and_leaves_it_alone(tmp_path: Path) -> None:
    """The demo empties its filesystem tier's directory before and after a run: one that
    holds anything else (a home directory given by mistake) is refused untouched, as is a
    file; one an earlier, killed run left is emptied."""
    mine = tmp_path / "notes"
    mine.mkdir()
    (mine / "todo.txt").write_text("keep")
    proc = run("demo", "--fs-dir", str(mine))
    assert proc.returncode == 2 and "--fs-dir" in proc.stderr and "todo.txt" in proc.stderr
    assert (mine / "todo.txt").read_text() == "keep"
    proc = run("demo", "--fs-dir", str(mine / "todo.txt"))
    assert proc.returncode == 2 and "not a directory" in proc.stderr
    left = tmp_path / "left"  # as a killed run leaves it
    (left / ".kvtier-demo").mkdir(parents=True)
    (left / "demo").mkdir()
    (left / "demo" / "manifest.json").write_text("{}")
    proc = demo(left, "--conversations", "1", "--turns", "2", "--json")
    assert proc.returncode == 0, proc.stderr
    assert not left.exists()


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--capacity", "0"], "--capacity"),
        (["--capacity=-5G"], "--capacity"),
        (["--capacity", "lots"], "--capacity"),
        (["--vllm-python", "/nonexistent/python"], "--vllm-python"),
        (["--clients", "0"], "--clients"),
    ],
)
def test_demo_bad_flags_are_one_clear_error_and_leave_nothing(
    tmp_path: Path, flags: list[str], said: str
) -> None:
    before = set(Path("/dev/shm").glob("kvtier-demo-*"))
    proc = demo(tmp_path / "fs", *flags)
    assert proc.returncode == 2 and said in proc.stderr and "Traceback" not in proc.stderr
    assert set(Path("/dev/shm").glob("kvtier-demo-*")) <= before


def test_vllm_config_names_a_bad_cpu_bytes(scratch: Path) -> None:
    path = scratch / "agent.yaml"
    path.write_text(yaml.safe_dump(config_data(scratch)))
    for value in ("abc", "-1"):
        proc = run("vllm-config", "--config", str(path), f"--cpu-bytes={value}")
        assert proc.returncode == 2 and "--cpu-bytes" in proc.stderr
        assert "Traceback" not in proc.stderr


def no_cluster(home: Path, **more: str) -> dict[str, str]:
    """The environment of a machine outside any cluster: no service account (none is
    mounted here), no KUBECONFIG, a home without ~/.kube."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST")
    }
    return {**env, "HOME": str(home), **more}


def test_agent_reporting_to_kubernetes_without_credentials_is_refused_before_its_pool(
    scratch: Path,
) -> None:
    """report.target kubernetes outside a cluster: one line naming the field and the fix,
    from --check and at start, before any pool file is made (it was a chained traceback
    from the reporter, after the pool was made; --check passed)."""
    data = config_data(scratch)
    data["report"] = {"target": "kubernetes", "namespace": "default", "tier": "t"}
    path = scratch / "agent.yaml"
    path.write_text(yaml.safe_dump(data))
    env = no_cluster(scratch)
    for flags in (["--check"], []):
        proc = subprocess.run(
            [*KVTIER, "agent", "--config", str(path), *flags],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
        assert proc.returncode == 2, proc.stderr
        assert "report.target" in proc.stderr and "KUBECONFIG" in proc.stderr
        assert "Traceback" not in proc.stderr
    assert not any((scratch / "pool").glob("*"))


def test_agent_check_makes_no_directory(scratch: Path) -> None:
    """`--check` validates and exits: a missing tier directory (and poolDir, runDir) is
    judged by the directory it would be made in, and not made; one that could not be
    made is named."""
    data = config_data(scratch)
    data["tiers"] = [
        {"name": "fs", "filesystem": {"path": str(scratch / "a/b/fs"), "capacity": "1Gi"}}
    ]
    path = scratch / "agent.yaml"
    path.write_text(yaml.safe_dump(data))
    proc = run("agent", "--config", str(path), "--check")
    assert proc.returncode == 0, proc.stderr
    assert not (scratch / "a").exists() and not (scratch / "pool").exists()
    assert not (scratch / "run").exists()
    (scratch / "a").write_text("a file where a directory would be made")
    proc = run("agent", "--config", str(path), "--check")
    assert proc.returncode == 2 and "tiers[0].filesystem.path" in proc.stderr


@pytest.mark.parametrize("kubeconfig", ["garbage: [\n", "apiVersion: v1\nkind: Config\n"])
@pytest.mark.parametrize(
    "command",
    [
        [sys.executable, "-m", "kvtier.cli.kubectl", "status"],
        [*KVTIER, "csi", "--node-id", "n1"],
        [*KVTIER, "operator"],
    ],
)
def test_a_kubeconfig_that_does_not_parse_is_one_line(
    tmp_path: Path, kubeconfig: str, command: list[str]
) -> None:
    """A malformed kubeconfig, or one without its lists, gave a YAML or KeyError
    traceback from kubectl-kvtier, and csi had none of the operator's check."""
    path = tmp_path / "config"
    path.write_text(kubeconfig)
    env = no_cluster(tmp_path, KUBECONFIG=str(path))
    proc = subprocess.run(command, capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "kubeconfig cannot be read" in proc.stderr and proc.stderr.count("\n") == 1
