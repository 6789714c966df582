"""`kubectl kvtier trace`: a node's access log fetched through the Kubernetes API.

The plug-in finds the tier's agent pods through the API server (the emulated one here) and
runs `kvtier trace` inside the chosen pod with `kubectl exec`. The emulated API server has no
exec subresource, so a stand-in `kubectl` on PATH plays the API server, kubelet and container
runtime: it checks the exec it is asked for (namespace, pod, container, command) and runs the
command as the pod would, against a real agent whose config sits where the pod mounts it.
What only a real cluster checks: the exec protocol itself, RBAC refusing `pods/exec`, and
that the image's `kvtier` and `/etc/kvtier/agent.yaml` are where the DaemonSet puts them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvtier.api.config import AgentConfig
from kvtier.local.agent import AgentProcess
from kvtier.traces.replay import load_trace, replay_agent
from kvtier.traces.tracegen import multi_turn
from tests.conftest import ROW
from tests.kube_api import KubeAPI

NS = "inference"
BIN = Path(sys.executable).parent

FAKE_KUBECTL = f"""#!{sys.executable}
import json, os, sys
args = sys.argv[1:]
with open(os.environ["FAKE_KUBECTL_LOG"], "a") as log:
    log.write(json.dumps(args) + "\\n")
if os.environ.get("FAKE_FORBID"):
    sys.exit('Error from server (Forbidden): pods "' + args[3] + '" is forbidden: User '
             '"dev" cannot create resource "pods/exec" in API group "" in the namespace '
             '"' + args[2] + '"')
assert args[:2] == ["exec", "-n"] and args[4:7] == ["-c", "agent", "--"], args
if args[3] != os.environ["FAKE_POD"]:
    sys.exit('Error from server (NotFound): pods "' + args[3] + '" not found')
command = args[7:]
mounts = {{"kvtier": os.environ["FAKE_KVTIER"],
          "/etc/kvtier/agent.yaml": os.environ["FAKE_CONFIG"]}}
command = [mounts.get(part, part) for part in command]
os.execv(command[0], command)
"""


@pytest.fixture
def api(tmp_path: Path) -> Iterator[KubeAPI]:
    with KubeAPI(tmp_path) as api:
        agent_labels = {
            "app.kubernetes.io/name": "kvtier-agent",
            "app.kubernetes.io/instance": "llama",
            "kvtier.io/tier": "llama",
        }
        pods = [
            ("llama-agent-aaaaa", "gpu-a", agent_labels, "Running"),
            ("llama-agent-bbbbb", "gpu-b", agent_labels, "Running"),
            ("llama-agent-ccccc", "gpu-c", agent_labels, "Pending"),
            ("other-agent-ddddd", "gpu-a", {**agent_labels, "kvtier.io/tier": "other"}, "Running"),
            ("vllm-0", "gpu-a", {"app": "vllm"}, "Running"),
        ]
        for name, node, labels, phase in pods:
            api.create(
                f"/api/v1/namespaces/{NS}/pods",
                {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {"name": name, "namespace": NS, "labels": labels},
                    "spec": {"nodeName": node, "containers": [{"name": "agent", "image": "x"}]},
                    "status": {"phase": phase},
                },
            )
        yield api


def kubectl_kvtier(
    api: KubeAPI, env: dict[str, str], *args: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "kubectl-kvtier"), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **env, "KUBECONFIG": str(api.kubeconfig)},
    )


def stand_in_kubectl(tmp_path: Path, config: AgentConfig, pod: str) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    kubectl = bin_dir / "kubectl"
    kubectl.write_text(FAKE_KUBECTL)
    kubectl.chmod(0o755)
    config_file = tmp_path / "agent.yaml"
    config_file.write_text(config.to_yaml())
    return {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "FAKE_KUBECTL_LOG": str(tmp_path / "kubectl.log"),
        "FAKE_POD": pod,
        "FAKE_KVTIER": str(BIN / "kvtier"),
        "FAKE_CONFIG": str(config_file),
    }


def test_trace_from_a_node_through_exec(
    api: KubeAPI,
    make_config: Callable[..., AgentConfig],
    agent_factory: Callable[[AgentConfig], AgentProcess],
    tmp_path: Path,
) -> None:
    agent = agent_factory(make_config(policy="prefix"))
    records = multi_turn(seed=4, conversations=40)
    original_file = tmp_path / "chats.jsonl"
    original_file.write_text("".join(json.dumps(r) + "\n" for r in records))
    original = load_trace(original_file)
    replay_agent(original, agent.config.endpoint, ROW)
    env = stand_in_kubectl(tmp_path, agent.config, "llama-agent-bbbbb")

    out = tmp_path / "gpu-b.jsonl"
    done = kubectl_kvtier(
        api,
        env,
        "trace",
        "llama",
        "-n",
        NS,
        "--node",
        "gpu-b",
        "-o",
        str(out),
        "--block-size",
        "512",
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"gpu-b\t{out}"
    (call,) = [json.loads(line) for line in Path(env["FAKE_KUBECTL_LOG"]).read_text().splitlines()]
    assert call[:7] == ["exec", "-n", NS, "llama-agent-bbbbb", "-c", "agent", "--"]
    assert call[7:11] == ["kvtier", "trace", "--config", "/etc/kvtier/agent.yaml"]
    exported = load_trace(out)
    assert exported.requests == original.requests and exported.nodes == original.nodes


def test_trace_needs_one_node_or_a_pattern(
    api: KubeAPI, make_config: Callable[..., AgentConfig], tmp_path: Path
) -> None:
    env = stand_in_kubectl(tmp_path, make_config(), "none")
    done = kubectl_kvtier(api, env, "trace", "llama", "-n", NS, "-o", str(tmp_path / "t.jsonl"))
    assert done.returncode != 0
    assert "agents run on gpu-a, gpu-b: name one with --node" in done.stderr  # not gpu-c
    done = kubectl_kvtier(api, env, "trace", "llama", "-n", NS, "--node", "gpu-c")
    assert "no running agent of KVCacheTier inference/llama on node gpu-c" in done.stderr
    assert not Path(env["FAKE_KUBECTL_LOG"]).exists()  # nothing was exec'd


def test_rbac_refusal_is_reported(
    api: KubeAPI, make_config: Callable[..., AgentConfig], tmp_path: Path
) -> None:
    env = {**stand_in_kubectl(tmp_path, make_config(), "llama-agent-aaaaa"), "FAKE_FORBID": "1"}
    out = tmp_path / "t-{node}.jsonl"
    done = kubectl_kvtier(api, env, "trace", "llama", "-n", NS, "-o", str(out))
    assert done.returncode != 0
    assert "kubectl exec into llama-agent-aaaaa on gpu-a failed" in done.stderr
    assert 'cannot create resource "pods/exec"' in done.stderr
    assert not list(tmp_path.glob("t-*.jsonl"))
