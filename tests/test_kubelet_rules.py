"""kvtier as a real node runs it: the chart's CSI plugin, the operator's agent DaemonSet and
an injected client pod, each laid out and started by tests/kubelet.py the way kubelet and
containerd do (hostPaths that are mount points, Secret files root-owned with their
defaultMode unless fsGroup says otherwise, a CSI volume exactly as large as the plugin makes
it and kept across restarts, containers as the pod's uid and groups in a read-only root
filesystem). What passes here must not need anyone to touch the node:

- the plugin starts, and starts again, over a legacy hostPath that is a mount point;
- the agent restarts (in place and as a new pod) and is resized up and down, coming back
  warm every time: the chunks stored before are loaded back, byte for byte, and counted;
- the examples' peer and S3 tiers start with their Secrets mounted as kubelet mounts them.

Not played here (a real node checks them): the registrar and kubelet's plugin registration,
cgroup memory limits, the scheduler, in-cluster credentials (containers get a kubeconfig),
and engines that keep the pool mapped across an agent restart (clients here are pods that
come and go). Needs root, as CI has.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import jsonpatch
import pytest
import yaml
import zmq

from kvtier.api.config import AgentConfig
from kvtier.api.names import tier_dir, tier_group
from kvtier.api.units import parse_bytes
from kvtier.csi.mounts import mount_at
from kvtier.local import wait as polling
from kvtier.operator.builders import build_agent_config, build_children
from kvtier.operator.settings import OperatorSettings
from kvtier.operator.webhook import mutate_pod
from tests.chart_render import render
from tests.conftest import free_port
from tests.kube_api import KubeAPI
from tests.kubelet import REPO, Kubelet, Pod, node, wait_ready

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="mounts, chroot and other uids need root (CI runs as root)"
)
NAMESPACE = "team-a"
ROW = 2 << 20  # the CRD's default chunk size: the staging area is then its full 64 MiB
CHUNKS = 12
SETTINGS = OperatorSettings(image="registry.local/kvtier:test")
TIERS = f"/apis/kvtier.io/v1alpha1/namespaces/{NAMESPACE}/kvcachetiers"


@dataclass
class Cluster:
    api: KubeAPI
    kubelet: Kubelet
    plugin: Pod

    def apply_tier(self, tier: dict[str, Any]) -> dict[str, Any]:
        """Create or replace the KVCacheTier, as `kubectl apply` would."""
        name = tier["metadata"]["name"]
        code, _ = self.api.request("GET", f"{TIERS}/{name}")
        if code == 200:  # a merge patch of the spec (the emulated server has no PUT)
            code, body = self.api.request(
                "PATCH", f"{TIERS}/{name}", {"spec": tier["spec"]}, "application/merge-patch+json"
            )
            assert code == 200, body
            return dict(body)
        return self.api.create(TIERS, tier)

    def agent_pod(self, tier: dict[str, Any], metrics_port: int) -> Pod:
        """The tier's agent as its DaemonSet runs it on this node, with its ConfigMap."""
        children = {c["kind"]: c for c in build_children(tier, SETTINGS)}
        configmap = children["ConfigMap"]
        self.kubelet.configmaps[(NAMESPACE, configmap["metadata"]["name"])] = configmap["data"]
        template = children["DaemonSet"]["spec"]["template"]
        manifest = {
            "metadata": {"name": f"{tier['metadata']['name']}-agent", "namespace": NAMESPACE},
            "spec": copy.deepcopy(template["spec"]),
        }
        pod = self.kubelet.run_pod(manifest, {"metrics": metrics_port})
        container = manifest["spec"]["containers"][0]
        wait_ready(pod.containers[0], container["readinessProbe"])
        return pod

    def client(self, tier: dict[str, Any], action: str, count: int = CHUNKS) -> dict[str, Any]:
        """An injected pod (the webhook's mutation of a plain restricted pod) that stores or
        loads through the tier's volume, or tries to replace its pool (see
        tests/kubelet_client.py), as another uid with only the tier's group."""
        config = agent_config(tier)
        target = str(config.pool_path) if action == "replace" else config.endpoint
        pod = {
            "metadata": {
                "name": f"vllm-{action}",
                "namespace": NAMESPACE,
                "labels": {"app": "vllm"},
            },
            "spec": {
                "securityContext": {
                    "runAsNonRoot": True,
                    "runAsUser": 1000,
                    "runAsGroup": 1000,
                    "seccompProfile": {"type": "RuntimeDefault"},
                },
                "containers": [
                    {
                        "name": "vllm",
                        "image": "vllm/vllm-openai",
                        "command": [
                            sys.executable,
                            str(REPO / "tests/kubelet_client.py"),
                        ],
                        "args": [action, target, str(count), str(ROW)],
                        "securityContext": {
                            "allowPrivilegeEscalation": False,
                            "capabilities": {"drop": ["ALL"]},
                        },
                    }
                ],
            },
        }
        mutation = mutate_pod(pod, tier, SETTINGS)
        injected = jsonpatch.apply_patch(pod, mutation.patch)
        injected["spec"]["containers"][0]["args"] = pod["spec"]["containers"][0]["args"]
        running = self.kubelet.run_pod(injected)
        try:
            running.containers[0].process.wait(120)
            out = running.containers[0].log_tail(1)
            assert running.containers[0].process.returncode == 0, running.containers[0].log_tail()
            return dict(json.loads(out))
        finally:
            self.kubelet.delete_pod(running)


def agent_config(tier: dict[str, Any]) -> AgentConfig:
    return build_agent_config(tier, SETTINGS)


def host_tier(name: str, capacity: str, metrics_port: int) -> dict[str, Any]:
    return {
        "apiVersion": "kvtier.io/v1alpha1",
        "kind": "KVCacheTier",
        "metadata": {"name": name, "namespace": NAMESPACE, "uid": f"uid-{name}"},
        "spec": {
            "podSelector": {"matchLabels": {"app": "vllm"}},
            "host": {"capacity": capacity},
            "agent": {"metricsPort": metrics_port},
        },
    }


def plugin_manifest() -> dict[str, Any]:
    """The chart's CSI DaemonSet pod, its plugin container (the registrar is not played)."""
    objects = render()
    daemonset = next(
        o for o in objects if o["kind"] == "DaemonSet" and o["metadata"]["name"].endswith("-csi")
    )
    spec = copy.deepcopy(daemonset["spec"]["template"]["spec"])
    spec["containers"] = [c for c in spec["containers"] if c["name"] == "plugin"]
    spec["containers"][0]["args"].append("--sweep-seconds=1")
    return {"metadata": {"name": "kvtier-csi", "namespace": "kvtier-system"}, "spec": spec}


def start_plugin(kubelet: Kubelet) -> Pod:
    pod = kubelet.run_pod(plugin_manifest())
    socket = kubelet.host("/var/lib/kubelet/plugins/csi.kvtier.io/csi.sock")

    def up() -> bool:
        if not pod.containers[0].alive():
            raise RuntimeError(f"CSI plugin exited: {pod.containers[0].log_tail()}")
        return socket.exists()

    polling.wait_for(up, 30, interval=0.1)
    return pod


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    root = Path(tempfile.mkdtemp(prefix="kvtier-node-"))
    with KubeAPI(tmp_path) as api, node(root, "node-1", api.kubeconfig) as kubelet:
        driver = next(o for o in render() if o["kind"] == "CSIDriver")
        kubelet.csi_drivers[driver["metadata"]["name"]] = driver
        # What a version before the CSI plugin left on the node, in the chart's legacyPoolDir.
        legacy = kubelet.host("/dev/shm/kvtier")
        legacy.mkdir(parents=True)
        (legacy / "default.pool").write_bytes(b"\0" * 4096)
        (legacy / "default.pool.staging").write_bytes(b"\0" * 4096)
        (legacy / "notes.txt").write_text("not a pool")  # a file no agent made: kept
        yield Cluster(api, kubelet, start_plugin(kubelet))


def tier_mount(cluster: Cluster, tier: dict[str, Any]) -> Any:
    meta = tier["metadata"]
    return mount_at(
        cluster.kubelet.host(f"/var/lib/kvtier/csi/{tier_dir(NAMESPACE, meta['name'])}")
    )


def test_the_csi_plugin_starts_again_and_again_over_a_legacy_hostpath(cluster: Cluster) -> None:
    """The legacy hostPath is a mount point in the plugin's container: emptied, kept, and
    every later start finds it as it is."""
    legacy = cluster.kubelet.host("/dev/shm/kvtier")
    assert [p.name for p in legacy.iterdir()] == ["notes.txt"]
    for _ in range(3):
        container = cluster.kubelet.restart(cluster.plugin)
        polling.wait_for(lambda c=container: "serving on" in c.log_tail(50), 30, interval=0.1)
        assert container.alive(), container.log_tail()
    assert legacy.is_dir()


def _warm_check(cluster: Cluster, tier: dict[str, Any], agent: Pod) -> int:
    wait_ready(agent.containers[0], agent.manifest["spec"]["containers"][0]["readinessProbe"])
    return cluster.client(tier, "load")["identical"]


def _agent_with_chunks(cluster: Cluster, capacity: str) -> tuple[dict[str, Any], Pod, int]:
    """A tier's agent running, and CHUNKS chunks stored through it by an injected pod."""
    port = free_port()
    tier = host_tier("llama", capacity, port)
    cluster.apply_tier(tier)
    agent = cluster.agent_pod(tier, port)
    assert cluster.client(tier, "store") == {"stored": CHUNKS, "skipped": 0}
    return tier, agent, port


def test_an_agent_comes_back_warm_after_every_restart(cluster: Cluster) -> None:
    tier, agent, port = _agent_with_chunks(cluster, "160Mi")
    kept = []
    for _ in range(3):  # the container restarted in place: the same volume, its files kept
        cluster.kubelet.restart(agent)
        kept.append(_warm_check(cluster, tier, agent))
    cluster.kubelet.delete_pod(agent)  # a new pod (a rollout): the volume outlives it
    agent = cluster.agent_pod(tier, port)
    kept.append(_warm_check(cluster, tier, agent))
    assert kept == [CHUNKS] * 4, kept


def test_an_agent_comes_back_warm_after_resizes_up_and_down(cluster: Cluster) -> None:
    tier, agent, port = _agent_with_chunks(cluster, "160Mi")
    kept = []
    for capacity in ("224Mi", "96Mi"):  # resized up, then down below where it started
        tier = host_tier("llama", capacity, port)
        cluster.apply_tier(tier)
        cluster.kubelet.delete_pod(agent)  # the DaemonSet rolls its pod for the new config
        agent = cluster.agent_pod(tier, port)
        kept.append(_warm_check(cluster, tier, agent))
    assert kept == [CHUNKS] * 2, kept
    # The shrink the kernel refused while the old pool filled the volume goes through once
    # the agent has cut its pool's tail (a lease after its start) and the plugin sweeps.
    wanted = f"size={volume_bytes(tier) // 1024}k"
    lease = agent_config(tier).lease_timeout_seconds
    polling.wait_for(lambda: wanted in tier_mount(cluster, tier).options, lease + 30, interval=0.5)


def volume_bytes(tier: dict[str, Any]) -> int:
    from kvtier.csi.server import tier_volume_bytes

    return int(tier_volume_bytes(parse_bytes(tier["spec"]["host"]["capacity"]), ROW))


def _example(name: str) -> dict[str, Any]:
    return dict(yaml.safe_load((REPO / "examples" / name).read_text()))


def test_the_examples_peer_and_s3_tiers_start_with_secrets_as_kubelet_mounts_them(
    cluster: Cluster, s3_server: str
) -> None:
    """examples/host-peers-pd.yaml and examples/host-s3.yaml, sized for this machine and
    pointed at a local S3 server: their key and credential Secrets are root's files with the
    volume's defaultMode, readable to the agent's uid only through the pod's fsGroup."""
    public, secret = zmq.curve_keypair()
    cluster.kubelet.secrets[(NAMESPACE, "kvtier-curve")] = {
        "public.key": public,
        "secret.key": secret,
    }
    cluster.kubelet.secrets[(NAMESPACE, "kv-s3")] = {
        "accessKeyId": b"kvtier-test",
        "secretAccessKey": b"kvtier-test-secret",
    }
    boto3.client(
        "s3",
        endpoint_url=s3_server,
        region_name="us-east-1",
        aws_access_key_id="kvtier-test",
        aws_secret_access_key="kvtier-test-secret",
    ).create_bucket(Bucket="my-kv-cache")
    shared = Path(tempfile.mkdtemp(prefix="kvtier-rwx-"))  # a fresh export: root's, 0700
    cluster.kubelet.claims[(NAMESPACE, "kvcache-rwx")] = (shared, "File")
    for name in ("host-peers-pd.yaml", "host-s3.yaml"):
        tier = _example(name)
        port = free_port()
        tier["metadata"].update(namespace=NAMESPACE, uid=f"uid-{name}")
        tier["spec"]["host"]["capacity"] = "64Mi"
        tier["spec"]["agent"] = {"metricsPort": port}
        for entry in tier["spec"]["tiers"]:
            if "peer" in entry:
                entry["peer"]["port"] = free_port()
            if "objectStore" in entry:
                entry["objectStore"]["endpoint"] = s3_server
            if "filesystem" in entry:
                entry["filesystem"]["capacity"] = "1Gi"
        cluster.apply_tier(tier)
        agent = cluster.agent_pod(tier, port)
        secret_files = [
            f
            for volume, where in agent.volumes.items()
            if volume.startswith(("curve-", "s3-"))
            for f in where.glob("..data/*")
        ]
        assert secret_files and all(
            f.stat().st_uid == 0
            and f.stat().st_gid == tier_group(NAMESPACE, tier["metadata"]["name"])
            and f.stat().st_mode & 0o777 == 0o440
            for f in secret_files
        ), [(f, oct(f.stat().st_mode), f.stat().st_gid) for f in secret_files]
        names = [entry["name"] for entry in tier["spec"]["tiers"]]

        def healthy(tier: dict[str, Any] = tier, names: list[str] = names) -> bool:
            code, found = cluster.api.request(
                "GET", f"/apis/kvtier.io/v1alpha1/namespaces/{NAMESPACE}/kvcachenodes"
            )
            for item in found.get("items", []) if code == 200 else []:
                if item["spec"].get("tier") != tier["metadata"]["name"]:
                    continue
                status = item.get("status") or {}
                reported = {t.get("name") for t in status.get("tiers", [])}
                conditions = {c["type"]: c["status"] for c in status.get("conditions", [])}
                return set(names) <= reported and conditions.get("TiersHealthy") == "True"
            return False

        polling.wait_for(healthy, 60, interval=0.5)
        assert agent.containers[0].alive(), agent.containers[0].log_tail()
        cluster.kubelet.delete_pod(agent)
    shutil.rmtree(shared, ignore_errors=True)


def test_a_pod_of_the_tier_cannot_put_its_own_file_in_the_pools_place(cluster: Cluster) -> None:
    """The pool's directory is the agent's: a tier member (uid 1000 with the tier's group)
    that copies the pool, changes the copy's bytes and renames it over the pool is refused,
    so every client goes on loading the chunks that were stored, also after a restart."""
    tier, agent, _ = _agent_with_chunks(cluster, "64Mi")
    attempt = cluster.client(tier, "replace")
    loaded = cluster.client(tier, "load")
    assert loaded["identical"] == CHUNKS and attempt["replaced"] is False, (attempt, loaded)
    cluster.kubelet.restart(agent)
    assert _warm_check(cluster, tier, agent) == CHUNKS


def test_an_agent_never_takes_up_a_pool_file_it_did_not_make(cluster: Cluster) -> None:
    """A pool file of another uid where the pool goes (planted while an earlier layout let
    the tier's group write the directory) is removed and made anew, and said in the log;
    clients map only the agent's own."""
    port = free_port()
    tier = host_tier("llama", "64Mi", port)
    cluster.apply_tier(tier)
    first = cluster.agent_pod(tier, port)
    volume = cluster.kubelet.host(f"/var/lib/kvtier/csi/{tier_dir(NAMESPACE, 'llama')}")
    pool = volume / "pool" / agent_config(tier).pool_path.name
    cluster.kubelet.delete_pod(first)
    os.chown(pool, 1000, -1)  # as if a tier member had put it there
    agent = cluster.agent_pod(tier, port)
    assert pool.stat().st_uid == SETTINGS.agent_uid
    log = agent.containers[0].log_tail(200)
    assert "made by uid 1000 and not by this agent" in log, log
    assert cluster.client(tier, "store")["stored"] == CHUNKS
    assert cluster.client(tier, "load")["identical"] == CHUNKS
